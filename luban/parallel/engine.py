"""``Engine``: what the trainer drives, whatever the layout.

The trainer only ever calls this API; everything about how the model is split across ranks
(and how gradients, optimizer state and activations move) hides behind it:

* ``forward_backward(tokens, labels)`` runs all micro-batches of this dp rank's share of the
  global batch, accumulates gradients and returns the global mean loss (same on all ranks);
* ``step(lr, max_norm)`` clips by the global gradient norm, applies the optimizer, zeroes grads;
  both return host floats, or with ``host=False`` 0-dim float64 tensors on the device whose
  ``float()`` is the same value: nothing waits for the device (no GPU -> host read) but the
  fp16 loss scaler's overflow check, so the trainer reads them on logging steps only;
* ``state_dict()`` / ``load_state_dict()`` use global parameter names and global (DTensor)
  shapes, model and flattened optimizer state alike, so a DCP checkpoint saved under one
  layout loads under any other;
* ``memory_report()`` gives this rank's exact bytes of parameters, gradients, optimizer state
  and saved activations per micro-batch;
* ``any_rank(flag)`` / ``barrier()`` let the trainer agree across ranks on the device's group (e.g.
  on a checkpoint one rank could not read; the per-step agreements run on the host instead:
  ``luban.train.preempt.any_rank``);
* ``before_update``, if set, is called before anything in ``state_dict()`` changes (the
  optimizer step and router-bias update in ``step``, ``load_state_dict``): an asynchronous
  checkpoint still copying the state waits there. Forward and backward change no part of
  the state dict (gradients, activations and the MoE load counters are not in it).

One engine for every layout, built by composition (torchtitan's ``parallelize_llama``):

1. the device mesh (``mesh.py``; none for a single process);
2. the model parts: one whole model, or this rank's pipeline stages (``pipeline.py``); each
   part goes through ``parallelize``, a flat sequence of ``apply_*`` steps, one per
   dimension: ``apply_ac`` (recompute), ``apply_tp`` (``tensor_parallel.py``), ``apply_cp``
   (``context_parallel.py``), ``apply_ep`` (``expert_parallel.py``), ``apply_dp`` (DDP /
   FSDP2, ``data_parallel.py``; it leaves expert-parallel parameters to ``reduce_expert_grads``,
   run in ``_sync_grads``). A step whose degree is 1 does nothing;
3. a schedule (``microbatch.py``: the plain micro-batch loop or the pipeline's schedule);
4. the tied embedding copies (``tied.py``) and one optimizer per part (``optimizer.py``).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from luban.model import moe
from luban.model.config import ModelConfig
from luban.model.head_loss import compiled_head_loss
from luban.model.transformer import Transformer, lm_loss
from luban.parallel.context_parallel import apply_context_parallel, feed_positions, shard_sequence
from luban.parallel.expert_parallel import apply_expert_parallel, reduce_expert_grads
from luban.parallel.data_parallel import apply_data_parallel, reshard, unwrap, uses_autocast, uses_fsdp
from luban.parallel.layout import ParallelLayout, check_layout
from luban.parallel.memory import ActivationCounter, optimizer_tensors, tensor_bytes
from luban.parallel.memory import local as _local
from luban.parallel.mesh import LayoutMesh, build_mesh, coordinate
from luban.parallel.microbatch import MicroBatchLoop, PipelineSchedule, Schedule
from luban.parallel.activation_offload import ActivationOffload
from luban.parallel.offload import OffloadedOptimizer
from luban.parallel.optimizer import OptimizerConfig, build_optimizer, init_state, load_keeping_hyperparameters
from luban.parallel.recompute import apply_recompute
from luban.parallel.pipeline import Pipeline, TransformerPipeline
from luban.parallel.precision import LossScaler, autocast
from luban.parallel.tensor_parallel import apply_tensor_parallel, loss_parallel, vocab_parallel_loss
from luban.parallel.tied import TiedEmbedding

OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

__all__ = ["Engine", "OptimizerConfig", "autocast", "build_engine", "build_optimizer", "parallelize", "unwrap"]


# ---- the apply_* steps: one per parallel dimension, applied to each model part in this order ----
def apply_ac(module: Transformer, layout: ParallelLayout) -> None:
    """Activation recompute (``none`` | ``selective`` | ``full`` | ``full:k``, ``recompute.py``);
    under context parallel ``selective`` checkpoints the ring attention core alone."""
    apply_recompute(module, layout.recompute, ring_attention=layout.cp > 1)


def apply_tp(module: Transformer, layout: ParallelLayout, mesh: LayoutMesh | None) -> None:
    """Tensor (and sequence) parallel over the ``tp`` mesh dimension."""
    if layout.tp > 1:
        apply_tensor_parallel(module, mesh["tp"], layout.sp)


def apply_cp(module: Transformer, layout: ParallelLayout, mesh: LayoutMesh | None) -> None:
    """Ring attention over ``cp``; a stage whose input is a sequence shard (cp chunks, and tp
    shards for a sequence-parallel stage without the embedding) is fed its global positions."""
    if layout.cp > 1:
        apply_context_parallel(module, mesh["cp"])
        moe.set_sequence_group(module, mesh["cp"].get_group())
    seq_factor = layout.cp * (layout.tp if layout.sp and module.tok_emb is None else 1)
    if seq_factor > 1:
        feed_positions(module, layout.cp, coordinate(mesh, "cp"), seq_factor)


def apply_ep(module: Transformer, layout: ParallelLayout, mesh: LayoutMesh | None) -> None:
    """Expert parallel: the MoE layers' experts sharded over ``ep`` ranks borrowed from dp x cp."""
    if layout.ep > 1:
        apply_expert_parallel(module, mesh["ep"])


def apply_compile(module: Transformer, compile: bool, tp: int = 1) -> None:
    """``torch.compile`` each block in place (torchtitan's per-block compile: one graph per
    distinct block, reused by every layer; names and state dicts unchanged) and the fused head
    + loss as one graph. After recompute, TP, CP and EP (their hooks and collectives are traced
    or break the graph where they must), before data parallel (FSDP2 wraps compiled blocks).
    ``tp``: the layout's; under tensor parallel the blocks are compiled for static shapes (below)."""
    if not compile:
        return
    if module.tok_emb is not None and isinstance(module.tok_emb.weight, DTensor):  # vocab-parallel (TP)
        module.tok_emb.register_forward_hook(_own_storage)
    for block in module.layers.values():
        # tp > 1: static shapes. A block's code seeing a second input shape (sequence parallel: the first
        # block takes the whole sequence, the others their tp-th) is recompiled with symbolic sizes by
        # default, which DTensor's sharding propagation cannot hash ("unhashable type: non-nested SymInt":
        # tiny-llama, tp 2, sp, the first step); one graph per shape instead (a few: train, eval)
        block.compile(dynamic=False if tp > 1 else None)
    if module.lm_head is not None:
        module.head_loss = compiled_head_loss


def _own_storage(_module, _args, output: torch.Tensor) -> torch.Tensor:
    """The vocab-parallel embedding's output as a tensor of its own. Under TP it is a view of a DTensor's
    local tensor (``to_local``); where it reaches a compiled block unchanged (a rope model: no position
    embedding is added), torch 2.13's compiled backward routed its gradient around ``to_local``'s, and
    the embedding's redistribute got a plain tensor ("'Tensor' object has no attribute '_local_tensor'":
    tiny-llama, tp 2, every step). A copy of b·s·hidden, saved by nothing."""
    return output.clone()


def apply_dp(module: Transformer, layout: ParallelLayout, mesh: LayoutMesh | None, device: torch.device) -> nn.Module:
    """Data parallel / ZeRO over dp x cp (DDP or FSDP2); returns the module to call."""
    return apply_data_parallel(module, layout, mesh, device)


def parallelize(module: Transformer, layout: ParallelLayout, mesh: LayoutMesh | None, device: torch.device,
                compile: bool = False) -> nn.Module:
    """One model part (a whole model or a pipeline stage) under ``layout``."""
    apply_ac(module, layout)
    apply_tp(module, layout, mesh)
    apply_cp(module, layout, mesh)
    apply_ep(module, layout, mesh)
    apply_compile(module, compile, layout.tp)
    return apply_dp(module, layout, mesh, device)


def build_schedule(model: TransformerPipeline, layout: ParallelLayout, mesh: LayoutMesh | None, global_batch: int,
                   device: torch.device, loss_fn, scaler: LossScaler, autocast_fn, compile: bool = False) -> Schedule:
    """The model parts of this rank, parallelized, behind the schedule that runs them."""
    def prepare(module: nn.Module, _stage_id: int) -> nn.Module:
        return parallelize(module, layout, mesh, device, compile)

    if layout.pp == 1:
        return MicroBatchLoop(prepare(model.build_stage(0, 1), 0), layout, loss_fn, scaler, autocast_fn)
    pipeline = Pipeline(model, mesh["pp"], layout.schedule, layout.virtual_stages,
                        layout.num_microbatches(global_batch), device, prepare=prepare)
    return PipelineSchedule(pipeline, loss_fn, scaler, autocast_fn, data_ranks=layout.dp * layout.cp)


class Engine:
    """Any layout: a single process (world size 1) or the current process group."""

    def __init__(self, model_cfg: ModelConfig, layout: ParallelLayout, optim_cfg: OptimizerConfig,
                 global_batch: int, seed: int, device: torch.device, compile: bool = False):
        self.model_cfg, self.layout, self.device, self.global_batch = model_cfg, layout, device, global_batch
        self.compiled = compile
        self.mesh = self._join(layout, device)
        self.scaler = LossScaler(layout.precision == "fp16")
        self.loss_fn = vocab_parallel_loss(self.mesh["tp"], model_cfg.vocab) if layout.tp > 1 else lm_loss
        self.schedule = build_schedule(TransformerPipeline(model_cfg, seed, device, layout.pp_split), layout,
                                       self.mesh, global_batch, device, self.loss_fn, self.scaler, self._autocast,
                                       compile)
        self.parts = self.schedule.parts
        self.tied = TiedEmbedding(self.parts, model_cfg, layout, self.mesh)
        self.optimizers = [build_optimizer(part.parameters(), optim_cfg, device, offload=layout.offload == "optimizer")
                           for part in self.parts]
        self._grad_bytes = 0
        self._moe_stats = None  # the last forward_backward's MoE counters, summed over dp (device): moe_metrics
        self._activation_bytes: int | None = None  # measured on the first step (``_recording``)
        self._host_activation_bytes = 0  # of those, moved to host memory (offload = activations)
        self.offload = ActivationOffload(self.parts, device) if layout.offload == "activations" else None
        self.before_update = None  # called before the state dict's tensors change (see the module doc)
        self._copies_cached: tuple = (None, None)  # ``_copies``

    def _join(self, layout: ParallelLayout, device: torch.device) -> LayoutMesh | None:
        """Join the process group and build the mesh (``None`` for a single process, unless FSDP2
        wraps it for ``offload = params``: a one-process group); set this rank's coordinates."""
        self.rank, self.world_size, self.dp_rank, self.dp_size = 0, 1, 0, 1
        self.pp_rank = self.cp_rank = self.tp_rank = 0
        if layout.world_size == 1 and not uses_fsdp(layout):
            return None  # one process, nothing to wrap: no process group (FSDP2's offload needs one)
        from luban.parallel.launch import init_distributed

        init_distributed(device)
        mesh = build_mesh(layout, device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank = coordinate(mesh, "dp_replicate") * layout.dp_shard + coordinate(mesh, "dp_shard")
        self.dp_size = layout.dp
        self.pp_rank, self.cp_rank, self.tp_rank = (coordinate(mesh, d) for d in ("pp", "cp", "tp"))
        return mesh

    @property
    def model(self) -> nn.Module:
        return self.parts[0]

    @property
    def model_parts(self) -> list[nn.Module]:
        return self.parts

    # ---- forward and backward -------------------------------------------------------------
    def forward_backward(self, tokens: torch.Tensor, labels: torch.Tensor, host: bool = True):
        """Accumulate gradients over this rank's micro-batches; return the global mean loss (a
        float; ``host=False``: a 0-dim tensor on the device, see ``_global_mean``)."""
        for part in self.parts:
            part.train()
        tokens, labels = self._local_batch(tokens, labels)
        counter = ActivationCounter(self.parts)
        measuring = self._activation_bytes is None and self.schedule.measurable
        with self._loss_context():
            total = self.schedule.forward_backward(tokens, labels, self._recording(counter, measuring))
        if measuring:
            self._activation_bytes = counter.total // self.schedule.recorded_microbatches
            if self.offload is not None:
                self._host_activation_bytes = self.offload.host_bytes // self.schedule.recorded_microbatches
        self._grad_bytes = tensor_bytes(p.grad for p in self._params())
        if self.model_cfg.moe:  # summed on the device every step (the router bias needs it); read when logged
            self._moe_stats = moe.sum_stats(self.parts, self._sum_over_data)
        return self._global_mean(total, host)

    def moe_metrics(self) -> dict:
        """MoE load and aux loss per layer of the last forward_backward, over the global batch and
        every pipeline stage: read from the device here, not every step (collective under pp:
        every rank calls it at the same steps, as the trainer's logged ones)."""
        if not self.model_cfg.moe:  # a dense model: no layer to walk, no collective
            return {}
        metrics = moe.read_stats(self.parts, self._moe_stats)
        if self.layout.pp > 1:
            stages: list = [None] * self.layout.pp
            dist.all_gather_object(stages, metrics, group=self.mesh["pp"].get_group())
            metrics = moe.merge_stats(stages)
        return metrics

    def _sum_over_data(self, t: torch.Tensor) -> None:
        """Sum ``t`` in place over the ranks that see other tokens of the same layers (dp x cp)."""
        if self.mesh is not None:
            dist.all_reduce(t, group=self.mesh["dp_cp"].get_group())

    def _local_batch(self, tokens, labels):
        """On the device; this cp rank's load-balanced sequence chunks. Copied without waiting: a
        blocking host -> GPU copy synchronises the stream (waits for the last step's kernels), and so
        does an asynchronous one from pageable memory (CUDA's cudaMemcpyAsync "API synchronization
        behavior"), so a GPU batch goes through pinned memory first, as nanoGPT's loader does
        (torch's caching host allocator keeps that block until the copy is done)."""
        if self.device.type == "cuda":
            tokens, labels = (t.pin_memory() for t in (tokens, labels))
        tokens, labels = (t.to(self.device, non_blocking=True) for t in (tokens, labels))
        if self.layout.cp > 1:
            tokens, labels = (shard_sequence(t, self.layout.cp, self.cp_rank) for t in (tokens, labels))
        return tokens, labels

    def _loss_context(self):
        """Vocab-parallel cross-entropy needs ``loss_parallel`` around the loss and its backward."""
        return loss_parallel() if self.layout.tp > 1 else contextlib.nullcontext()

    def _autocast(self):
        return autocast(self.layout, self.device) if uses_autocast(self.layout) else contextlib.nullcontext()

    def _recording(self, counter: ActivationCounter, first: bool):
        """The schedule's ``saved(measured)``: activation offload around every micro-batch; the
        counter around the measured ones of the ``first`` measurable step only (saved-tensor hooks
        cost a Python call per saved tensor, 10x a tiny model's step, and activations have the
        same shapes every step)."""
        if self.offload is not None and first:
            self.offload.host_bytes = 0

        def saved(measured: bool):
            if self.offload is not None:
                return self.offload.hooks(counter if first and measured else None)
            return counter.record() if first and measured else contextlib.nullcontext()
        return saved

    def _global_mean(self, loss: torch.Tensor, host: bool = True):
        """Every dp x cp rank holds the mean of its share (pp and tp ranks agree already). The
        fp32 sum over the ranks, divided in float64 (as a host float divides it): ``host=False``
        returns that 0-dim tensor, whose ``float()`` is bitwise the float ``host=True`` returns."""
        loss = loss.detach().reshape(()).double() if self.layout.dp * self.layout.cp == 1 else \
            self._all_reduced_mean(loss)
        return float(loss) if host else loss

    def _all_reduced_mean(self, loss: torch.Tensor) -> torch.Tensor:
        loss = loss.detach().reshape(()).float().clone()
        dist.all_reduce(loss, group=self.mesh["dp_cp"].get_group())
        return loss.double() / (self.layout.dp * self.layout.cp)

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        """Global mean loss of a batch (this dp rank's slice) without touching gradients."""
        for part in self.parts:
            part.eval()
        tokens, labels = self._local_batch(tokens, labels)
        with self._loss_context():
            loss = _local(self.schedule.evaluate(tokens, labels))
        for part in self.parts:
            reshard(part)
        return self._global_mean(loss)

    # ---- optimizer step ------------------------------------------------------------------
    def _params(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    def _norm_terms(self):
        """(gradient, number of ranks holding the same values) for each gradient counted: a
        plain tensor is on every rank of its stage, a DTensor on its replicated mesh dims."""
        stage_ranks = self.world_size // self.layout.pp
        skip = self.tied.norm_skip()
        terms = []
        for p in self._params():
            if p.grad is None or id(p) in skip:
                continue
            copies = stage_ranks
            if isinstance(p.grad, DTensor):
                mesh = p.grad.device_mesh
                replicated = math.prod(mesh.size(i) for i, pl in enumerate(p.grad.placements) if pl.is_replicate())
                copies = replicated * stage_ranks // mesh.size()
            terms.append((p.grad, copies))
        return terms

    def _all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        """Over every rank (nothing to do in a single process)."""
        if self.mesh is not None:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t

    def _sync_grads(self) -> None:
        """Give DTensor gradients their parameter's layout (an embedding's gradient may come
        back replicated), then sum the tied embedding copies' gradients, and the experts'
        gradients over their expert-data-parallel group."""
        if self.layout.ep > 1:
            reduce_expert_grads(self.parts, self.mesh["edp"].get_group(), self.layout.dp * self.layout.cp)
        for p in self._params():
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        self.tied.sync_grads()

    def grad_norm(self, host: bool = True):
        """Global L2 norm of all gradients, each element counted once across all ranks: a float,
        or (``host=False``) a 0-dim float64 tensor on the device (correctly rounded sqrt both ways:
        the same value)."""
        terms = self._norm_terms()
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        if terms:  # one fused kernel for the per-tensor norms; their squares summed in float64 (on this
            # device: FSDP2's offload = params keeps the gradients on the host)
            norms = torch.stack([n.to(self.device) for n in torch._foreach_norm([_local(g) for g, _ in terms])]).double()
            sq = (norms.pow(2) / self._copies([c for _, c in terms])).sum()
        norm = self._all_reduce(sq).sqrt()
        return float(norm) if host else norm

    def _copies(self, copies: list[int]) -> torch.Tensor:
        """``copies`` as a float64 tensor on the device, made once (the same every step): a
        blocking host -> GPU copy each step would wait for the device."""
        key = tuple(copies)
        if self._copies_cached[0] != key:
            self._copies_cached = (key, torch.tensor(copies, dtype=torch.float64, device=self.device))
        return self._copies_cached[1]

    def step(self, lr: float, max_norm: float, host: bool = True):
        """Set lr, unscale, clip to ``max_norm`` (0: no clipping), step, zero grads; return grad norm
        (``host=False``: the tensor of ``grad_norm``). Under fp16 a non-finite norm skips the step
        (on every rank) and halves the loss scale: that decision reads the norm on the host, the one
        device -> host wait left in a step; without fp16 the clip is computed on the device."""
        self._sync_grads()
        grads = [_local(p.grad) for p in self._params() if p.grad is not None]
        if self.scaler.enabled:  # the loss scale, over dp·cp (and micro-batches): LossScaler.backward_scale
            torch._foreach_mul_(grads, 1.0 / self.schedule.grad_scale)
        norm = self.grad_norm(host=False)
        if not self.scaler.enabled or self.scaler.update(float(norm)):
            if max_norm > 0:
                _clip(grads, max_norm, norm)
            self._before_update()
            for opt in self.optimizers:
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
            if self.model_cfg.moe:
                moe.update_router_bias(self.parts)
        if self.model_cfg.moe:
            moe.reset_stats(self.parts)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return float(norm) if host else norm

    # ---- coordination, checkpoints, memory ------------------------------------------------
    def any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank (all-reduce MAX)."""
        return bool(self._all_reduce(torch.tensor(int(flag), device=self.device), dist.ReduceOp.MAX))

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.mesh is not None:
            dist.barrier()

    def state_dict(self, optimizer: bool = True) -> dict:
        """``{"model", "optim", "scaler"}``; ``optimizer=False``: the model's alone (building the
        optimizer's state dict initialises its states)."""
        model, optim = {}, {}
        for part, opt in zip(self.parts, self.optimizers):
            model.update(get_model_state_dict(part))
            if optimizer:
                init_state(opt)  # not torch's: its states were those of a first step taken
                optim.update(self.tied.save_names(part, get_optimizer_state_dict(part, opt, options=OPTIM_OPTIONS)))
        return {"model": model, "optim": optim, "scaler": self.scaler.state_dict()} if optimizer else {"model": model}

    def _before_update(self) -> None:
        if self.before_update is not None:
            self.before_update()

    def load_state_dict(self, state: dict) -> None:
        self._before_update()
        for part, opt in zip(self.parts, self.optimizers):
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
            if "optim" in state:  # absent: weights only (an imported checkpoint), the optimizer starts fresh
                load_keeping_hyperparameters(opt, lambda part=part, opt=opt: set_optimizer_state_dict(
                    part, opt, self.tied.load_names(part, state["optim"]), options=OPTIM_OPTIONS))
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def memory_report(self) -> dict:
        """This rank's bytes: parameters, gradients (after the last ``forward_backward``),
        optimizer state on the device, activations saved per micro-batch on the device and
        (``offload = activations``) moved to the host (+ peak device memory on GPU, +
        ``host_optimizer_bytes`` of an offloaded optimizer: states and its copies of the
        parameter and gradient shards)."""
        on_device = [opt for opt in self.optimizers if not isinstance(opt, OffloadedOptimizer)]
        report = {"param_bytes": tensor_bytes(self._params()), "grad_bytes": self._grad_bytes,
                  "optimizer_bytes": tensor_bytes(t for opt in on_device for t in optimizer_tensors(opt)),
                  "activation_bytes": self._activation_bytes or 0,
                  "host_activation_bytes": self._host_activation_bytes}
        if len(on_device) < len(self.optimizers):
            report["host_optimizer_bytes"] = sum(opt.host_bytes() for opt in self.optimizers
                                                 if isinstance(opt, OffloadedOptimizer))
        if self.device.type == "cuda":
            report["peak_device_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return report


def _clip(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale ``grads`` by ``max_norm / (norm + 1e-6)`` where that is below 1, on the device: the
    float64 factor, rounded to the gradients' fp32 as a Python float factor is (bitwise the host
    rule ``if coef < 1: grads *= coef``; a factor >= 1 or NaN multiplies by 1, which changes
    nothing). Gradients on another device (FSDP2's ``offload = params`` keeps them on the host)
    get a copy of the factor there."""
    coef = torch.full_like(norm, max_norm).div(norm + 1e-6)  # not ``max_norm / t``: torch computes 1/t * max_norm
    coef = torch.where(coef < 1.0, coef, torch.ones_like(coef))
    by_device: dict = {}
    for g in grads:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), group in by_device.items():  # the factor in the multiply's compute type (float for fp32)
        torch._foreach_mul_(group, coef.to(device=device, dtype=torch.promote_types(dtype, torch.float32)))


def build_engine(model_cfg: ModelConfig, layout: ParallelLayout, optim_cfg: OptimizerConfig,
                 global_batch: int, seed: int, device: torch.device, compile: bool = False,
                 seq_len: int | None = None) -> Engine:
    """The engine for the current process group and layout (after ``check_layout``);
    ``compile``: ``apply_compile`` (``resolve_compile`` turns ``[train] compile`` into it);
    ``seq_len``: the length of the sequences it will train on (``[data] seq_len``; default the
    model's), which the sequence rules of ``check_layout`` apply to."""
    from luban.parallel.launch import check_rank_env

    check_layout(layout, model_cfg, global_batch, world_size=check_rank_env(), seq_len=seq_len)
    return Engine(model_cfg, layout, optim_cfg, global_batch, seed, device, compile)


def resolve_compile(choice: str, device: torch.device) -> bool:
    """``[train] compile``: "true" | "false" | "auto" — on for CUDA, where it pays (issue #22:
    GPT-2 124M 63 -> 40 ms a step on an H100 with the loss inside the graph); off on a CPU,
    where compiling costs more than a short run saves."""
    return device.type == "cuda" if choice == "auto" else choice == "true"
