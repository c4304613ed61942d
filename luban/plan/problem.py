"""``Problem``: what is being planned (model, system, GPUs, sequence, batch, runtime, optimizer).

The model's parameter counts and FLOPs per token come from ``luban.model.flops`` (the one
place those formulas live); this module only gathers them once per problem.

``runtime`` picks whose memory accounting to follow:
* ``"megatron"``: the framework of the reference papers. Mixed precision keeps half-precision
  weights and gradients plus fp32 master weights in the optimizer (ZeRO Sec. 3.1: 2+2+K bytes
  per parameter, K = 12 for Adam); activations follow Korthikanti et al. 2022, Table 2
  (dropout masks, no flash attention).
* ``"luban"``: luban's own runtime: fp32 weights, gradients and optimizer state at every
  precision (autocast casts per micro-batch), SDPA flash attention, and exactly the tensors
  PyTorch saves for luban's transformer (``luban.model.transformer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from luban.errors import bad_value
from luban.model import flops
from luban.model.config import ModelConfig
from luban.plan.system import System

RUNTIMES = ("megatron", "luban")
OPTIMIZERS = {"adamw": 2, "sgd": 0, "sgd-momentum": 1}  # fp32 state tensors per parameter


@dataclass
class Problem:
    model: ModelConfig
    system: System
    gpus: int
    seq: int
    global_batch: int
    runtime: str = "megatron"
    optimizer: str = "adamw"
    derived: dict = field(init=False, repr=False)

    def __post_init__(self):
        if self.runtime not in RUNTIMES:
            raise bad_value("--runtime", self.runtime, f"one of {', '.join(RUNTIMES)}")
        if self.optimizer not in OPTIMIZERS:
            raise bad_value("--optimizer", self.optimizer, f"one of {', '.join(OPTIMIZERS)}")
        for key in ("gpus", "seq", "global_batch"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad_value(f"--{key.replace('_', '-')}", value, "must be a positive integer")
        cfg = self.model
        layer = flops.layer_params(cfg)
        replicated = 2 * flops.norm_params(cfg) + (2 * cfg.hidden if cfg.bias else 0)
        model_fpt = flops.flops_per_token(cfg, self.seq)
        self.derived = dict(
            layer_params=layer,
            layer_replicated=replicated,  # norms and output biases: not split by tensor parallel
            layer_matmul_weights=flops.layer_matmul_flops(cfg) // 2,
            embedding=cfg.vocab * cfg.hidden,
            positions=cfg.seq_len * cfg.hidden if cfg.position == "learned" else 0,
            norm=flops.norm_params(cfg),
            layer_matmul_flops=flops.layer_matmul_flops(cfg),
            attention_flops=flops.attention_core_flops(cfg, self.seq),
            head_flops=flops.head_flops(cfg),
            model_flops_per_token=model_fpt,
            selective_extra=flops.flops_per_token(cfg, self.seq, recompute="selective") - model_fpt,
            full_extra=flops.flops_per_token(cfg, self.seq, recompute="full") - model_fpt,
        )

    def __getattr__(self, name):
        try:
            return self.__dict__["derived"][name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def optimizer_states(self) -> int:
        return OPTIMIZERS[self.optimizer]
