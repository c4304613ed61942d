"""``check_layout`` over arrays: the first violated rule of every layout in a ``Grid``.

A transcription of ``luban.parallel.layout.check_keys`` and ``check_layout``, rule for rule and
in the same order (``tests/plan/test_rules.py`` samples random layouts and asserts agreement).
``pp_split`` and ``mesh_order`` are not searched, so they are not checked here.
"""

from __future__ import annotations

import numpy as np

from luban.model.config import ModelConfig
from luban.parallel import schedules
from luban.parallel.layout import LUBAN_RULES, OFFLOADS, PRECISIONS, empty_shards
from luban.plan.grid import FP16, OPTIMIZER_OFFLOAD, PARAMS_OFFLOAD, Grid
from luban.plan.memory import host_state_offload

OK = 0
REASONS = (
    "valid",
    "precision not run by this runtime",
    "offload not run by this runtime",
    "ZeRO stage not run by this runtime",
    "context parallel not run by this runtime",
    "dp_replicate must divide dp",
    "dp_replicate > 1 needs zero >= 2",
    "tp > 1 with dp*cp > 1 needs zero >= 1",
    "ep must divide dp*cp",
    "ep > 1 with offload = optimizer or params",
    "sp needs tp > 1",
    "fp16 needs a dynamic loss scale",
    "offload = params needs zero = 3",
    "offload = optimizer needs zero >= 1",
    "virtual_stages outside the schedule's range (1 at pp = 1)",
    "zero-bubble/dualpipev with dp*cp > 1 need zero >= 1",
    "dp*tp*pp*cp != GPUs",
    "tp must divide heads, kv_heads and ffn_hidden (and expert_ffn_hidden where tp splits the experts)",
    "ep > 1 needs a MoE model whose experts ep divides",
    "cp > 1 needs model.dropout = 0",
    "cp > 1 with a MoE expert capacity (capacity_factor > 0)",
    "seq must split into cp (x2) (x tp with sp) chunks",
    "tp leaves a rank no vocabulary rows",
    "pp * virtual_stages > layers",
    "global batch not divisible by dp * micro_batch",
    "too few micro-batches for the pipeline schedule",
    "micro-batches not a multiple of pp (interleaved/zero-bubble)",
    "does not fit in GPU memory",
    "offloaded state does not fit in host memory",
)
NO_GPU_MEMORY, NO_HOST_MEMORY = len(REASONS) - 2, len(REASONS) - 1


def violations(g: Grid, model: ModelConfig, global_batch: int, gpus: int, seq: int, rules=LUBAN_RULES) -> list:
    """The rule conditions (True = violated), in ``REASONS`` order after "valid"; ``rules``: the
    runtime's layout rules (``luban.parallel.layout.RuntimeRules`` or a planner runtime model)."""
    pp_on = g.pp > 1
    v = g.virtual_stages
    shards = schedules.sequence_shards(g.cp, g.tp, g.sp)
    per_step = g.dp * g.micro_batch
    m = schedules.microbatches(global_batch, g.dp, g.micro_batch)
    need = schedules.min_microbatches(g.schedule, g.pp)
    v_min, v_max, split_backward, rounds = schedules.per_schedule(g.schedule, lambda s: (
        s.min_virtual, s.max_virtual or np.iinfo(np.int64).max, s.split_backward, s.rounds_of_pp))
    stages = g.pp * v
    run = np.array([p in rules.precisions for p in PRECISIONS])
    offloads = np.array([o in rules.offloads for o in OFFLOADS])
    zeros = np.array([z in rules.zeros for z in range(4)])
    return [
        ~run[g.precision],
        ~offloads[g.offload],
        ~zeros[g.zero],
        (g.cp > 1) & (not rules.context_parallel),
        g.dp % g.dp_replicate != 0,
        (g.dp_replicate > 1) & (g.zero < 2),
        (g.tp > 1) & (g.zero == 0) & (g.dp * g.cp > 1) & (not rules.ddp_with_tp),
        (g.dp * g.cp) % g.ep != 0,
        (g.ep > 1) & host_state_offload(g),
        g.sp & (g.tp == 1),
        (g.precision == FP16) & g.loss_scale_none,
        (g.offload == PARAMS_OFFLOAD) & (g.zero != 3),
        (g.offload == OPTIMIZER_OFFLOAD) & (g.zero < 1),
        np.where(pp_on, (v < v_min) | (v > v_max), v != 1),
        pp_on & (split_backward != 0) & (g.zero == 0) & (g.dp * g.cp > 1) & (not rules.ddp_with_split_backward),
        g.dp * g.tp * g.pp * g.cp != gpus,
        (model.heads % g.tp != 0) | (model.kv_heads % g.tp != 0) | (model.ffn_hidden % g.tp != 0)
        | (model.moe & getattr(rules, "expert_tp", False) & (model.expert_ffn_hidden % g.tp != 0)),
        (g.ep > 1) & ((not model.moe) | (max(model.experts, 1) % g.ep != 0)),
        (g.cp > 1) & (model.dropout > 0),
        (g.cp > 1) & model.moe & (model.capacity_factor > 0),
        seq % shards != 0,
        empty_shards(model.vocab, g.tp),
        stages > model.layers,
        global_batch % per_step != 0,
        pp_on & (m < need),
        pp_on & (rounds != 0) & (m % g.pp != 0),
    ]


def first_violation(g: Grid, model: ModelConfig, global_batch: int, gpus: int, seq: int, extra=(),
                    rules=LUBAN_RULES):
    """Index into ``REASONS`` of the first violated rule per layout (0: valid). ``extra`` adds
    further conditions (the memory checks) after the layout rules."""
    return _first(violations(g, model, global_batch, gpus, seq, rules) + list(extra), g.shape)


def _first(conditions: list, shape: tuple):
    """Index (1-based) of the first true condition per entry of ``shape`` (0: none)."""
    code = np.zeros(shape, dtype=np.int8)
    for k in range(len(conditions), 0, -1):
        code = np.where(conditions[k - 1], np.int8(k), code)
    return code


def rule_counts(g: Grid, model: ModelConfig, global_batch: int, gpus: int, seq: int, rules=LUBAN_RULES,
                upto: int | None = None) -> np.ndarray:
    """Layouts of ``g`` per ``REASONS`` index of their first violated layout rule (no memory checks):
    ``first_violation``'s counts, without spreading the codes over the axes the rules looked at do not
    depend on (no rule reads recompute; only the last three read micro_batch): each code is counted once
    for every layout it broadcasts to. ``upto``: look at the first ``upto`` rules only, exact for layouts
    that violate one of them (the search's rows that a rule of their own knobs rejects)."""
    conditions = violations(g, model, global_batch, gpus, seq, rules)[:upto]
    code = _first(conditions, np.broadcast_shapes(*(np.shape(c) for c in conditions)))
    return np.bincount(code.ravel(), minlength=len(REASONS)) * (int(np.prod(g.shape)) // code.size)
