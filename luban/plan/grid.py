"""``Grid``: layouts as numpy arrays, so one set of formulas estimates one layout or millions.

Every field of ``ParallelLayout`` that the planner models is an array; the arrays broadcast
against each other (the search gives each knob its own axis, so a quantity that depends on
few knobs is computed once per combination of those knobs only). Estimating one layout is the
0-d case: ``Grid.from_layout(layout)``. Strings are coded as indices into the tuples below.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from luban.parallel import schedules
from luban.parallel.layout import (OFFLOADS, PRECISIONS, RECOMPUTES, SCHEDULES, ParallelLayout, format_recompute,
                                   parse_recompute)

NO_RECOMPUTE, SELECTIVE, FULL = range(len(RECOMPUTES))
FP32, BF16, FP16, FP8 = (PRECISIONS.index(p) for p in ("fp32", "bf16", "fp16", "fp8"))
NO_OFFLOAD, OPTIMIZER_OFFLOAD, PARAMS_OFFLOAD, ACTIVATIONS_OFFLOAD, BLOCKS_OFFLOAD = (
    OFFLOADS.index(k) for k in ("none", "optimizer", "params", "activations", "blocks"))


@dataclass
class Grid:
    dp: np.ndarray
    zero: np.ndarray
    tp: np.ndarray
    sp: np.ndarray
    pp: np.ndarray
    schedule: np.ndarray
    virtual_stages: np.ndarray
    cp: np.ndarray
    micro_batch: np.ndarray
    recompute: np.ndarray
    offload: np.ndarray
    precision: np.ndarray
    recompute_every: np.ndarray = dataclasses.field(default_factory=lambda: np.array(1))
    dp_replicate: np.ndarray = dataclasses.field(default_factory=lambda: np.array(1))
    loss_scale_none: np.ndarray = dataclasses.field(default_factory=lambda: np.array(False))
    ep: np.ndarray = dataclasses.field(default_factory=lambda: np.array(1))  # expert parallel (borrows dp*cp ranks)
    stage_layers: tuple | None = None  # (rank 0, last-stage rank, busiest) from an explicit pp_split

    @classmethod
    def from_layout(cls, layout: ParallelLayout) -> "Grid":
        mode, every = parse_recompute(layout.recompute)
        return cls(
            dp=np.array(layout.dp), zero=np.array(layout.zero), tp=np.array(layout.tp), sp=np.array(layout.sp),
            pp=np.array(layout.pp), schedule=np.array(SCHEDULES.index(layout.schedule)),
            virtual_stages=np.array(layout.virtual_stages), cp=np.array(layout.cp),
            micro_batch=np.array(layout.micro_batch), recompute=np.array(RECOMPUTES.index(mode)),
            offload=np.array(OFFLOADS.index(layout.offload)), precision=np.array(PRECISIONS.index(layout.precision)),
            recompute_every=np.array(every), dp_replicate=np.array(layout.dp_replicate),
            loss_scale_none=np.array(layout.loss_scale == "none"), ep=np.array(layout.ep),
            stage_layers=_split_rank_layers(layout) if layout.pp_split else None)

    @property
    def shape(self) -> tuple[int, ...]:
        return np.broadcast_shapes(*(np.shape(getattr(self, f.name)) for f in dataclasses.fields(self)
                                     if f.name != "stage_layers"))

    def layout(self, index: tuple[int, ...] | int = ()) -> ParallelLayout:
        """The ``ParallelLayout`` at ``index`` (a flat index or a tuple into ``shape``)."""
        shape = self.shape
        idx = np.unravel_index(index, shape) if isinstance(index, (int, np.integer)) else index

        def get(name):
            arr = np.broadcast_to(getattr(self, name), shape)
            return arr[idx].item()

        rc = format_recompute(RECOMPUTES[get("recompute")], get("recompute_every"))
        return ParallelLayout(
            dp=get("dp"), dp_replicate=get("dp_replicate"), zero=get("zero"), tp=get("tp"), sp=bool(get("sp")),
            pp=get("pp"), schedule=SCHEDULES[get("schedule")], virtual_stages=get("virtual_stages"),
            cp=get("cp"), micro_batch=get("micro_batch"), recompute=rc, offload=OFFLOADS[get("offload")],
            precision=PRECISIONS[get("precision")], loss_scale="none" if get("loss_scale_none") else "dynamic",
            ep=get("ep"))


def _split_rank_layers(layout: ParallelLayout) -> tuple:
    """Layers on (rank 0, the last stage's rank, the busiest rank) for an explicit ``pp_split``,
    placed by the schedule (``luban.parallel.schedules``)."""
    sched = schedules.get(layout.schedule)
    return tuple(np.array(x) for x in schedules.split_rank_layers(sched, layout.pp, layout.virtual_stages,
                                                                   layout.pp_split))
