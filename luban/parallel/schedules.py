"""Layout arithmetic, written once: one registry entry per pipeline schedule.

Every quantity that depends on the pipeline schedule — its ``torch.distributed.pipelining``
class, where each model chunk (stage) lives, how many layers each stage gets, the fewest
micro-batches it runs with, how many micro-batches are in flight at the peak and the bubble —
is defined here and nowhere else. The runtime (``luban.parallel.pipeline``, the engine),
``check_layout`` (``luban.parallel.layout``) and the planner's vectorised arrays
(``luban.plan``) all call these functions, which accept Python ints or broadcast numpy arrays.
The module imports no torch, so the planner stays light; ``Schedule.torch_class()`` resolves
the class on demand.

=================  ===============================  =========  ==================================
schedule           class                            placement  paper
=================  ===============================  =========  ==================================
gpipe              ScheduleGPipe                    1 / rank   Huang et al. 2019
1f1b               Schedule1F1B                     1 / rank   Narayanan et al. 2019 (PipeDream-Flush)
interleaved-1f1b   ScheduleInterleaved1F1B          loop       Narayanan et al. 2021
zero-bubble        ScheduleInterleavedZeroBubble    loop       Qi et al. 2023 (split dI/dW backward)
dualpipev          ScheduleDualPipeV                V          DeepSeek-V3 2024 (DualPipe, V variant)
=================  ===============================  =========  ==================================

"loop": rank r holds stages r, r+pp, r+2pp, ... (torch's default stage-to-rank mapping);
"V": rank r holds stages r and 2pp−1−r, so the first and the last stage share rank 0.

Layers per stage (``stage_layer_counts``) is a closed form rather than a search so that the
planner can evaluate it on arrays of millions of layouts: with every layer costing the same
and the LM head costing ``head`` layers on the last stage, the last stage gets ``n`` layers
and the other stages share the rest evenly, the first ``rem`` of them one more; ``n`` is the
integer next to the continuous optimum (L − head·(S−1))/S whose most expensive stage is
cheaper (ties: fewer layers beside the head). This minimises the most expensive stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

LOOP, V = "loop", "v"


@dataclass(frozen=True)
class Schedule:
    name: str
    class_name: str  # in torch.distributed.pipelining.schedules
    placement: str  # LOOP or V
    min_virtual: int  # stages per rank allowed: min_virtual .. max_virtual (None: unbounded)
    max_virtual: int | None
    split_backward: bool  # input and weight gradients in separate passes (DDP cannot reduce them)
    rounds_of_pp: bool  # micro-batches must be a multiple of pp (torch's interleaved schedules)
    paper: str
    min_microbatches: Callable  # (pp) -> fewest micro-batches
    in_flight: Callable  # (pp, v, m) -> micro-batches held at the peak by (rank 0, last-stage rank)
    bubble: Callable  # (pp, v, F, B, W) -> idle seconds of the slowest rank per step

    @property
    def code(self) -> int:
        return NAMES.index(self.name)

    @property
    def single_stage(self) -> bool:
        """torch's ``PipelineScheduleSingle``: takes one stage, not a list."""
        return self.max_virtual == 1

    def torch_class(self):
        from torch.distributed.pipelining import schedules

        return getattr(schedules, self.class_name)

    def virtual_rule(self) -> str:
        """What ``virtual_stages`` this schedule takes, in words."""
        if self.max_virtual == self.min_virtual:
            return f"exactly {self.min_virtual} stage{'s' if self.min_virtual > 1 else ''} per rank" + (
                " (a V shape)" if self.placement == V else "")
        return f">= {self.min_virtual} stages per rank"

    def stages(self, pp, v):
        """Model chunks over the whole pipeline."""
        return pp * v

    def stage_ids(self, pp_rank: int, pp: int, v: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` holds, in execution order."""
        if self.placement == V:
            return [pp_rank, 2 * pp - 1 - pp_rank]
        return [pp_rank + i * pp for i in range(v)]

    def rank_of(self, stage: int, pp: int, v: int) -> int:
        """The pipeline rank holding ``stage``."""
        return stage % pp if self.placement == LOOP else min(stage, 2 * pp - 1 - stage)


# ---- in flight: micro-batches whose activations a rank holds at the peak, in units of one
# micro-batch through the rank's whole share of layers; torch's warm-up counts + 1, over v.

def _gpipe_in_flight(p, v, m):
    return m, m  # all forwards before any backward (Huang et al. 2019)


def _one_f_one_b_in_flight(p, v, m):
    return p, 1  # rank r warms up p − r − 1 forwards (Narayanan et al. 2019)


def _interleaved_in_flight(p, v, m):
    # torch _get_warmup_ops(multiply_factor=2): (v−1)·p + 2(p−1−r) chunk forwards before the first
    # backward; rank 0: p·(1 + (p−1)/(p·v)) micro-batches, Korthikanti et al. 2022 Sec. 4.2.3
    return ((p - 1) * 2 + (v - 1) * p + 1) / v, ((v - 1) * p + 1) / v


def _zero_bubble_in_flight(p, v, m):
    # torch _get_warmup_ops(multiply_factor=1): (v−1)·p + (p−1−r) chunk forwards
    return p + 0 * v, ((v - 1) * p + 1) / v


def _dualpipev_in_flight(p, v, m):
    return p + 1, p + 1  # DeepSeek-V3 report, Table 2 (PP + 1); rank 0 is both ends of the V


# ---- bubble: F, B, W are one micro-batch through the rank's whole share of layers (B includes
# the weight-gradient part W, which the split-backward schedules can defer).

def _flush_bubble(p, v, F, B, W):
    return (p - 1) * (F + B)  # the fraction (p−1)/m of Narayanan et al. 2021 Sec. 2.2


def _interleaved_bubble(p, v, F, B, W):
    return (p - 1) * (F + B) / v  # Narayanan et al. 2021 Sec. 2.2


def _zero_bubble_bubble(p, v, F, B, W):
    return (p - 1) * np.maximum(0.0, F + (B - W) - 2 * W) / v  # Qi et al. 2023, ZB-H2 per chunk


def _dualpipev_bubble(p, v, F, B, W):
    # DeepSeek-V3 report, Table 2: (PP/2 − 1)·(F&B + B − 3W) per chunk of half a rank's layers
    b_in = B - W
    return np.maximum(0.0, p / 2 - 1) * np.maximum(0.0, (F + b_in + W) / 2 + b_in / 2 - 3 * W / 2)


def _one(p):
    return 1 + 0 * p


def _pp(p):
    return p


def _two_pp(p):
    return 2 * p  # DualPipeV needs at least 2·pp micro-batches (torch ScheduleDualPipeV)


REGISTRY = (
    Schedule("gpipe", "ScheduleGPipe", LOOP, 1, 1, False, False, "Huang et al. 2019",
             _one, _gpipe_in_flight, _flush_bubble),
    Schedule("1f1b", "Schedule1F1B", LOOP, 1, 1, False, False, "Narayanan et al. 2019",
             _pp, _one_f_one_b_in_flight, _flush_bubble),
    Schedule("interleaved-1f1b", "ScheduleInterleaved1F1B", LOOP, 2, None, False, True, "Narayanan et al. 2021",
             _pp, _interleaved_in_flight, _interleaved_bubble),
    Schedule("zero-bubble", "ScheduleInterleavedZeroBubble", LOOP, 2, None, True, True, "Qi et al. 2023",
             _pp, _zero_bubble_in_flight, _zero_bubble_bubble),
    Schedule("dualpipev", "ScheduleDualPipeV", V, 2, 2, True, False, "DeepSeek-AI 2024",
             _two_pp, _dualpipev_in_flight, _dualpipev_bubble),
)
NAMES = tuple(s.name for s in REGISTRY)
BY_NAME = {s.name: s for s in REGISTRY}


def get(name: str) -> Schedule:
    return BY_NAME[name]


def per_schedule(code, fn: Callable):
    """``fn(schedule)`` for each layout's schedule ``code`` (an array of indices into REGISTRY):
    each entry's formula evaluated once, then selected per layout."""
    code = np.asarray(code)
    if code.ndim == 0:
        return fn(REGISTRY[int(code)])
    values = [fn(s) for s in REGISTRY]
    if isinstance(values[0], tuple):
        return tuple(_select(code, [v[i] for v in values]) for i in range(len(values[0])))
    return _select(code, values)


def _select(code, values):
    out = np.asarray(values[0], dtype=float)
    for k in range(1, len(values)):
        out = np.where(code == k, values[k], out)
    return out


def is_v(code):
    """Layouts whose schedule places the first and the last stage on rank 0."""
    return np.isin(code, [s.code for s in REGISTRY if s.placement == V])


# ---- layers per stage -----------------------------------------------------------------------

def head_layers(cfg) -> float:
    """The LM head's forward FLOPs per token in units of one layer's (``luban.model.flops``; the
    layer's attention at the model's ``seq_len``): what the last stage pays beyond its layers.
    Embedding lookups cost no FLOPs."""
    from luban.model import flops

    return flops.head_flops(cfg) / (flops.layer_matmul_flops(cfg) + flops.attention_core_flops(cfg, cfg.seq_len))


def last_stage_layers(layers, stages, head):
    """Layers of the last stage (closed form, module docstring). ``head``: the LM head's cost in
    layers (forward FLOPs of the head / of one layer)."""
    layers, stages = np.asarray(layers), np.asarray(stages)
    others = np.maximum(stages - 1, 1)
    lo = np.floor((layers - head * (stages - 1)) / stages)
    candidates = [np.clip(lo + k, 1, layers - stages + 1) for k in (0, 1)]
    costs = [np.maximum(-(-(layers - n) // others), n + head) for n in candidates]
    n = np.where(costs[1] < costs[0], candidates[1], candidates[0])
    return np.where(stages == 1, layers, n).astype(np.int64)


def stage_layer_counts(layers: int, stages: int, head: float) -> list[int]:
    """Layers of each stage (the runtime's split; the planner's arrays use ``rank_layers``)."""
    n = int(last_stage_layers(layers, stages, head))
    if stages == 1:
        return [layers]
    base, rem = divmod(layers - n, stages - 1)
    return [base + (i < rem) for i in range(stages - 1)] + [n]


def rank_layers(layers, pp, v, head, code):
    """Layers on (rank 0, the rank of the last stage, the busiest rank) under the closed-form
    split, as arrays over ``pp``, ``v`` and schedule ``code`` (V placement: 2 stages per rank).
    Equal to summing ``stage_layer_counts`` over ``Schedule.stage_ids`` (tested)."""
    pp, v = np.asarray(pp), np.asarray(v)
    vshape = is_v(code)
    v = np.where(vshape, 2, v)
    stages = pp * v
    n = last_stage_layers(layers, stages, head)
    others = np.maximum(stages - 1, 1)
    base, rem = (layers - n) // others, (layers - n) % others
    # loop: rank 0 holds stages 0, pp, 2pp, ... of which those < rem have base + 1 layers;
    # rank pp−1 holds pp−1, 2pp−1, ..., and the last stage
    loop_first = v * base + np.minimum(v, -(-rem // pp))
    loop_last = (v - 1) * base + np.minimum(v - 1, rem // pp) + n
    # V: rank 0 holds stage 0 and the last; rank r > 0 holds r and 2pp−1−r
    v_first = base + (rem > 0) + n
    both = np.maximum(1, 2 * pp - rem) <= np.minimum(pp - 1, rem - 1)
    v_other = 2 * base + np.where(both, 2, np.where(rem > 1, 1, 0))
    first = np.where(vshape, v_first, loop_first)
    last = np.where(vshape, v_first, loop_last)
    most = np.maximum(np.maximum(first, last), np.where(vshape & (pp > 1), v_other, 0))
    single = pp == 1
    return tuple(np.where(single, layers, x) for x in (first, last, most))


def split_rank_layers(schedule: Schedule, pp: int, v: int, counts) -> tuple[int, int, int]:
    """(rank 0, last-stage rank, busiest rank) layers for explicit per-stage ``counts``."""
    per_rank = [sum(counts[s] for s in schedule.stage_ids(r, pp, v)) for r in range(pp)]
    last = schedule.rank_of(len(counts) - 1, pp, v)
    return per_rank[0], per_rank[last], max(per_rank)


# ---- micro-batches and sequence shards --------------------------------------------------------

def microbatches(global_batch, dp, micro_batch):
    """Micro-batches per data-parallel rank and step."""
    return global_batch // (dp * micro_batch)


def min_microbatches(code, pp):
    """Fewest micro-batches the schedule runs with (1 without a pipeline)."""
    return np.where(np.asarray(pp) > 1, per_schedule(code, lambda s: s.min_microbatches(pp)), 1).astype(np.int64)


def sequence_shards(cp, tp, sp):
    """Equal chunks the sequence is cut into: 2·cp load-balanced chunks under context parallel
    (``luban.parallel.context_parallel``), times tp for sequence parallel."""
    cp = np.asarray(cp)
    return cp * np.where(cp > 1, 2, 1) * np.where(sp, tp, 1)
