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

from luban.parallel.layout import OFFLOADS, PRECISIONS, SCHEDULES, ParallelLayout, parse_recompute

RECOMPUTES = ("none", "selective", "full")
GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE, DUALPIPEV = range(len(SCHEDULES))
NO_RECOMPUTE, SELECTIVE, FULL = range(len(RECOMPUTES))
FP32 = PRECISIONS.index("fp32")


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
    max_stage_layers: np.ndarray | None = None  # from an explicit pp_split; None: even split

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
            loss_scale_none=np.array(layout.loss_scale == "none"),
            max_stage_layers=_max_stage_layers(layout) if layout.pp_split else None)

    @property
    def shape(self) -> tuple[int, ...]:
        return np.broadcast_shapes(*(np.shape(getattr(self, f.name)) for f in dataclasses.fields(self)
                                     if getattr(self, f.name) is not None))

    def layout(self, index: tuple[int, ...] | int = ()) -> ParallelLayout:
        """The ``ParallelLayout`` at ``index`` (a flat index or a tuple into ``shape``)."""
        shape = self.shape
        idx = np.unravel_index(index, shape) if isinstance(index, (int, np.integer)) else index

        def get(name):
            arr = np.broadcast_to(getattr(self, name), shape)
            return arr[idx].item()

        rc = RECOMPUTES[get("recompute")]
        every = get("recompute_every")
        if rc == "full" and every > 1:
            rc = f"full:{every}"
        return ParallelLayout(
            dp=get("dp"), dp_replicate=get("dp_replicate"), zero=get("zero"), tp=get("tp"), sp=bool(get("sp")),
            pp=get("pp"), schedule=SCHEDULES[get("schedule")], virtual_stages=get("virtual_stages"),
            cp=get("cp"), micro_batch=get("micro_batch"), recompute=rc, offload=OFFLOADS[get("offload")],
            precision=PRECISIONS[get("precision")], loss_scale="none" if get("loss_scale_none") else "dynamic")


def _max_stage_layers(layout: ParallelLayout) -> np.ndarray:
    """Most layers any rank holds when chunk j of the ``pp_split`` goes to rank j mod pp."""
    per_rank = [0] * layout.pp
    for j, n in enumerate(layout.pp_split):
        per_rank[j % layout.pp] += n
    return np.array(max(per_rank))
