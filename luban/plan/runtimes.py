"""Runtime models: whose layout rules, byte accounting and overlap the planner follows.

A ``Runtime`` answers, for one training framework, the questions on which frameworks differ
while the hardware stays the same:

* **layout rules** (``ddp_with_tp``, ``ddp_with_split_backward``): which layouts it can run
  (``luban.parallel.layout.check_layout`` and the vectorised ``luban.plan.rules`` take them);
* **byte accounting**: bytes per parameter of weights, gradients and optimizer state
  (``param_bytes``), whether ZeRO stages >= 1 are FSDP (weights and gradients sharded between
  steps, ``fsdp``), whether context-parallel ranks join the sharding group (``cp_shards``), the
  activations one layer saves (``layer_activations``) and those outside the layers
  (``edge_activations``), and how many data-parallel collectives a step issues
  (``dp_collective_counts``);
* **overlap per mechanism**: how much of the tensor-parallel (``tp_exposed``), pipeline p2p
  (``pp_exposed``) and data-parallel (``dp_hidden``) communication hides behind which compute,
  each bounded by that compute. Overlap is a property of the runtime and its settings, not of
  the system profile (which keeps only ``zero3_overlap``, the share of compute a prefetching
  runtime achieves on that hardware).

Eight models (``RUNTIMES``): the four below, and ``megatron-deepspeed``, ``composer-fsdp``,
``pytorch`` and ``transformers`` (their classes), which describe validation sources' frameworks:

``megatron``
    Megatron-LM as in the 2021-22 papers (Narayanan et al. 2021, Korthikanti et al. 2022):
    DDP (or ZeRO) + TP + PP, no communication overlap, fp16/bf16 weights and gradients with
    fp32 master weights in the optimizer (ZeRO Sec. 3.1: 2 + 2 + K bytes), activations of
    Korthikanti Table 2 (attention scores stored, dropout masks).
``megatron-core``
    Megatron-Core with the distributed optimizer (ZeRO-1: ``--use-distributed-optimizer``),
    ``--overlap-grad-reduce`` / ``--overlap-param-gather`` (gradient reduce-scatter behind the
    last micro-batch's backward, parameter all-gather behind the first micro-batch's forward),
    TransformerEngine ``--tp-comm-overlap`` (TP all-gather/reduce-scatter behind the adjacent
    GEMMs; needs sequence parallel) and interleaved PP with ``--overlap-p2p-communication``
    (each send/receive behind one model chunk's compute). bf16 keeps fp32 main gradients
    (Megatron sets ``accumulate_allreduce_grads_in_fp32`` for bf16). Flash attention: no
    s x s scores are saved.
``fsdp2``
    torchtitan: FSDP2 (``fully_shard``, ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)``) + TP + PP. fp32 sharded weights, gradients and optimizer state; bf16
    activations with SDPA flash attention; context-parallel ranks shard too (``dp_shard_cp``);
    FSDP2 prefetch hides all-gathers and reduce-scatters behind compute (up to the profile's
    ``zero3_overlap``); TP and p2p are not overlapped (async TP is off by default). DDP is
    used only without TP (torchtitan's ``apply_ddp`` is 1-D only).
``luban``
    luban's own runtime as measured (``tests/plan/test_runtime_match.py``,
    ``test_runtime_multirank.py``): fp32 weights and gradients at every precision (autocast; under
    FSDP2 in bf16 FSDP2's cast to bf16, ``luban_fsdp_casts``, and bf16 all-gathers, ``gather_bytes``),
    exactly the tensors PyTorch saves for ``luban.model.transformer.Block``, FSDP2 groups per
    block, three scalar all-reduces per step, CPU framework overheads; only ZeRO-3 gathers hide
    behind compute (no measured overlap elsewhere).

Kernel efficiency is a property of the runtime too (docs/planner.md "Kernel efficiency per
runtime"): eager or fused elementwise kernels (``eager_kernels``, ``compiled``,
``traffic_scale``), 16-bit FSDP gathers (``gather_half``, ``gather_bytes``), what "selective" recomputes
(``selective_redo``), whether attention skips the causal half (``skips_causal``), and a compute
speed relative to Megatron-LM's, fitted to published measurements where no mechanism explains the
difference (``compute_speed``: Megatron-DeepSpeed's).

Equations and sources are written out in docs/planner.md.
"""

from __future__ import annotations

import functools

import numpy as np

from luban.errors import bad_value
from luban.parallel.layout import LUBAN_RULES, OFFLOADS, PRECISIONS
from luban.plan.grid import BF16, FP8, FP32, FULL, PARAMS_OFFLOAD

GEMMS_PER_LAYER = 4  # QKV, attention output, fc1 (gate and up fused), fc2: Megatron's linear layers


class Runtime:
    """The protocol; each subclass fills in what differs. Attributes are layout rules and flags,
    methods take a ``Problem`` and a ``Grid`` and return numpy arrays broadcast over the grid."""

    name = ""
    ddp_with_tp = False  # DDP (zero 0) may reduce tensor-parallel parameters over dp*cp > 1
    ddp_with_split_backward = False  # DDP with zero-bubble/dualpipev (weight grads after the reduce)
    fsdp = False  # ZeRO stages >= 1 keep weights and gradients sharded between steps (FSDP2)
    cp_shards = False  # context-parallel ranks join the ZeRO sharding group
    scalar_allreduces = 0  # per-step all-reduces of a scalar (loss, norm, flags)
    cpu_overheads = False  # a probed CPU profile's framework overheads apply
    flash_attention = True  # no s x s attention scores saved
    causal_skip = False  # the attention kernel skips masked blocks: causal FLOPs, at ``attention_matmul``
    head_grad_view = False  # an untied TP head's gradient shard views a full V x h buffer
    offload_host_shards = False  # optimizer offload also keeps host copies of weight/grad shards
    expert_tp = False  # MoE routed experts are split by tensor parallel too (expert-TP = tp)
    # MoE parallel folding (Liu et al. 2025, arXiv 2504.14960; Megatron-Core >= 0.10): the expert
    # layers get their own groups (expert-TP 1, EP over consecutive ranks, folded over the
    # attention's tp x dp), and each rank dispatches its own sequence-parallel shard of the tokens
    ep_folding = False
    precisions = LUBAN_RULES.precisions  # what it runs (fp8: see the FP8 attributes below)
    # what the framework runs (a search recommended layouts a runtime's framework has not: a review of
    # 2026-12-04); "blocks" (seed 003's second memory tier) is a what-if no framework runs: megatron's and
    # megatron-core's alone (the planner's general model, and ``luban plan study``'s)
    offloads = tuple(o for o in OFFLOADS if o != "blocks")
    zeros = (0, 1, 2, 3)
    context_parallel = True
    # FP8 recipe (docs/planner.md "FP8"): GEMM inputs saved for backward in fp8 (1 byte) or in bf16;
    # fp8 weight copies kept beside the master weights (bytes per linear-layer parameter); amax
    # history entries per fp8 tensor (3 per GEMM: input, weight, output gradient); passes over
    # each GEMM input to quantise it (amax + cast)
    fp8_saved_gemm_inputs = False
    fp8_weight_copy_bytes = 0.0
    fp8_amax_history = 0
    fp8_cast_passes = 0
    experts_replicated_with_ep = False  # with ep > 1 expert states stay out of ZeRO (replicated over edp)
    # host seconds to issue one MoE layer's forward after its token-count synchronisation (``time.moe_host_stall``)
    moe_layer_host_s = 0.0
    # a pipeline step's fixed activation bytes (autocast weight copies, the rope table) are made
    # once per step and shared by its micro-batches, not once per micro-batch in flight
    pipeline_fixed_once = False
    # --- kernel efficiency: what differs between runtimes on the same GPU (docs/planner.md "Runtimes") ---
    # eager_kernels: the layers' elementwise work (norms, activations, rotary, residuals, the loss)
    # runs as separate eager PyTorch kernels, each a round trip through HBM, unless the runtime
    # compiles them (``compiled``: torch.compile/Inductor fuses them, as Megatron's and TE's fused
    # kernels do); such a runtime's elementwise HBM traffic is ``EAGER_TRAFFIC`` times a fused one's
    eager_kernels = False
    compiled_default = False  # torch.compile on when the problem does not say (``Problem.compiled``)
    gather_half = False  # ZeRO-3/FSDP all-gathers weights in the 16-bit compute dtype (param_dtype), not wb
    fp8_gather = False  # fp8 runs all-gather the linear layers' weights in fp8 (gather_bytes)
    # the LM head's GEMMs run on a vocabulary padded to an aligned width (Megatron-LM's
    # --make-vocab-size-divisible-by 128, luban.model.head_loss.VOCAB_MULTIPLE); otherwise an odd
    # vocabulary (GPT-2's 50,257) meets the profile's ``unaligned_gemm`` (time.unaligned_head_seconds)
    pads_vocab_default = False
    # layers per pipeline stage (``memory.rank_layers``, one of ``memory.PIPELINE_SPLITS``): "luban", luban's split
    # (``luban.parallel.schedules``: the LM head's cost counted on the last stage); "megatron", Megatron's
    # (``memory.even_rank_layers``); "torchtitan", torchtitan's (``memory.torchtitan_rank_layers``)
    pipeline_split = "luban"
    # tensor-parallel all-gathers/reduce-scatters split into chunks pipelined with the adjacent GEMMs
    # (``tp_exposed``): Megatron-Core's ``--tp-comm-overlap`` (TransformerEngine userbuffers), torchtitan's
    # async TP (``parallelism.enable_async_tensor_parallel``, off by default); both need sequence parallel
    tp_overlap_default = False
    tp_overlap_backward = True  # the overlap also covers the backward's collectives (TE userbuffers do)
    grad_reduce_switch = False  # ``Problem.grad_reduce_fp32`` applies (megatron-core's main-gradient dtype)
    # eager activations implemented as several kernels: model activation -> element passes (reads +
    # writes of [tokens, ffn] tensors, forward + backward) beyond ATen's one fused kernel and its
    # backward (``activation_extra_bytes``); ATen's F.gelu / F.silu are the baseline EAGER_TRAFFIC covers
    activation_passes: dict = {}
    # the runtime's compute speed (GEMMs, attention, elementwise kernels, the head) as a share of the
    # speed the profiles' efficiency curves were fitted on (Megatron-LM's, Korthikanti et al. 2022 Table 5
    # and Narayanan et al. 2021 Table 1): a per-runtime efficiency fitted to published measurements where no
    # mechanism of the model explains them (``MegatronDeepSpeed``); every compute term of ``time.step_time`` is
    # divided by it
    compute_speed = 1.0

    def tp_overlap(self, problem) -> bool:
        """``Problem.tp_overlap`` (``--tp-overlap``), or the runtime's default (``tp_overlap_default``)."""
        return self.tp_overlap_default if problem.tp_overlap is None else problem.tp_overlap

    def pads_vocab(self, problem, g):
        """Per layout: ``Problem.pads_vocab``, or the runtime's default (``pads_vocab_default``)."""
        value = self.pads_vocab_default if problem.pads_vocab is None else problem.pads_vocab
        return np.full(np.shape(g.tp), value, dtype=bool)

    def skips_causal(self, problem) -> bool:
        """Whether attention runs as a fused kernel that skips the masked half (``causal_skip``)."""
        return self.causal_skip

    def masks_attention(self, problem) -> bool:
        """Whether the fused attention kernel is handed an explicit causal mask tensor instead of
        ``is_causal``: then it computes every block of the s x s scores, none skipped
        (``Transformers`` under torch.compile)."""
        return False

    def activation_extra_bytes(self, problem, g, e):
        """HBM bytes per token per layer (forward; backward is charged 2x with the rest) that the
        runtime's own implementation of the model's activation moves beyond ATen's single fused
        kernel, when the layers run eager (``activation_passes``: element passes over the MLP's
        inner width, forward and backward, counted from the code); 0 when they are compiled."""
        passes = self.activation_passes.get(problem.model.activation, 0)
        if not passes or not self.runs_eager(problem):
            return 0.0
        return passes / 3 * problem.model.ffn_hidden / g.tp * e  # the dense MLP (no model class here has a GELU MoE)

    def compiled(self, problem):
        """``Problem.compiled``, or the runtime's default: False, True (the whole model with its
        head and loss) or ``"blocks"`` (each transformer block compiled, the head and loss eager:
        torchtitan's ``apply_compile``, and luban's Engine at 3457f4b)."""
        return self.compiled_default if problem.compiled is None else problem.compiled

    def traffic_scale(self, problem, head: bool = False) -> float:
        """Elementwise HBM traffic of the layers (``head``: of the head and loss) relative to a fused
        runtime (the profile's ``elementwise_traffic`` is a fused runtime's: Megatron's, on which
        it was calibrated). CPU profiles: 1 (their ``elementwise_traffic`` is probed on luban's own
        eager kernels)."""
        return EAGER_TRAFFIC if self.runs_eager(problem, head) else 1.0

    def runs_eager(self, problem, head: bool = False) -> bool:
        """Whether the layers' (``head``: the head's and loss's) elementwise work runs as separate
        eager kernels on a GPU: an eager runtime not compiled there (CPU profiles: False, their
        traffic is probed on luban's own eager kernels)."""
        compiled = self.compiled(problem)
        fused = compiled is True or (compiled == "blocks" and not head)
        return self.eager_kernels and not fused and not problem.system.cpu

    def gather_bytes(self, wb, precision, problem=None):
        """Bytes per parameter a weight all-gather moves: 2 where weights are gathered in the 16-bit
        compute dtype (FSDP's ``param_dtype``), else the stored weight bytes; with ``fp8_gather``
        an fp8 run gathers the transformer layers' linear weights in fp8 (1 byte) and the rest
        (embedding, output layer, norms) in the 16-bit dtype."""
        out = np.where(self.gather_half & (precision != FP32), 2.0, wb) if self.gather_half else wb
        if not self.fp8_gather or problem is None:
            return out
        from luban.model import flops

        linear = problem.model.layers * problem.derived["layer_matmul_weights"] / flops.param_count(problem.model)
        return np.where(precision == FP8, linear * 1.0 + (1 - linear) * 2.0, out)

    # --- byte accounting -------------------------------------------------------------------
    def param_bytes(self, states: int, precision, problem=None) -> tuple:
        """Bytes per parameter of (weights, gradients, optimizer state) before sharding (``problem``:
        its per-problem switches, e.g. ``grad_reduce_fp32``)."""
        raise NotImplementedError

    def layer_activations(self, problem, g) -> dict:
        """Bytes per token a layer saves (before the in-flight and recompute choices): ``none``,
        ``selective``, ``full`` (the checkpointed input), ``fixed_none`` (bytes per micro-batch
        independent of tokens) and the activation element size ``e``."""
        return korthikanti_layer(problem, g, self)

    def edge_activations(self, problem, g, e) -> tuple:
        """((per-token, fixed) on the first rank, (per-token, fixed) on the last rank) outside the
        layers: embedding output; final norm, LM-head input and fp32 logits."""
        h, t = problem.model.hidden, g.tp
        rep_div = np.where(g.sp, t, 1)
        masks = 1.0 if problem.model.dropout > 0 or not self.flash_attention else 0.0
        logits = 4.0 * problem.model.vocab / t
        return (masks * h / rep_div, 0.0), (2 * e * h / rep_div + logits, 0.0)

    def fp8_state_bytes(self, problem, g, layers):
        """Bytes an fp8 recipe keeps on a rank holding ``layers`` layers: fp8 weight copies of the
        linear layers and the amax history, scale and inverse scale (fp32) of every fp8 tensor."""
        if self.fp8_weight_copy_bytes == 0 and self.fp8_amax_history == 0:
            return 0.0
        weights = self.fp8_weight_copy_bytes * problem.derived["layer_matmul_weights"] / g.tp
        scaling = 3 * GEMMS_PER_LAYER * 4.0 * (self.fp8_amax_history + 2)
        return np.where(g.precision == FP8, layers * (weights + scaling), 0.0)

    def fp8_cast_bytes(self, problem, g):
        """HBM bytes per token per layer (the average layer) that quantising the GEMM inputs moves
        (read bf16, write fp8: 3 bytes per element per pass) in forward; the output gradients in
        backward double it. Inputs: QKV and fc1 (h each), projection and fc2 (q/tp, ffn/tp); in a
        MoE layer the fc1 and fc2 inputs of every routed copy and shared expert (k + shared copies
        of h and f_e): split by tp inside the experts (``expert_tp``), or, folded, each rank
        quantising its sequence-parallel 1/tp of the tokens (``ep_folding``)."""
        cfg = problem.model
        attention = cfg.hidden + cfg.q_dim / g.tp
        dense = cfg.hidden + cfg.ffn_hidden / g.tp
        copies = cfg.experts_per_token + cfg.shared_experts if cfg.moe else 0
        if self.ep_folding:
            moe = copies * (cfg.hidden + cfg.expert_ffn_hidden) / g.tp
        else:
            moe = copies * (cfg.hidden + cfg.expert_ffn_hidden / (g.tp if self.expert_tp else 1))
        share = problem.derived["moe_share"]
        inputs = attention + (1 - share) * dense + share * moe
        return np.where(g.precision == FP8, 3.0 * self.fp8_cast_passes * inputs, 0.0)

    def dp_collective_counts(self, problem, g, m, n) -> tuple:
        """(all-gathers of weights, reduce-scatters of gradients per step, groups each splits
        into) at ZeRO >= 1. ZeRO Sec. 7: stages 1-2 one reduce-scatter and one all-gather per
        step, stage 3 two all-gathers and one reduce-scatter per micro-batch, each over the
        whole model."""
        return np.where(g.zero >= 3, 2 * m, 1), np.where(g.zero >= 3, m, 1), 1

    def selective_flops(self, problem, g):
        """FLOPs per token ``recompute = "selective"`` adds (HFU): the attention core again
        (Korthikanti et al. 2022 Sec. 4.2; ``luban.model.flops``)."""
        return problem.derived["selective_extra"]

    def selective_redo(self, problem, g, mm, attn, elementwise, korthikanti):
        """Seconds one layer's forward recomputes under ``recompute = "selective"`` (mm, attn,
        elementwise: that forward's GEMMs, attention core and elementwise kernels). Korthikanti
        et al. 2022 Sec. 4.2: only the attention core (``korthikanti``)."""
        return korthikanti

    # --- overlap per mechanism -------------------------------------------------------------
    def tp_exposed(self, g, comm, gemm, overlap: bool = False):
        """Seconds of TP communication ``comm`` left exposed beside ``gemm`` seconds of GEMMs. With
        ``overlap`` (``tp_overlap``) and sequence parallel, each all-gather/reduce-scatter is split into
        chunks pipelined with the adjacent GEMM: hidden up to the GEMM time; otherwise all exposed."""
        if not overlap:
            return comm
        return np.where(g.sp, np.maximum(0.0, comm - gemm), comm)

    def pp_exposed(self, g, transfer, transfers, chunk):
        """Exposed p2p seconds of ``transfers`` sends/receives of ``transfer`` seconds each;
        ``chunk``: compute of one model chunk for one micro-batch."""
        return transfers * transfer

    def dp_hidden(self, problem, g, gather, reduce, F, B, busy):
        """Seconds of data-parallel communication (``gather``: weight all-gathers, ``reduce``:
        gradient reduction) hidden behind compute. F, B: one micro-batch's forward and backward
        on the rank; busy: the step's compute. ZeRO-3 gathers overlap with compute up to the
        profile's ``zero3_overlap`` share of it."""
        total = gather + reduce
        return np.where(g.zero >= 3, np.minimum(total, problem.system.efficiency["zero3_overlap"] * busy), 0.0)


class Megatron(Runtime):
    name = "megatron"
    # every stage, cp and offload kind, "blocks" too: the planner's general model (its tests' and what-ifs'),
    # beyond what the Megatron-LM of the 2021-22 papers ran (DDP and ZeRO-1; no ZeRO-3, cp or offload)
    offloads = OFFLOADS
    pipeline_split = "megatron"  # Megatron-Core ``get_num_layers_to_build``; DeepSpeed's "type:transformer|embedding"
    ddp_with_tp = True
    ddp_with_split_backward = True
    flash_attention = False
    pads_vocab_default = True  # --make-vocab-size-divisible-by (default 128) x tp
    expert_tp = True  # Megatron's expert_tensor_parallel_size defaults to tp

    def param_bytes(self, states, precision, problem=None):
        """Half precision: 2-byte weights and gradients, K = 4 + 4·states bytes of fp32 master
        weights and optimizer states (ZeRO Sec. 3.1: K = 12 for Adam); fp32: 4 + 4 + 4·states."""
        state_b = 4.0 * states
        half = precision != FP32
        return np.where(half, 2.0, 4.0), np.where(half, 2.0, 4.0), np.where(half, 4.0 + state_b, state_b)


class MegatronCore(Megatron):
    name = "megatron-core"
    offloads = OFFLOADS  # blocks: seed 003's what-if, planned for ``luban plan study``, run by no framework
    flash_attention = True
    expert_tp = False  # with folding the experts take expert_tensor_parallel_size = 1 (the recipes' ETP)
    ep_folding = True
    cp_shards = True  # the distributed optimizer shards over the data-parallel-with-cp group
    causal_skip = True  # TE/cuDNN fused attention
    precisions = PRECISIONS
    # TransformerEngine delayed scaling (``--fp8-format hybrid``, ``te.Linear``): the fp8 input of
    # each GEMM is what backward keeps; the fp8 weight and its transpose (Hopper's fp8 GEMMs need
    # both layouts) are cached across micro-batches; amax history of 1024 entries (TE's
    # DelayedScaling default); the amax is fused into the cast: one pass
    fp8_saved_gemm_inputs = True
    fp8_weight_copy_bytes = 2.0
    fp8_amax_history = 1024
    fp8_cast_passes = 1
    tp_overlap_default = True  # --tp-comm-overlap: the Megatron-Bridge performance recipes set it with tp > 1
    # Host seconds to issue one MoE layer's forward (its dispatch, grouped GEMMs, combine and the next
    # layer's attention and router) after the dropless dispatcher's wait for the token counts
    # (``time.moe_host_stall``; the waits, NVIDIA/Megatron-LM @d98e8a64 2026-08-22: the alltoall dispatcher's
    # ``d2h_event.synchronize()`` "before_ep_alltoall", token_dispatcher.py; DeepEP's dispatch, "the CPU will
    # wait for GPU's signal to arrive", and HybridEP's without ``num_permuted_tokens``, "causes a D2H
    # synchronization", fused_a2a.py; the allgather dispatcher's ``.cpu()`` of the counts, token_dispatcher.py;
    # none of the options that remove it is a default: drop-and-pad, moe_expert_rank_capacity_factor).
    # Fitted, not measured: the value that minimises the mean of the two MoE sources' mean |error|
    # (``luban.plan.loso.fit_moe``; each source held out of the fit lands within 25%: docs/planner.md, MoE);
    # Measuring it needs a profile of a Megatron-Core MoE layer (``bench/gpu_check.py`` section (f) times luban's).
    # 5.75 ms until 2026-11-28's refit (the LM head charged to its own pipeline stage, Megatron's pipeline split)
    moe_layer_host_s = 6.5e-3

    grad_reduce_switch = True

    def param_bytes(self, states, precision, problem=None):
        """As ``megatron`` but bf16 accumulates and reduces fp32 main gradients (Megatron-LM
        ``arguments.py``: ``accumulate_allreduce_grads_in_fp32 = True`` under ``--bf16``); fp8
        trains bf16 parameters (``--fp8-format`` with ``--bf16``): the same bytes. With
        ``Problem.grad_reduce_fp32`` False (Megatron-Bridge's ``grad_reduce_in_fp32 = False``, which
        its H100 performance recipes set) the main gradients are 16-bit: 2 bytes."""
        wb, gb, ob = super().param_bytes(states, precision)
        main = 2.0 if problem is not None and problem.grad_reduce_fp32 is False else 4.0
        return wb, np.where((precision == BF16) | (precision == FP8), main, gb), ob

    def pp_exposed(self, g, transfer, transfers, chunk):
        """``--overlap-p2p-communication`` (interleaved schedule only): each transfer runs
        behind one model chunk's compute."""
        return transfers * np.where(g.virtual_stages > 1, np.maximum(0.0, transfer - chunk), transfer)

    def dp_hidden(self, problem, g, gather, reduce, F, B, busy):
        """``--overlap-grad-reduce``: bucketed gradient reduction (all-reduce, or reduce-scatter
        under the distributed optimizer) behind the last micro-batch's backward, bounded by it;
        ``--overlap-param-gather``: the all-gather of updated weights behind the next step's first
        forward, bounded by it. ZeRO-3 (not a Megatron-Core mode) as the base."""
        hidden = np.minimum(reduce, B) + np.minimum(gather, F)
        return np.where(g.zero >= 3, super().dp_hidden(problem, g, gather, reduce, F, B, busy), hidden)


class FSDP2(Runtime):
    name = "fsdp2"
    fsdp = True
    pipeline_split = "torchtitan"  # ``generate_llm_fqn_per_model_part`` (memory.torchtitan_rank_layers); luban's own below
    eager_kernels = True  # torchtitan's model is plain PyTorch; ``--training.compile`` compiles each block
    # (``apply_compile``: ``torch.compile(transformer_block, fullgraph=True)`` per layer; the output
    # layer and the loss stay eager): planned with ``Problem.compiled = "blocks"``
    gather_half = True  # ``MixedPrecisionPolicy(param_dtype=bf16)``: FSDP2 all-gathers bf16 weights
    cp_shards = True
    causal_skip = True  # SDPA flash / cuDNN attention with is_causal
    precisions = PRECISIONS
    # torchao float8 with tensorwise dynamic scaling (torchtitan ``--model.converters float8``):
    # backward keeps the bf16 inputs and re-quantises them; no persistent fp8 weights (the fp8
    # all-gather's copies are transient); one amax pass and one cast pass per tensor
    fp8_cast_passes = 2
    # async TP (``--tp-overlap on``) speeds up the forward only: the PyTorch team's introduction of it
    # (discuss.pytorch.org/t/209487, 2024-09) reports "up to ~29% forward pass speedup and ~8% E2E speedup
    # in Llama3 7B", "~20% forward ... ~8% E2E" in 70B; an overlapped backward would move E2E with the forward
    tp_overlap_backward = False
    # ``--float8.enable_fsdp_float8_all_gather``: torchao casts each Float8Linear weight shard before
    # FSDP2's all-gather (the output layer stays bf16: torchtitan's float8 converter skips "output");
    # torchtitan's float8 docs recommend it and the Trainy H200 rows ran it
    fp8_gather = True

    def selective_redo(self, problem, g, mm, attn, elementwise, korthikanti):
        """torchtitan's op-level selective checkpointing (``selective_ac_option = "op"``,
        ``parallelize_llama.py`` @9dec370 ``_save_list``/``_custom_policy``): the outputs of the
        flash attention and of every *other* ``aten.mm`` are saved; the 2nd, 4th and 6th of a
        Llama block's seven (wk, wo, w3 in call order wq, wk, wv, wo, w1, w3, w2) and every
        elementwise op are recomputed in backward."""
        cfg = problem.model
        h, q, kv, f = cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.ffn_hidden
        share = (h * kv + q * h + h * f) / (h * q + 2 * h * kv + q * h + 3 * h * f)
        return share * mm + elementwise

    def param_bytes(self, states, precision, problem=None):
        """fp32 sharded weights and gradients (``reduce_dtype=fp32``) and optimizer state; the
        bf16 gathered copies are transient (``memory.fsdp_transients``)."""
        ones = np.ones_like(precision, dtype=float)
        return 4.0 * ones, 4.0 * ones, 4.0 * states * ones

    def dp_hidden(self, problem, g, gather, reduce, F, B, busy):
        """FSDP2 prefetches the next group's all-gather and reduce-scatters behind the
        backward at every stage >= 1, up to the profile's ``zero3_overlap`` share of compute;
        DDP (zero 0) overlaps its bucketed all-reduce with the last backward."""
        share = problem.system.efficiency["zero3_overlap"]
        total = gather + reduce
        return np.where(g.zero >= 1, np.minimum(total, share * busy), np.minimum(total, B))


class Luban(FSDP2):
    name = "luban"
    pipeline_split = "luban"  # luban.parallel.pipeline builds the stages the closed form counts
    def selective_redo(self, problem, g, mm, attn, elementwise, korthikanti):
        """luban's op-level selective checkpointing (``luban.parallel.recompute``) saves every GEMM
        and the fused attention: only the elementwise kernels run again; under context parallel
        the ring attention core (Korthikanti)."""
        return np.where(g.cp > 1, korthikanti, elementwise)

    def selective_flops(self, problem, g):
        """No GEMM and no attention core run again (elementwise work has no FLOPs counted), except
        under context parallel (``luban.parallel.recompute.recomputed_flops_mode``)."""
        return np.where(g.cp > 1, problem.derived["selective_extra"], 0.0)

    def skips_causal(self, problem) -> bool:
        """``F.scaled_dot_product_attention(is_causal=True)`` dispatches to FlashAttention on a CUDA
        GPU (masked blocks skipped) and to the math path on a CPU (``causal_skip`` False: the
        planner's CPU terms were fitted so)."""
        return not problem.system.cpu
    pads_vocab_default = True  # luban.model.head_loss.VOCAB_MULTIPLE (since issue #22; 3457f4b did not)
    compiled_default = True  # ``[train] compile = "auto"``: on for CUDA (CPU profiles: traffic_scale is 1)
    # not every half precision: FSDP2 gathers in ``luban.parallel.layout.FSDP_PARAM_PRECISION``, bf16 only
    # (``gather_bytes`` below); fp16 gathers the fp32 weights
    gather_half = False
    fp8_gather = False  # no fp8 (check_layout rejects it)
    causal_skip = False  # as measured on CPU (math path) and as the planner's CPU terms were fitted
    precisions = LUBAN_RULES.precisions  # no fp8 GEMMs yet (check_layout rejects it)
    offloads = LUBAN_RULES.offloads  # what luban's runtime runs
    fp8_cast_passes = 0
    # every step (luban.train.trainer): the loss (over dp·cp) and the gradient norm (over every rank), on the
    # device (luban.parallel.engine; read on the host only on logging steps), and the suspend flag, a CPU
    # tensor over a gloo group (luban.train.preempt.any_rank; ``checkpoint_every_minutes`` adds one more
    # such flag); each charged as one latency-bound all-reduce of a scalar over every rank
    scalar_allreduces = 3
    cpu_overheads = True
    head_grad_view = True  # measured: tests/plan/test_runtime_multirank.py
    offload_host_shards = True  # luban.parallel.data_parallel's CPU optimizer step
    experts_replicated_with_ep = True  # luban.parallel.expert_parallel
    # luban.parallel.microbatch.PipelineSchedule runs the whole step in one autocast context, whose
    # cache keeps each weight's half-precision copy for every micro-batch (measured: the sweep in
    # tests/train/test_auto.py; per micro-batch it counted the copies 8 times at pp 2, mb 1)
    pipeline_fixed_once = True

    def pads_vocab(self, problem, g):
        """Only the fused head and loss (``luban.model.head_loss``: one stage, no tensor parallel)
        runs on the padded vocabulary; the vocab-parallel head and a pipeline's last stage keep
        the model's width. ``Problem.pads_vocab`` (``--pad-vocab``), when set, decides alone."""
        padded = super().pads_vocab(problem, g)
        return padded if problem.pads_vocab is not None else padded & (g.tp == 1) & (g.pp == 1)

    def layer_activations(self, problem, g):
        return luban_layer(problem, g)

    def edge_activations(self, problem, g, e):
        cfg = problem.model
        h, t = cfg.hidden, g.tp
        rep_div = np.where(g.sp, t, 1)
        big = luban_residual_bytes(g)
        norm_saved = big * h + 8 if cfg.norm == "layernorm" else 2 * big * h + 4
        rope = 8.0 * problem.seq * cfg.head_dim if cfg.position == "rope" else 8.0 * problem.seq
        every_layer_recomputed = (g.recompute == FULL) & (g.recompute_every == 1) & (cfg.position == "rope")
        first = (8.0, np.where(every_layer_recomputed, 0.0, rope))
        # the logits path (tensor or pipeline parallel): the head's input (an autocast copy
        # unless fp32), fp32 log-probabilities, the labels; the head weight's autocast copy
        logits_tok = norm_saved / rep_div + np.where(g.precision == FP32, big, e) * h + 4.0 * cfg.vocab / t + 8.0
        logits_fix = np.where((g.precision == FP32) | luban_fsdp_casts(g), 0.0, 2.0 * cfg.vocab * h / t)
        # the fused head + loss (luban.model.head_loss, one stage without tensor parallel):
        # the gradients it computed in forward, the input's (the norm output's dtype) and the
        # weight's (always fp32)
        fused = (g.tp == 1) & (g.pp == 1)
        last_tok = np.where(fused, norm_saved + big * h, logits_tok)
        last_fix = np.where(fused, 4.0 * cfg.vocab * h, logits_fix)
        return first, (last_tok, last_fix)

    def dp_collective_counts(self, problem, g, m, n):
        """FSDP2 groups (``luban.parallel.data_parallel``), one per block and one for the rest
        of the stage, each issuing its own collectives; every micro-batch's forward gathers each
        group (backward again at stage 3), and the gradients are reduce-scattered per micro-batch
        at stages 2-3, once per step at stage 1."""
        groups = n + 1
        return m * groups * np.where(g.zero >= 3, 2, 1), groups * np.where(g.zero >= 2, m, 1), groups

    dp_hidden = Runtime.dp_hidden  # as measured: DDP and ZeRO 1-2 reductions are not hidden

    def gather_bytes(self, wb, precision, problem=None):
        """2 bytes where FSDP2 casts the parameters (``MixedPrecisionPolicy(param_dtype=bf16)``: the
        precisions of ``luban_fsdp_casts``), else the stored fp32 weights. Measured 2026-11-28 on 2 gloo
        ranks (tests/plan/test_fsdp_gather_measured.py: FSDP2's all-gathers of luban's Engine): bf16
        gathers bf16, 2.0 bytes per parameter; fp16 and fp32 gather fp32, 4.0 (until then the planner
        charged 4 in bf16 too, measured before luban cast bf16 with FSDP2 on 2026-11-21)."""
        return np.where(np.isin(precision, _fsdp_cast_codes()), 2.0, wb)


class PlainPyTorch(FSDP2):
    """One process, no sharding: a plain PyTorch training loop (nanoGPT-style scripts; Hugging Face
    model classes: ``transformers``) with fp32 weights under bf16 autocast and SDPA attention;
    eager unless compiled (``Problem.compiled``: the whole model with its loss)."""
    name = "pytorch"
    zeros = (0,)  # (one process: DDP at most, no sharding, context parallel or offload)
    context_parallel = False
    offloads = ("none",)
    selective_redo = Runtime.selective_redo


# Hugging Face GPT-2's ``activation_function = "gelu_new"`` is transformers.activations.NewGELUActivation,
# ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`` in Python: 8 eager kernels forward and
# 13 in its autograd backward that read and write 46 [tokens, ffn] tensors where ATen's
# F.gelu(approximate="tanh") and gelu_backward move 5 (counted with a TorchDispatchMode on the CPU:
# tests/plan/test_runtimes.py::test_gelu_new_passes_are_counted_from_transformers_code)
GELU_NEW_EXTRA_PASSES = 46 - 5


class Transformers(PlainPyTorch):
    """Hugging Face ``transformers`` model classes (``GPT2LMHeadModel``, ``LlamaForCausalLM``) in a
    plain single-process loop with SDPA attention. What differs from a hand-written loop
    (``pytorch``): GPT-2's activation is eager Python (``GELU_NEW_EXTRA_PASSES``), and under
    torch.compile the causal mask is materialised and handed to SDPA (``masks_attention``)."""
    name = "transformers"
    activation_passes = {"gelu": GELU_NEW_EXTRA_PASSES}

    def masks_attention(self, problem) -> bool:
        """transformers 5.17 (the version of the measured rows) ``masking_utils._ignore_causal_mask_sdpa``
        returns False whenever ``is_tracing()`` (dynamo compiling), so ``create_causal_mask`` builds
        the [b, 1, s, s] mask and ``sdpa_attention_forward`` calls SDPA with it and ``is_causal=False``,
        which rules out the flash kernel (transformers 5.24 notes that only torch >= 2.14 lets it skip
        the mask while compiling). Eager, the mask is skipped and SDPA gets ``is_causal=True``."""
        return self.compiled(problem) is not False


class MegatronDeepSpeed(Megatron):
    """Megatron-DeepSpeed as BigScience (BLOOM) and Microsoft + NVIDIA (MT-NLG) ran it in 2021-22:
    Megatron-LM's layers and fused kernels (``megatron``'s accounting, no overlap), DeepSpeed's
    pipeline engine and ZeRO-1 optimizer."""
    name = "megatron-deepspeed"
    zeros = (0, 1, 2, 3)  # DeepSpeed's ZeRO stages, its optimizer and parameter offload (ZeRO-Offload, -Infinity)
    offloads = ("none", "optimizer", "params", "activations")
    context_parallel = True  # DeepSpeed-Ulysses
    # The share of Megatron-LM's compute speed this runtime reached (``Runtime.compute_speed``). Evidence:
    # on the same 530B model, layout (tp 8, pp 35, full recompute) and machine (Selene), Megatron-LM ran
    # 163 TFLOP/s per GPU (Narayanan et al. 2021, arXiv 2104.04473, Table 1; planned within 1.5%) and
    # MT-NLG's Megatron-DeepSpeed 113-126 (Smith et al. 2022, arXiv 2201.11990, Sec. 2.4): 0.69-0.77 of it.
    # No mechanism of the model explains the gap: DeepSpeed's PipelineEngine reduces the gradients
    # (ReduceGrads, ReduceTiedGrads) after the pipeline flush, unhidden, which ``megatron``'s accounting
    # already charges (no data-parallel overlap; the tied embedding's all-reduce is < 0.1% of these steps),
    # and its pipeline sends are split over the tp ranks as Megatron's scatter-gather is
    # (``PipelineEngine.is_pipe_partitioned``). Fitted, not measured: the value of ``loso.DS_GRID`` with the
    # lowest mean over every source of its mean |error| (``bench/plan_calibrate_sources.py``; only the
    # BLOOM and MT-NLG rows depend on it, and ``luban plan validate`` scores each of the two with the value
    # the other alone implies): 0.80 (mean of the sources' means 5.51%; 0.75 5.62%, 0.85 5.78%, 1.0 8.62%).
    # 2026-11-28; 1.0 (Megatron-LM's speed) before
    compute_speed = 0.80


class ComposerFSDP(FSDP2):
    """MosaicML Composer + PyTorch FSDP (FSDP1, llm-foundry's MPT benchmarks of 2023-24): amp_bf16
    (fp32 master weights, ``param_dtype`` bf16 gathers, fp32 reduce), FlashAttention, no
    torch.compile: eager elementwise kernels."""
    name = "composer-fsdp"
    eager_kernels = True
    gather_half = True
    fp8_gather = False  # torchao's fp8 all-gather is torchtitan's; Composer's rows here are bf16
    selective_redo = Runtime.selective_redo


# Elementwise HBM traffic of eager PyTorch kernels over fused ones (``Runtime.traffic_scale``): one
# constant for every eager runtime, fitted across sources by bench/plan_calibrate_sources.py
# (leave-one-source-out in ``luban plan validate``). An eager RMSNorm alone is ~6 fp32 passes
# (upcast, square, mean, rsqrt, two multiplies) where a fused kernel reads and writes once.
# 2.0 since 2026-11-26, session 14 (with the profiles' elementwise_traffic refitted 1.5 -> 2.0 when rings across
# nodes began to share the node's NICs: 4.0 fused bytes per stored byte, was 3.0 x 1.5 = 4.5); 3.0 and 3.5 before
EAGER_TRAFFIC = 2.0


RUNTIMES = {r.name: r for r in (Megatron(), MegatronCore(), FSDP2(), Luban(), MegatronDeepSpeed(), ComposerFSDP(), PlainPyTorch(),
                                 Transformers())}


def get(name: str) -> Runtime:
    try:
        return RUNTIMES[name]
    except KeyError:
        raise bad_value("--runtime", name, f"one of {', '.join(RUNTIMES)}") from None


def korthikanti_layer(problem, g, rt: Runtime) -> dict:
    """Korthikanti et al. 2022, Table 2, generalised to grouped-query attention and the MLP
    width; with flash attention the s x s scores are replaced by the log-sum-exp (4a bytes),
    and dropout masks (1 byte) count only where the model has dropout or the runtime is the
    papers' (which always had them)."""
    from luban.plan.memory import moe_activation_bytes  # memory -> problem -> runtimes

    cfg = problem.model
    h, q, kv, f, a = cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.ffn_hidden, cfg.heads
    t = g.tp
    rep_div = np.where(g.sp, t, 1)  # sequence parallel splits the replicated part too
    s_keys = problem.seq / g.cp
    e = np.where(g.precision == FP32, 4.0, 2.0)
    x = np.where((g.precision == FP8) & rt.fp8_saved_gemm_inputs, 1.0, e)  # a GEMM input kept for backward
    dense = 1 - problem.derived["moe_share"]  # the MLP terms below are for the dense layers
    masks = 1.0 if cfg.dropout > 0 or not rt.flash_attention else 0.0
    replicated = (2 * e + 2 * x + 2 * masks) * h  # 2 norm inputs, QKV and MLP inputs, 2 dropout masks
    width = 3 if cfg.activation == "swiglu" else 2
    mlp = dense * ((width - 1) * e + x) * f  # fc1 output(s) for the activation's backward, fc2 input
    moe = moe_activation_bytes(problem, g, e, width, 1)
    sharded = e * (q + 2 * kv) + x * q + mlp  # Q and K, V; out-proj input; MLP
    scores = 4.0 * a if rt.flash_attention else a * s_keys * (2 * e + 1)  # softmax, mask, dropout out
    return {"none": replicated / rep_div + (sharded + scores) / t + moe,
            "selective": replicated / rep_div + sharded / t + moe,
            "full": e * h / rep_div, "fixed_none": np.zeros_like(e), "e": e}


@functools.cache
def _fsdp_cast_codes() -> tuple:
    """The grid's precision codes in which luban's FSDP2 casts the parameters
    (``luban.parallel.layout.FSDP_PARAM_PRECISION``, by name: no torch)."""
    from luban.parallel.layout import FSDP_PARAM_PRECISION, fsdp_casts

    return tuple(PRECISIONS.index(p) for p in FSDP_PARAM_PRECISION if fsdp_casts(p))


def luban_fsdp_casts(g):
    """Layouts where luban's FSDP2 casts the parameters to the compute dtype
    (``MixedPrecisionPolicy(param_dtype=...)``: the precisions with a
    ``luban.parallel.layout.FSDP_PARAM_PRECISION``, bf16 only since 2026-11-28) instead of autocast,
    on the layouts that use FSDP2 (zero >= 1 with dp·cp > 1, or ``offload = params`` on any dp·cp;
    ``luban.parallel.data_parallel.uses_fsdp``): the whole forward runs in that dtype (residual stream
    and norms too) and no per-micro-batch weight copies are saved (the cast weights are FSDP2's
    parameters). fp16 under FSDP2 gathers the fp32 weights and runs autocast, as one process does."""
    casts = np.isin(g.precision, _fsdp_cast_codes())
    return casts & (g.zero >= 1) & ((g.dp * g.cp > 1) | (g.offload == PARAMS_OFFLOAD))


def luban_residual_bytes(g):
    """Bytes per element of luban's residual stream and norms: fp32 (the weights are fp32) under
    autocast (fp32, and bf16/fp16 without FSDP2's cast), 2 where FSDP2 casts the parameters to bf16
    (``luban_fsdp_casts``)."""
    return np.where(luban_fsdp_casts(g), 2.0, 4.0)


def luban_layer(problem, g) -> dict:
    """The tensors PyTorch saves for ``luban.model.transformer.Block`` (docs/planner.md lists
    them): fp32 residual stream and norms, autocast weight copies per micro-batch."""
    from luban.plan.memory import expert_split, moe_activation_bytes  # memory -> problem -> runtimes

    cfg = problem.model
    h, q, kv, f, a = cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.ffn_hidden, cfg.heads
    t = g.tp
    rep_div = np.where(g.sp, t, 1)
    dense = 1 - problem.derived["moe_share"]  # the MLP terms below are for the dense layers
    big = luban_residual_bytes(g)  # residual stream, norms
    e = np.where(g.precision == FP32, 4.0, 2.0)
    no_autocast = (g.precision == FP32) | luban_fsdp_casts(g)
    norm_saved = big * h + 8 if cfg.norm == "layernorm" else 2 * big * h + 4
    consumers = 2 if cfg.activation == "swiglu" else 1
    # autocast: one half-precision cast of a norm output per consuming linear; else one tensor each
    norm_out = np.where(no_autocast, big * h * 2, e * h * (3 + consumers))
    # luban's sequence parallel all-gathers the norm outputs before the linears, which save
    # them whole (Megatron instead re-gathers them in backward): only norm inputs shrink
    replicated = 2 * norm_saved / rep_div + norm_out
    width = 4 if cfg.activation == "swiglu" else 2
    mlp = dense * width * e * f
    moe = moe_activation_bytes(problem, g, e, width, 2)
    core_out = e * q
    core = np.where(g.cp > 1, ring_attention_bytes(problem, g), e * 3 * q + 4 * a)
    weights = problem.derived["layer_matmul_weights"] / t + problem.derived["layer_experts"] / expert_split(problem, g)
    autocast_copies = np.where(no_autocast, 0.0, 2.0 * weights)  # autocast's half-precision weight copies
    block_input = big * h / rep_div  # what a checkpointed block keeps
    # selective (op-level SAC, luban/parallel/recompute.py): the block input and the outputs of
    # the GEMMs (q, k, v; up (and gate); each row-parallel projection's partial sum and, under tp,
    # its all-reduce / reduce-scatter), of the fused attention (output and fp32 log-sum-exp) and of
    # sp's all-gathers (the norm outputs, whole); the casts are recomputed (no weight copies kept).
    # Under cp: the ring attention core alone is recomputed (Korthikanti) and the rest is saved.
    rows = (1 + dense) * e * h * (1 + np.where(t > 1, 1 / rep_div, 0.0))
    gathers = np.where(g.sp & (t > 1), 2 * big * h, 0.0)
    sac = (block_input + gathers + rows + (e * (q + 2 * kv) + core_out + 4 * a + dense * consumers * e * f) / t
           + luban_selective_moe(problem, g, e, consumers))
    return {"none": replicated + (core + core_out + mlp) / t + moe,
            "selective": np.where(g.cp > 1, replicated + (e * (q + 2 * kv) + core_out + mlp) / t + moe, sac),
            "full": block_input,
            "fixed_none": autocast_copies,
            "fixed_selective": np.where(g.cp > 1, autocast_copies, 0.0),
            "selective_resident": np.where(g.cp > 1, 0.0, sac - block_input),  # SAC's cache: never offloaded
            "e": e}


def luban_selective_moe(problem, g, e, consumers):
    """Bytes per token (average layer) selective recompute saves in luban's MoE feed-forward: the
    router's GEMM (E logits), each routed copy's and each shared expert's GEMM outputs (gate and
    up, or up; down) and, under expert parallel, the dispatch and combine all-to-alls' outputs."""
    cfg = problem.model
    if not cfg.moe:
        return 0.0
    k, fe, h = cfg.experts_per_token, cfg.expert_ffn_hidden, cfg.hidden
    experts = (k + cfg.shared_experts) * (consumers * fe + h) * e
    exchange = np.where(g.ep > 1, 2 * k * h * e, 0.0)
    return problem.derived["moe_share"] * (experts + cfg.experts * e + exchange)


def ring_attention_bytes(problem, g):
    """Bytes per token (before the tp split) that luban's ring attention saves in one layer
    (luban/parallel/context_parallel.py: fp32 math-path blocks, no flash kernel).

    Per ring step j of c: the received K/V block (2·4q; step 0 the stacked local one), the
    masked scores and their softmax (2·4·a·s/c), the block's log-sum-exp (4a) and output (4q);
    each merge after the first keeps two exp factors (8a), and from the third step on the
    running output and log-sum-exp (4q + 4a); plus the fp32 query (4q) and the causal mask
    of each step (c·(s/c)/b bytes per token).
    """
    cfg, c = problem.model, g.cp
    q, a = cfg.q_dim, cfg.heads
    keys = problem.seq / c
    per_step = 8 * q + 8 * a * keys + 4 * a + 4 * q
    merges = (c - 1) * 8 * a + np.maximum(c - 2, 0) * (4 * q + 4 * a)
    return 4 * q + c * per_step + merges + c * keys / g.micro_batch
