"""``check_layout`` over arrays: the first violated rule of every layout in a ``Grid``.

A transcription of ``luban.parallel.layout.check_keys`` and ``check_layout``, rule for rule and
in the same order (``tests/plan/test_rules.py`` samples random layouts and asserts agreement).
``pp_split`` and ``mesh_order`` are not searched, so they are not checked here.
"""

from __future__ import annotations

import numpy as np

from luban.model.config import ModelConfig
from luban.parallel.layout import PRECISIONS
from luban.plan.grid import DUALPIPEV, GPIPE, INTERLEAVED, ONE_F_ONE_B, ZERO_BUBBLE, Grid

FP16 = PRECISIONS.index("fp16")
OK = 0
REASONS = (
    "valid",
    "dp_replicate must divide dp",
    "dp_replicate > 1 needs zero >= 2",
    "tp > 1 with dp*cp > 1 needs zero >= 1",
    "sp needs tp > 1",
    "fp16 needs a dynamic loss scale",
    "offload = params needs zero = 3",
    "offload = optimizer needs zero >= 1",
    "gpipe/1f1b take virtual_stages = 1",
    "interleaved/zero-bubble need virtual_stages >= 2",
    "zero-bubble/dualpipev with dp*cp > 1 need zero >= 1",
    "dualpipev needs virtual_stages = 2",
    "dp*tp*pp*cp != GPUs",
    "tp must divide heads, kv_heads and ffn_hidden",
    "cp > 1 needs model.dropout = 0",
    "seq must split into cp (x2) (x tp with sp) chunks",
    "pp * virtual_stages > layers",
    "global batch not divisible by dp * micro_batch",
    "too few micro-batches for the pipeline schedule",
    "micro-batches not a multiple of pp (interleaved/zero-bubble)",
    "does not fit in GPU memory",
    "offloaded state does not fit in host memory",
)
NO_GPU_MEMORY, NO_HOST_MEMORY = len(REASONS) - 2, len(REASONS) - 1


def violations(g: Grid, model: ModelConfig, global_batch: int, gpus: int, seq: int) -> list:
    """The rule conditions (True = violated), in ``REASONS`` order after "valid"."""
    pp_on = g.pp > 1
    v = g.virtual_stages
    shards = g.cp * np.where(g.cp > 1, 2, 1) * np.where(g.sp, g.tp, 1)
    per_step = g.dp * g.micro_batch
    m = global_batch // per_step
    need = np.where(g.schedule == GPIPE, 1, np.where(g.schedule == DUALPIPEV, 2 * g.pp, g.pp))
    multi_chunk = (g.schedule == INTERLEAVED) | (g.schedule == ZERO_BUBBLE)
    split_backward = (g.schedule == ZERO_BUBBLE) | (g.schedule == DUALPIPEV)
    return [
        g.dp % g.dp_replicate != 0,
        (g.dp_replicate > 1) & (g.zero < 2),
        (g.tp > 1) & (g.zero == 0) & (g.dp * g.cp > 1),
        g.sp & (g.tp == 1),
        (g.precision == FP16) & g.loss_scale_none,
        (g.offload == 2) & (g.zero != 3),
        (g.offload == 1) & (g.zero < 1),
        pp_on & ((g.schedule == GPIPE) | (g.schedule == ONE_F_ONE_B)) & (v != 1),
        pp_on & multi_chunk & (v < 2),
        pp_on & split_backward & (g.zero == 0) & (g.dp * g.cp > 1),
        pp_on & (g.schedule == DUALPIPEV) & (v != 2),
        g.dp * g.tp * g.pp * g.cp != gpus,
        (model.heads % g.tp != 0) | (model.kv_heads % g.tp != 0) | (model.ffn_hidden % g.tp != 0),
        (g.cp > 1) & (model.dropout > 0),
        seq % shards != 0,
        g.pp * v > model.layers,
        global_batch % per_step != 0,
        pp_on & (m < need),
        pp_on & multi_chunk & (m % g.pp != 0),
    ]


def first_violation(g: Grid, model: ModelConfig, global_batch: int, gpus: int, seq: int, extra=()):
    """Index into ``REASONS`` of the first violated rule per layout (0: valid). ``extra`` adds
    further conditions (the memory checks) after the layout rules."""
    conditions = violations(g, model, global_batch, gpus, seq) + list(extra)
    code = np.zeros(g.shape, dtype=np.int8)
    for k in range(len(conditions), 0, -1):
        code = np.where(conditions[k - 1], np.int8(k), code)
    return code
