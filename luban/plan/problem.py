"""``Problem``: what is being planned (model, system, GPUs, sequence, batch, runtime, optimizer).

The model's parameter counts and FLOPs per token come from ``luban.model.flops`` (the one
place those formulas live); this module only gathers them once per problem.

``runtime`` names whose layout rules, memory accounting and communication overlap to follow:
one of the runtime models in ``luban.plan.runtimes`` (megatron, megatron-core, fsdp2, luban);
``problem.runtime_model`` is that model.

Mixtures of experts: per-layer quantities are averages over the model's dense and MoE layers
(``dense_layers`` dense ones first; a pipeline stage is charged the average layer). The routed
experts are kept apart (``layer_experts``, ``expert_flops``): expert parallel splits them, and
their GEMMs run at the size one expert sees. ``expert_imbalance`` (>= 1) is the busiest expert
rank's load over the mean: it scales expert compute and the all-to-all (1 = balanced routing,
as in Megatron-Bridge's forced-balance benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from luban.errors import bad_value
from luban.model import flops
from luban.model.config import ModelConfig
from luban.parallel import schedules
from luban.plan import ATTENTION_KERNELS, DISPATCHERS, runtimes
from luban.plan.runtimes import RUNTIMES
from luban.plan.system import System

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
    expert_imbalance: float = 1.0
    attention_kernel: str = "fa3"  # fused attention generation: fa2 (FlashAttention-2 class) or fa3 (Hopper's FA3 class)
    compiled: bool | str | None = None  # torch.compile: True (model, head, loss), "blocks" (blocks only), False; None: the runtime's default
    dispatcher: str = "alltoall"  # MoE token dispatch: alltoall (a copy per routed expert), deepep or hybridep (one per node)
    ep_overlap: bool = False  # the MoE all-to-alls overlapped with another micro-batch's compute (1F1B A2A overlap)
    pads_vocab: bool | None = None  # the head's GEMMs on a padded (aligned) vocabulary; None: the runtime's default
    # tensor-parallel collectives pipelined with the adjacent GEMMs (Megatron-Core --tp-comm-overlap, torchtitan's
    # async TP); None: the runtime's default (Runtime.tp_overlap)
    tp_overlap: bool | None = None
    # megatron-core's main-gradient buffer and its reduction in fp32 (Megatron-Bridge's
    # ``grad_reduce_in_fp32``; Megatron-LM's default under --bf16); False: in the 16-bit compute dtype,
    # as the Megatron-Bridge performance recipes set it; None: the runtime's default
    grad_reduce_fp32: bool | None = None
    derived: dict = field(init=False, repr=False)

    def __post_init__(self):
        self.runtime_model = runtimes.get(self.runtime)
        if self.optimizer not in OPTIMIZERS:
            raise bad_value("--optimizer", self.optimizer, f"one of {', '.join(OPTIMIZERS)}")
        for key in ("gpus", "seq", "global_batch"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad_value(f"--{key.replace('_', '-')}", value, "must be a positive integer")
        if self.compiled not in (None, True, False, "blocks"):
            raise bad_value("--compile", self.compiled, "on, off, blocks or auto (the runtime's default)")
        if self.pads_vocab is not None and not isinstance(self.pads_vocab, bool):
            raise bad_value("--pad-vocab", self.pads_vocab, "on, off or auto (the runtime's default)")
        if self.tp_overlap is not None and not isinstance(self.tp_overlap, bool):
            raise bad_value("--tp-overlap", self.tp_overlap, "on, off or auto (the runtime's default)")
        if self.grad_reduce_fp32 is not None and (not isinstance(self.grad_reduce_fp32, bool)
                                                  or not self.runtime_model.grad_reduce_switch):
            allowed = "on, off or auto" if self.runtime_model.grad_reduce_switch else "auto (only megatron-core has the switch)"
            shown = {True: "on", False: "off"}.get(self.grad_reduce_fp32, self.grad_reduce_fp32)  # as typed
            raise bad_value("--grad-reduce-in-fp32", shown, allowed)
        if not isinstance(self.ep_overlap, bool):
            raise bad_value("--ep-overlap", self.ep_overlap, "true or false")
        if self.dispatcher not in DISPATCHERS:
            raise bad_value("--dispatcher", self.dispatcher, f"one of {', '.join(DISPATCHERS)}")
        if not self.model.moe and (self.dispatcher != "alltoall" or self.ep_overlap or self.expert_imbalance != 1.0):
            key, value = (("--dispatcher", self.dispatcher) if self.dispatcher != "alltoall" else
                          ("--ep-overlap", True) if self.ep_overlap else ("--expert-imbalance", self.expert_imbalance))
            raise bad_value(key, value, "only for a mixture-of-experts model (this one has no experts: "
                                        "set model.experts, or leave the option out)")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise bad_value("--attention-kernel", self.attention_kernel, f"one of {', '.join(ATTENTION_KERNELS)}")
        if not isinstance(self.expert_imbalance, (int, float)) or not 1.0 <= self.expert_imbalance < float("inf"):
            raise bad_value("--expert-imbalance", self.expert_imbalance, "a finite number >= 1 (1 = balanced)")
        cfg = self.model
        moe_share = cfg.moe_layers / cfg.layers  # share of layers with routed experts
        routed = cfg.experts * flops.expert_params(cfg) if cfg.moe else 0  # routed experts of one MoE layer
        layer_avg = flops.over_layers(cfg, lambda moe: flops.layer_params(cfg, moe) - (routed if moe else 0)) / cfg.layers
        expert_fwd = 2 * cfg.experts_per_token * flops.expert_params(cfg) if cfg.moe else 0  # per token, one MoE layer
        matmul_avg = flops.over_layers(cfg, lambda moe: flops.layer_matmul_flops(cfg, moe) - (expert_fwd if moe else 0)) / cfg.layers
        replicated = 2 * flops.norm_params(cfg) + (2 * cfg.hidden if cfg.bias else 0)
        model_fpt = flops.flops_per_token(cfg, self.seq)
        self.derived = dict(
            layer_params=layer_avg,  # everything of a layer but its routed experts (average layer)
            layer_replicated=replicated,  # norms and output biases: not split by tensor parallel
            layer_experts=moe_share * routed,  # routed experts per layer (average): split by ep
            moe_share=moe_share,
            expert_flops=moe_share * expert_fwd,  # forward FLOPs per token of the routed experts (average layer)
            expert_share=cfg.experts_per_token / cfg.experts if cfg.moe else 0.0,  # of the tokens, per expert
            layer_matmul_weights=matmul_avg / 2,  # routed experts: ``layer_experts``
            embedding=cfg.vocab * cfg.hidden,
            positions=cfg.seq_len * cfg.hidden if cfg.position == "learned" else 0,
            norm=flops.norm_params(cfg),
            layer_matmul_flops=matmul_avg,  # without the routed experts (``expert_flops``)
            attention_flops=flops.attention_core_flops(cfg, self.seq),
            causal_attention_flops=flops.attention_core_flops(cfg, self.seq, causal=True),
            head_flops=flops.head_flops(cfg),
            head_layers=schedules.head_layers(cfg),  # the pipeline split's cost of the LM head
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
