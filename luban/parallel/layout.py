"""``ParallelLayout``: the ``[parallel]`` config section and its compatibility rules.

The key names are shared with the planner's flags (``luban plan estimate --tp 2`` ↔
``[parallel] tp = 2``), so a plan can be pasted into a training config. ``check_layout`` is
the one statement of which combinations are valid; the planner's vectorised search is
tested against it. The compatibility matrix in docs/parallelism.md is written from it.

World size = dp · tp · pp · cp. Ranks are laid out by ``mesh_order`` (outermost first);
the default ``pp,dp,cp,tp`` puts tensor parallel innermost so that its frequent
collectives stay inside a node (Narayanan et al. 2021, Sec. 3.3).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from luban.errors import LubanError, bad_value
from luban.model.config import ModelConfig

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "dualpipev")
OFFLOADS = ("none", "optimizer", "params")
PRECISIONS = ("fp32", "bf16", "fp16")
LOSS_SCALES = ("dynamic", "none")
MESH_DIMS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class ParallelLayout:
    dp: int = 1
    dp_replicate: int = 1
    zero: int = 0
    bucket_mb: int = 25
    tp: int = 1
    sp: bool = False
    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    pp_split: tuple[int, ...] = ()
    cp: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    offload: str = "none"
    precision: str = "fp32"
    loss_scale: str = "dynamic"
    mesh_order: str = "pp,dp,cp,tp"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    def num_microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch)

    def replace(self, **changes) -> "ParallelLayout":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("extra")
        d["pp_split"] = list(self.pp_split)
        return d

    @classmethod
    def from_dict(cls, raw: dict, section: str = "parallel") -> "ParallelLayout":
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        values = {}
        for key, value in raw.items():
            if key not in fields:
                raise LubanError(f"{section}.{key}: unknown key; allowed: {', '.join(fields)}")
            default = fields[key].default
            if key == "pp_split":
                if not isinstance(value, (list, tuple)) or not all(_is_int(v) for v in value):
                    raise bad_value(f"{section}.{key}", value, "must be a list of layer counts, one per stage")
                value = tuple(value)
            elif isinstance(default, bool):
                if not isinstance(value, bool):
                    raise bad_value(f"{section}.{key}", value, "must be true or false")
            elif isinstance(default, int):
                if not _is_int(value) or value < (0 if key == "zero" else 1):
                    raise bad_value(f"{section}.{key}", value, "must be a positive integer")
            elif isinstance(default, str) and not isinstance(value, str):
                raise bad_value(f"{section}.{key}", value, "must be a string")
            values[key] = value
        layout = cls(**values)
        layout.check_keys(section)
        return layout

    def check_keys(self, section: str = "parallel") -> None:
        """Checks that need no model: value ranges and key-to-key rules."""
        def choose(key, allowed):
            if getattr(self, key) not in allowed:
                raise bad_value(f"{section}.{key}", getattr(self, key), f"one of {', '.join(map(str, allowed))}")

        choose("zero", (0, 1, 2, 3))
        choose("schedule", SCHEDULES)
        choose("offload", OFFLOADS)
        choose("precision", PRECISIONS)
        choose("loss_scale", LOSS_SCALES)
        parse_recompute(self.recompute, f"{section}.recompute")
        order = self.mesh_order.split(",")
        if sorted(order) != sorted(MESH_DIMS):
            raise bad_value(f"{section}.mesh_order", self.mesh_order, f"a permutation of {','.join(MESH_DIMS)}")
        if self.dp % self.dp_replicate:
            raise bad_value(f"{section}.dp_replicate", self.dp_replicate,
                            f"must divide dp = {self.dp}; nearest: {_nearest(_divisors(self.dp), self.dp_replicate)}")
        if self.dp_replicate > 1 and self.zero < 2:
            raise bad_value(f"{section}.dp_replicate", self.dp_replicate,
                            f"hybrid sharding needs zero = 2 or 3 (zero = {self.zero}); set dp_replicate = 1")
        if self.tp > 1 and self.zero == 0 and self.dp * self.cp > 1:
            raise bad_value(f"{section}.zero", 0, f"tp = {self.tp} with dp*cp = {self.dp * self.cp} needs zero >= 1: "
                            "DDP cannot reduce DTensor (tensor-parallel) parameters, FSDP2 can; nearest: zero = 1")
        if self.sp and self.tp == 1:
            raise bad_value(f"{section}.sp", True, "sequence parallel needs tp > 1")
        if self.precision == "fp16" and self.loss_scale == "none":
            raise bad_value(f"{section}.loss_scale", "none", "fp16 needs loss_scale = 'dynamic' (gradients underflow)")
        if self.offload == "params" and self.zero != 3:
            raise bad_value(f"{section}.offload", "params", f"needs zero = 3 (zero = {self.zero})")
        if self.offload == "optimizer" and self.zero < 1:
            raise bad_value(f"{section}.offload", "optimizer", "needs zero >= 1 (the optimizer must be sharded)")
        if self.pp == 1:
            return
        v = self.virtual_stages
        if self.schedule in ("gpipe", "1f1b") and v != 1:
            raise bad_value(f"{section}.virtual_stages", v, f"schedule {self.schedule} uses 1 stage per rank")
        if self.schedule in ("interleaved-1f1b", "zero-bubble") and v < 2:
            raise bad_value(f"{section}.virtual_stages", v, f"schedule {self.schedule} needs >= 2 stages per rank")
        if self.zero == 0 and self.dp * self.cp > 1 and self.schedule in ("zero-bubble", "dualpipev"):
            raise bad_value(f"{section}.zero", 0, f"schedule {self.schedule} computes weight gradients after DDP's "
                            "all-reduce has fired; use FSDP2: nearest: zero = 1")
        if self.schedule == "dualpipev" and v != 2:
            raise bad_value(f"{section}.virtual_stages", v, "dualpipev needs exactly 2 stages per rank (a V shape)")


def check_layout(layout: ParallelLayout, model: ModelConfig, global_batch: int, world_size: int | None = None,
                 seq_len: int | None = None, section: str = "parallel") -> None:
    """Raise ``LubanError`` naming the first violated constraint and the nearest valid values."""
    layout.check_keys(section)
    seq = model.seq_len if seq_len is None else seq_len
    if world_size is not None and layout.world_size != world_size:
        raise LubanError(f"{section}: dp*tp*pp*cp = {layout.dp}*{layout.tp}*{layout.pp}*{layout.cp} = "
                         f"{layout.world_size} must equal the world size {world_size}")
    tp_ok = _common_divisors(model.heads, model.kv_heads, model.ffn_hidden)
    if layout.tp not in tp_ok:
        raise bad_value(f"{section}.tp", layout.tp, f"must divide heads={model.heads}, kv_heads={model.kv_heads} "
                        f"and ffn_hidden={model.ffn_hidden}; nearest: {_nearest(tp_ok, layout.tp)}")
    if layout.cp > 1 and model.dropout > 0:
        raise bad_value("model.dropout", model.dropout, f"ring attention (cp = {layout.cp}) has no attention "
                        "dropout; set dropout = 0 or cp = 1")
    shards = layout.cp * (2 if layout.cp > 1 else 1) * (layout.tp if layout.sp else 1)
    if seq % shards:
        ok = [c for c in _divisors(seq) if seq % (c * (2 if c > 1 else 1) * (layout.tp if layout.sp else 1)) == 0]
        raise bad_value(f"{section}.cp", layout.cp, f"seq_len = {seq} must split into {shards} equal chunks "
                        f"(2·cp load-balanced chunks{', times tp for sp' if layout.sp else ''}); nearest: {_nearest(ok, layout.cp)}")
    stages = layout.pp * layout.virtual_stages
    if stages > model.layers:
        raise bad_value(f"{section}.pp", layout.pp, f"pp * virtual_stages = {stages} exceeds layers = {model.layers}")
    if layout.pp_split:
        if len(layout.pp_split) != stages or sum(layout.pp_split) != model.layers or min(layout.pp_split) < 1:
            raise bad_value(f"{section}.pp_split", list(layout.pp_split),
                            f"needs {stages} positive layer counts summing to layers = {model.layers}")
    per_step = layout.dp * layout.micro_batch
    if global_batch % per_step:
        ok = [b for b in _divisors(global_batch // layout.dp if global_batch % layout.dp == 0 else 1)]
        raise bad_value("train.global_batch", global_batch, f"must be divisible by dp * micro_batch = {per_step}; "
                        f"nearest global_batch: {_nearest([k * per_step for k in range(1, 2 * global_batch // per_step + 2)], global_batch)}"
                        f"{'' if global_batch % layout.dp else f', or micro_batch in {ok}'}")
    n_micro = layout.num_microbatches(global_batch)
    if layout.pp > 1:
        need = min_microbatches(layout)
        if n_micro < need:
            raise bad_value("train.global_batch", global_batch,
                            f"gives {n_micro} micro-batches per rank; schedule {layout.schedule} with pp = {layout.pp} "
                            f"needs >= {need} (global_batch >= {need * per_step})")
        if layout.schedule in ("interleaved-1f1b", "zero-bubble") and n_micro % layout.pp:
            raise bad_value("train.global_batch", global_batch, f"gives {n_micro} micro-batches; schedule "
                            f"{layout.schedule} needs a multiple of pp = {layout.pp}")


def min_microbatches(layout: ParallelLayout) -> int:
    """Fewest micro-batches a pipeline schedule can run with (1 stage per rank: pp; DualPipeV: 2·pp)."""
    if layout.pp == 1 or layout.schedule == "gpipe":
        return 1
    return 2 * layout.pp if layout.schedule == "dualpipev" else layout.pp


def parse_recompute(value: str, key: str = "parallel.recompute") -> tuple[str, int]:
    """``none`` | ``selective`` | ``full`` | ``full:k`` (full recompute of every k-th layer)."""
    mode, _, every = value.partition(":")
    if mode in ("none", "selective", "full") and (not every or (mode == "full" and every.isdigit() and int(every) > 0)):
        return mode, int(every or 1)
    raise bad_value(key, value, "one of none, selective, full, full:K (every K-th layer)")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _common_divisors(*ns: int) -> list[int]:
    return [d for d in _divisors(min(ns)) if all(n % d == 0 for n in ns)]


def _nearest(candidates, x, k: int = 3) -> list[int]:
    return sorted(sorted(candidates, key=lambda c: (abs(c - x), c))[:k])
