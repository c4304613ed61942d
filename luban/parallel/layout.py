"""``ParallelLayout``: the ``[parallel]`` config section and its compatibility rules.

The key names are shared with the planner's flags (``luban plan estimate --tp 2`` ↔
``[parallel] tp = 2``), so a plan can be pasted into a training config. ``check_layout`` is
the one statement of which combinations are valid; the planner's vectorised search is
tested against it. The compatibility matrix in docs/parallelism.md is written from it.

World size = dp · tp · pp · cp (expert parallel ``ep`` divides dp · cp: it borrows those ranks). Ranks are laid out by ``mesh_order`` (outermost first);
the default ``pp,dp,cp,tp`` puts tensor parallel innermost so that its frequent
collectives stay inside a node (Narayanan et al. 2021, Sec. 3.3).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from luban.errors import bad_value, unknown_key
from luban.model.config import ModelConfig
from luban.parallel import schedules
from luban.parallel.schedules import NAMES as SCHEDULES

RECOMPUTES = ("none", "selective", "full")
# optimizer: ZeRO-Offload's states and update on the host; params: FSDP2 CPU offload (zero 3);
# activations: saved-for-backward tensors to host memory (seed 002; parallel/activation_offload.py);
# blocks: seed 003's tensor offload of inactive blocks' weights, gradients, optimizer state and
# activations to a second memory tier: the planner only (RuntimeRules.offloads)
OFFLOADS = ("none", "optimizer", "params", "activations", "blocks")
HOST_STATE_OFFLOADS = ("optimizer", "params")  # model states kept on the host by luban's runtime
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")  # fp8: the planner only (RuntimeRules.precisions)
# the precision FSDP2 all-gathers the weights in (``MixedPrecisionPolicy.param_dtype``; None: the stored
# fp32 weights, with autocast around the forward as in one process). Why bf16 and not fp16:
# ``luban.parallel.precision.FSDP_PARAM_DTYPE``, its torch dtypes. Here by name, without torch: the
# planner (``luban.plan.runtimes.luban_fsdp_casts``) reads it too.
FSDP_PARAM_PRECISION = {"fp32": None, "bf16": "bf16", "fp16": None}


def fsdp_casts(precision: str) -> bool:
    """Whether FSDP2 casts the weights to the compute dtype (``FSDP_PARAM_PRECISION``) instead of autocast."""
    return FSDP_PARAM_PRECISION.get(precision) is not None
LOSS_SCALES = ("dynamic", "none")
MESH_DIMS = ("pp", "dp", "cp", "tp")
# any integer key (a degree, micro_batch, bucket_mb in MiB): beyond every cluster, and small enough that
# the nearest-value hints stay quick and DDP's bucket size in bytes stays a C int64 (2**63 MiB overflowed it)
MAX_DEGREE = 1 << 24
MAX_GLOBAL_BATCH = 1 << 20  # train.global_batch (luban.config.RANGES): sequences a step, beyond any published run


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
    ep: int = 1  # expert parallel: borrows ranks from dp*cp (luban.parallel.expert_parallel)
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
        return schedules.microbatches(global_batch, self.dp, self.micro_batch)

    def replace(self, **changes) -> "ParallelLayout":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("extra")
        d["pp_split"] = list(self.pp_split)
        return d

    @classmethod
    def from_dict(cls, raw: dict, section: str = "parallel", rules: "RuntimeRules | None" = None) -> "ParallelLayout":
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        values = {}
        for key, value in raw.items():
            if key not in fields:
                raise unknown_key(section, key, value, fields)
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
                if value > MAX_DEGREE:
                    raise bad_value(f"{section}.{key}", value, f"at most {MAX_DEGREE:,}")
            elif isinstance(default, str) and not isinstance(value, str):
                raise bad_value(f"{section}.{key}", value, "must be a string")
            values[key] = value
        layout = cls(**values)
        layout.check_keys(section, rules)
        return layout

    def check_keys(self, section: str = "parallel", rules: "RuntimeRules | None" = None) -> None:
        """Checks that need no model: value ranges and key-to-key rules; ``rules``: those that
        depend on the runtime (luban's own unless the planner models another one)."""
        rules = rules or LUBAN_RULES
        def choose(key, allowed):
            if getattr(self, key) not in allowed:
                raise bad_value(f"{section}.{key}", getattr(self, key), f"one of {', '.join(map(str, allowed))}")

        choose("zero", (0, 1, 2, 3))
        choose("schedule", SCHEDULES)
        choose("offload", OFFLOADS)
        choose("precision", PRECISIONS)
        choose("loss_scale", LOSS_SCALES)
        if self.precision not in rules.precisions:
            raise bad_value(f"{section}.precision", self.precision, f"this runtime runs {', '.join(rules.precisions)} "
                            "(fp8 is planned with --runtime megatron-core or fsdp2, not yet run by luban)")
        if self.offload not in rules.offloads:
            raise bad_value(f"{section}.offload", self.offload, f"this runtime offloads {', '.join(rules.offloads)} "
                            "(blocks is seed 003's second memory tier: planned, not run by luban)")
        if self.zero not in rules.zeros:
            raise bad_value(f"{section}.zero", self.zero, f"this runtime runs zero = {', '.join(map(str, rules.zeros))}")
        if self.cp > 1 and not rules.context_parallel:
            raise bad_value(f"{section}.cp", self.cp, "this runtime has no context parallel: cp = 1")
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
        if self.dp_replicate > 1 and self.cp > 1 and order.index("cp") < order.index("dp"):
            raise bad_value(f"{section}.mesh_order", self.mesh_order, f"hybrid sharding (dp_replicate = "
                            f"{self.dp_replicate}) with cp = {self.cp} needs dp before cp: FSDP2's mesh "
                            "(replicas, dp_shard x cp) must list its dimensions outermost first; e.g. pp,dp,cp,tp")
        if self.tp > 1 and self.zero == 0 and self.dp * self.cp > 1 and not rules.ddp_with_tp:
            raise bad_value(f"{section}.zero", 0, f"tp = {self.tp} with dp*cp = {self.dp * self.cp} needs zero >= 1: "
                            "DDP cannot reduce DTensor (tensor-parallel) parameters, FSDP2 can; nearest: zero = 1")
        if (self.dp * self.cp) % self.ep:
            raise bad_value(f"{section}.ep", self.ep, f"must divide dp*cp = {self.dp * self.cp} (expert parallel "
                            f"borrows data-parallel ranks); nearest: {_nearest(_divisors(self.dp * self.cp), self.ep)}")
        if self.ep > 1 and self.offload in HOST_STATE_OFFLOADS:
            raise bad_value(f"{section}.offload", self.offload, f"not with ep = {self.ep} (expert shards are not "
                            "offloaded); set offload = 'none' or 'activations', or ep = 1")
        if self.sp and self.tp == 1:
            raise bad_value(f"{section}.sp", True, "sequence parallel needs tp > 1")
        if self.precision == "fp16" and self.loss_scale == "none":
            raise bad_value(f"{section}.loss_scale", "none", "fp16 needs loss_scale = 'dynamic' (gradients underflow)")
        if self.offload == "params" and self.zero != 3:
            raise bad_value(f"{section}.offload", "params", f"needs zero = 3 (zero = {self.zero})")
        if self.offload == "optimizer" and self.zero < 1:
            raise bad_value(f"{section}.offload", "optimizer", "needs zero >= 1 (the optimizer must be sharded)")
        if self.pp == 1:
            if self.virtual_stages != 1:  # one stage has no virtual stages (the schedule is moot at pp 1)
                raise bad_value(f"{section}.virtual_stages", self.virtual_stages, "1 at pp = 1 (virtual stages need pp > 1)")
            return
        v, sched = self.virtual_stages, schedules.get(self.schedule)
        if v < sched.min_virtual or (sched.max_virtual is not None and v > sched.max_virtual):
            raise bad_value(f"{section}.virtual_stages", v, f"schedule {self.schedule} takes {sched.virtual_rule()}")
        if self.zero == 0 and self.dp * self.cp > 1 and sched.split_backward and not rules.ddp_with_split_backward:
            raise bad_value(f"{section}.zero", 0, f"schedule {self.schedule} computes weight gradients after DDP's "
                            "all-reduce has fired; use FSDP2: nearest: zero = 1")


@dataclass(frozen=True)
class RuntimeRules:
    """The layout rules that depend on the training runtime. luban's (``LUBAN_RULES``): DDP
    cannot reduce DTensor (tensor-parallel) parameters, and its all-reduce fires before a
    split-backward schedule computes the weight gradients. The planner's runtime models
    (``luban.plan.runtimes``) carry the same two attributes; e.g. Megatron's DDP reduces its
    tensor-parallel shards as plain tensors."""

    ddp_with_tp: bool = False
    ddp_with_split_backward: bool = False
    precisions: tuple = ("fp32", "bf16", "fp16")  # luban's runtime has no fp8 GEMMs yet
    offloads: tuple = tuple(o for o in OFFLOADS if o != "blocks")  # no second memory tier for whole blocks (seed 003) yet
    zeros: tuple = (0, 1, 2, 3)  # the ZeRO stages it runs
    context_parallel: bool = True  # it runs cp > 1


LUBAN_RULES = RuntimeRules()


def check_layout(layout: ParallelLayout, model: ModelConfig, global_batch: int, world_size: int | None = None,
                 seq_len: int | None = None, section: str = "parallel", rules: "RuntimeRules | None" = None) -> None:
    """Raise ``LubanError`` naming the first violated constraint and the nearest valid values;
    ``rules``: the runtime's layout rules (``RuntimeRules``; default luban's)."""
    layout.check_keys(section, rules)
    seq = model.seq_len if seq_len is None else seq_len
    if world_size is not None and layout.world_size != world_size:
        raise bad_value(f"{section}.dp", layout.dp, f"dp*tp*pp*cp = {layout.dp}*{layout.tp}*{layout.pp}*{layout.cp} = "
                        f"{layout.world_size} must equal the world size {world_size}")
    split_experts = model.moe and getattr(rules, "expert_tp", False)  # a planner runtime whose tp splits experts
    tp_ok = _common_divisors(model.heads, model.kv_heads, model.ffn_hidden,
                             *((model.expert_ffn_hidden,) if split_experts else ()))
    if layout.tp not in tp_ok:
        raise bad_value(f"{section}.tp", layout.tp, f"must divide heads={model.heads}, kv_heads={model.kv_heads}"
                        + (f", ffn_hidden={model.ffn_hidden} and expert_ffn_hidden={model.expert_ffn_hidden} (this "
                           "runtime splits the experts by tp)" if split_experts else f" and ffn_hidden={model.ffn_hidden}")
                        + f"; nearest: {_nearest(tp_ok, layout.tp)}")
    if layout.ep > 1 and (not model.moe or model.experts % layout.ep):
        ok = _divisors(model.experts) if model.moe else [1]
        raise bad_value(f"{section}.ep", layout.ep, f"must divide experts = {model.experts} "
                        f"({'a dense model has none' if not model.moe else 'each rank holds experts/ep'}); "
                        f"nearest: {_nearest([d for d in ok if (layout.dp * layout.cp) % d == 0], layout.ep)}")
    if layout.cp > 1 and model.dropout > 0:
        raise bad_value("model.dropout", model.dropout, f"ring attention (cp = {layout.cp}) has no attention "
                        "dropout; set dropout = 0 or cp = 1")
    if layout.cp > 1 and model.moe and model.capacity_factor > 0:
        raise bad_value("model.capacity_factor", model.capacity_factor, f"not with cp = {layout.cp}: an expert's "
                        "capacity counts a micro-batch's tokens, which context parallel splits over ranks (each "
                        "would drop other tokens than one process); set capacity_factor = 0 (dropless) or cp = 1")
    shards = int(schedules.sequence_shards(layout.cp, layout.tp, layout.sp))
    if seq % shards:
        ok = [c for c in _divisors(seq) if seq % int(schedules.sequence_shards(c, layout.tp, layout.sp)) == 0]
        if layout.cp == 1 or not ok:  # sequence parallel alone: no cp helps
            tps = [t for t in tp_ok if t > 1 and seq % int(schedules.sequence_shards(layout.cp, t, True)) == 0]
            raise bad_value(f"{section}.sp", True, f"seq_len = {seq} must split into {shards} equal sequence shards "
                            f"(tp{' x 2·cp' if layout.cp > 1 else ''}); set sp = false"
                            + (f", or tp in {_nearest(tps, layout.tp)}" if tps else ""))
        raise bad_value(f"{section}.cp", layout.cp, f"seq_len = {seq} must split into {shards} equal chunks "
                        f"(2·cp load-balanced chunks{', times tp for sp' if layout.sp else ''}); nearest: {_nearest(ok, layout.cp)}")
    if empty_shards(model.vocab, layout.tp):
        ok = [t for t in tp_ok if not empty_shards(model.vocab, t)]
        raise bad_value(f"{section}.tp", layout.tp, f"vocab = {model.vocab} leaves a tensor-parallel rank no vocabulary "
                        f"rows (shards of {-(-model.vocab // layout.tp)}); nearest: {_nearest(ok, layout.tp)}")
    sched = schedules.get(layout.schedule)
    stages = sched.stages(layout.pp, layout.virtual_stages)
    if stages > model.layers:
        raise bad_value(f"{section}.pp", layout.pp, f"pp * virtual_stages = {stages} exceeds layers = {model.layers}")
    if layout.pp_split:
        if len(layout.pp_split) != stages or sum(layout.pp_split) != model.layers or min(layout.pp_split) < 1:
            raise bad_value(f"{section}.pp_split", list(layout.pp_split),
                            f"needs {stages} positive layer counts summing to layers = {model.layers}")
    per_step = layout.dp * layout.micro_batch
    if global_batch % per_step:
        batches = [k * per_step for k in range(1, min(2 * global_batch, MAX_GLOBAL_BATCH) // per_step + 1)]
        hints = [f"nearest global_batch: {_nearest(batches, global_batch)}"] if batches else []
        if global_batch % layout.dp == 0:  # a micro_batch that divides the per-rank batch
            hints.append(f"micro_batch in {_nearest(_divisors(global_batch // layout.dp), layout.micro_batch)}")
        raise bad_value("train.global_batch", global_batch, f"must be divisible by dp * micro_batch = {per_step}"
                        + (f"; {', or '.join(hints)}" if hints else f", at most {MAX_GLOBAL_BATCH:,}: a smaller dp * micro_batch"))
    n_micro = layout.num_microbatches(global_batch)
    if layout.pp > 1:
        need = min_microbatches(layout)
        if n_micro < need:
            raise bad_value("train.global_batch", global_batch,
                            f"gives {n_micro} micro-batches per rank; schedule {layout.schedule} with pp = {layout.pp} "
                            f"needs >= {need} (global_batch >= {need * per_step})")
        if sched.rounds_of_pp and n_micro % layout.pp:
            raise bad_value("train.global_batch", global_batch, f"gives {n_micro} micro-batches; schedule "
                            f"{layout.schedule} needs a multiple of pp = {layout.pp}")


def min_microbatches(layout: ParallelLayout) -> int:
    """Fewest micro-batches the layout's pipeline schedule runs with (``luban.parallel.schedules``)."""
    return int(schedules.min_microbatches(SCHEDULES.index(layout.schedule), layout.pp))


MAX_RECOMPUTE_EVERY = 1 << 24  # full:K beyond any model's layer count (keeps K a machine integer)


def parse_recompute(value: str, key: str = "parallel.recompute") -> tuple[str, int]:
    """``none`` | ``selective`` | ``full`` | ``full:k`` (full recompute of every k-th layer)."""
    mode, colon, every = value.partition(":")
    if mode in RECOMPUTES and (not colon or (mode == "full" and every.isascii() and every.isdigit()
                                             and 0 < int(every) <= MAX_RECOMPUTE_EVERY)):
        return mode, int(every or 1)
    raise bad_value(key, value, f"one of none, selective, full, full:K (every K-th layer, 1 <= K <= {MAX_RECOMPUTE_EVERY:,})")


def format_recompute(mode: str, every: int) -> str:
    """The inverse of ``parse_recompute``."""
    return f"full:{every}" if mode == "full" and every > 1 else mode


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _divisors(n: int) -> list[int]:
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*low, *(n // d for d in low)})


def empty_shards(rows: int, parts):
    """``Shard(0)`` cuts ``rows`` into ``parts`` chunks of ceil(rows/parts) (``torch.chunk``): some are empty
    when the first parts - 1 of them already hold every row (torch's vocab-parallel loss then fails)."""
    return (parts > 1) & (-(-rows // parts) * (parts - 1) >= rows)  # arrays too (``luban.plan.rules``)


def _common_divisors(*ns: int) -> list[int]:
    return [d for d in _divisors(min(ns)) if all(n % d == 0 for n in ns)]


def _nearest(candidates, x, k: int = 3) -> list[int]:
    return sorted(sorted(candidates, key=lambda c: (abs(c - x), c))[:k])
