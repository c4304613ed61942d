"""``evaluate`` (arrays of layouts) and ``Estimate`` (one layout): memory, time, throughput, cost.

Definitions (docs/planner.md):
* MFU = model FLOPs per token × tokens/s ÷ (GPUs × peak FLOP/s of the precision). Model FLOPs
  come from ``luban.model.flops.flops_per_token(cfg, seq)``: 6 FLOPs per weight per token plus
  the full (non-causal) s×s attention products, as Megatron-LM and PaLM count them; no recompute.
* HFU: the same with the layout's recompute FLOPs added (full: one more forward of the
  recomputed layers; selective: the attention core again). ``tflops_per_gpu`` is HFU's
  numerator per GPU, the quantity of Narayanan et al. 2021 Table 1 (their Eq. 3).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from luban.config import toml_value
from luban.model.config import ModelConfig
from luban.parallel.layout import ParallelLayout, check_layout
from luban.plan.grid import FULL, SELECTIVE, Grid
from luban.plan.memory import at_rank, memory, recomputed_share
from luban.plan.problem import Problem
from luban.plan.system import System, load_system
from luban.plan.time import peak_flops, step_time

MEMORY_KEYS = ("weights", "gradients", "optimizer", "activations", "other", "total")
STAGE_KEYS = {"param_bytes": "weights_total", "grad_bytes": "gradients", "optimizer_bytes": "optimizer_total",
              "activation_bytes_per_microbatch": "activation_per_microbatch", "total": "total",
              "layer_activation": "layer_activation"}


def evaluate(problem: Problem, g: Grid) -> dict:
    """Every figure of the estimate for every layout in ``g`` (broadcast arrays)."""
    mem = memory(problem, g)
    times = step_time(problem, g, mem)
    d = problem.derived
    hardware_extra = np.where(g.recompute == FULL, recomputed_share(problem, g) * d["full_extra"],
                              np.where(g.recompute == SELECTIVE, problem.runtime_model.selective_flops(problem, g), 0.0))
    tokens_per_s = problem.global_batch * problem.seq / times["step"]
    peak = problem.gpus * peak_flops(problem, g)
    model_flops = d["model_flops_per_token"] * tokens_per_s
    hardware_flops = (d["model_flops_per_token"] + hardware_extra) * tokens_per_s
    return {"memory": mem, "time": times, "tokens_per_s": tokens_per_s, "mfu": model_flops / peak,
            "hfu": hardware_flops / peak, "tflops_per_gpu": hardware_flops / problem.gpus / 1e12}


@dataclass
class Estimate:
    """The plan for one layout. Bytes are per GPU on the fuller pipeline rank (``rank``)."""

    layout: ParallelLayout
    model: str
    system: str
    gpus: int
    seq: int
    global_batch: int
    runtime: str
    optimizer: str
    fits: bool
    memory_bytes: dict
    host_bytes: float
    param_bytes: float  # this rank's weights wherever they live (GPU, or host when offloaded)
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes_per_microbatch: float
    rank: int
    microbatches: int
    in_flight: float
    step_time_s: float
    time_breakdown_s: dict
    dp_hidden_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    tflops_per_gpu: float
    hbm_bytes: float
    stages: dict = field(default_factory=dict)  # "first"/"last" pipeline rank: bytes by kind
    train_tokens: float = 0.0
    price_per_gpu_hour: float = 0.0
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_results(cls, problem: Problem, g: Grid, results: dict, index=(), **cost) -> "Estimate":
        shape = g.shape

        def at(arr):
            return np.broadcast_to(arr, shape)[index].item()

        mem, times = results["memory"], results["time"]
        layout = g.layout(index)

        def rank(key):
            return at_rank(mem, key, shape, index)

        return cls(
            layout=layout, model=problem.model.name, system=problem.system.name, gpus=problem.gpus,
            seq=problem.seq, global_batch=problem.global_batch, runtime=problem.runtime, optimizer=problem.optimizer,
            fits=bool(at(mem["fits"])), memory_bytes={k: rank(k) for k in MEMORY_KEYS}, host_bytes=at(mem["host"]),
            param_bytes=rank("weights_total"), grad_bytes=rank("gradients"), optimizer_bytes=rank("optimizer_total"),
            activation_bytes_per_microbatch=rank("activation_per_microbatch"),
            rank=0 if bool(np.broadcast_to(mem["pick_first"], shape)[index]) else layout.pp - 1,
            microbatches=int(at(mem["microbatches"])), in_flight=rank("in_flight"),
            step_time_s=at(times["step"]), time_breakdown_s={k: at(v) for k, v in times["parts"].items()},
            dp_hidden_s=at(times["dp_hidden"]), tokens_per_s=at(results["tokens_per_s"]), mfu=at(results["mfu"]),
            hfu=at(results["hfu"]), tflops_per_gpu=at(results["tflops_per_gpu"]), hbm_bytes=problem.system.hbm_bytes,
            stages={pos: {kind: at(mem[pos][key]) for kind, key in STAGE_KEYS.items()} for pos in ("first", "last")},
            extra={"buffers": rank("buffers"), "fits_hbm": bool(at(mem["fits_hbm"])),
                   "fits_host": bool(at(mem["fits_host"])), "first_params": at(mem["first"]["params"]),
                   "last_params": at(mem["last"]["params"]), "attention_kernel": problem.attention_kernel},
            **cost)

    def stage_bytes(self, pp_rank: int) -> dict:
        """Predicted bytes of pipeline rank ``pp_rank``: the first rank's figures for rank 0, the
        last rank's for pp−1 (middle ranks hold the same layers without embedding or head, so
        the first rank's figures bound them)."""
        return self.stages["last" if pp_rank == self.layout.pp - 1 and pp_rank > 0 else "first"]

    @property
    def train_time_s(self) -> float:
        return self.train_tokens / self.tokens_per_s if self.train_tokens else 0.0

    @property
    def gpu_hours(self) -> float:
        return self.train_time_s * self.gpus / 3600

    @property
    def cost(self) -> float:
        return self.gpu_hours * self.price_per_gpu_hour

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["layout"] = self.layout.to_dict()
        d.update(train_time_s=self.train_time_s, gpu_hours=self.gpu_hours, cost=self.cost)
        return d

    def toml_block(self) -> str:
        """A ready-to-paste ``[parallel]`` section (keys left at their defaults are omitted,
        except the main knobs)."""
        main = ("dp", "zero", "tp", "sp", "pp", "schedule", "virtual_stages", "cp", "micro_batch", "recompute",
                "offload", "precision")
        defaults = ParallelLayout().to_dict()
        lines = ["[parallel]"]
        for key, value in self.layout.to_dict().items():
            if key in main or value != defaults[key]:
                lines.append(f"{key} = {toml_value(value)}")
        return "\n".join(lines)


def estimate(model: ModelConfig, system: "System | str", layout: ParallelLayout, *, global_batch: int,
             seq: int | None = None, gpus: int | None = None, runtime: str = "megatron", optimizer: str = "adamw",
             train_tokens: float = 0.0, price_per_gpu_hour: float = 0.0, check: bool = True) -> Estimate:
    """Estimate one layout; ``check_layout`` rejects an invalid one with a ``LubanError``."""
    seq = model.seq_len if seq is None else seq
    gpus = layout.world_size if gpus is None else gpus
    problem = Problem(model, load_system(system), gpus, seq, global_batch, runtime, optimizer)
    if check:
        check_layout(layout, model, global_batch, gpus, seq, rules=problem.runtime_model)
    g = Grid.from_layout(layout)
    return Estimate.from_results(problem, g, evaluate(problem, g), train_tokens=train_tokens,
                                 price_per_gpu_hour=price_per_gpu_hour)
