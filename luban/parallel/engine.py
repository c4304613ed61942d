"""``Engine``: what the trainer drives, whatever the layout.

The trainer only ever calls this API; everything about how the model is split across ranks
(and how gradients, optimizer state and activations move) hides behind it:

* ``forward_backward(tokens, labels)`` runs all micro-batches of this dp rank's share of the
  global batch, accumulates gradients and returns the global mean loss (same on all ranks);
* ``step(lr, max_norm)`` clips by the global gradient norm, applies the optimizer, zeroes grads;
* ``state_dict()`` / ``load_state_dict()`` use global parameter names and global (DTensor)
  shapes, model and flattened optimizer state alike, so a DCP checkpoint saved under one
  layout loads under any other;
* ``memory_report()`` gives this rank's exact bytes of parameters, gradients, optimizer state
  and saved activations per micro-batch;
* ``any_rank(flag)`` / ``barrier()`` let the trainer agree across ranks (e.g. on suspending).

``Engine`` is the single-process engine; ``DistributedEngine`` composes the mesh, tensor,
context, pipeline and data parallel modules of ``luban.parallel`` on top of the same loop.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from luban.model.config import ModelConfig
from luban.model.transformer import lm_loss
from luban.parallel.data_parallel import apply_data_parallel, reshard, set_gradient_sync, uses_autocast
from luban.parallel.layout import ParallelLayout, check_layout
from luban.parallel.memory import ActivationCounter, optimizer_tensors, tensor_bytes
from luban.parallel.memory import local as _local
from luban.parallel.offload import OffloadedOptimizer
from luban.parallel.pipeline import Pipeline, TransformerPipeline
from luban.parallel.precision import LossScaler, autocast

OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"  # adamw | sgd
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    momentum: float = 0.0


def build_optimizer(params, cfg: OptimizerConfig, device: torch.device, offload: bool = False) -> torch.optim.Optimizer:
    """AdamW (weight decay on matrices only) or SGD over ``params``; lr is set every step by the
    trainer. ``offload``: states and update on the host (``luban.parallel.offload``)."""
    params = list(params)
    groups = ([{"params": params, "weight_decay": cfg.weight_decay}] if cfg.name == "sgd" else
              [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
               {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}])
    if offload:
        return OffloadedOptimizer(groups, lambda host_groups: _optimizer(host_groups, cfg, torch.device("cpu")))
    return _optimizer(groups, cfg, device)


def _optimizer(groups: list[dict], cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    """The torch optimizer: AdamW with the fused kernel where the device has one (foreach for
    DTensor parameters), or SGD."""
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=0.0, momentum=cfg.momentum)
    fused = device.type in ("cuda", "cpu") and not any(isinstance(p, DTensor) for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=0.0, betas=cfg.betas, eps=cfg.eps, fused=fused)


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 and DTensor modify modules in place)."""
    return getattr(module, "module", module)


class Engine:
    """Single-process engine: gradient accumulation over micro-batches, AMP, clipping."""

    rank = 0
    world_size = 1
    dp_rank = 0
    dp_size = 1

    def __init__(self, model_cfg: ModelConfig, layout: ParallelLayout, optim_cfg: OptimizerConfig,
                 global_batch: int, seed: int, device: torch.device):
        self.model_cfg, self.layout, self.device, self.global_batch = model_cfg, layout, device, global_batch
        self.parts = self._build_parts(TransformerPipeline(model_cfg, seed, layout.recompute, device, layout.pp_split))
        self.optimizers = [build_optimizer(part.parameters(), optim_cfg, device, offload=layout.offload == "optimizer")
                           for part in self.parts]
        self.scaler = LossScaler(layout.precision == "fp16")
        self.loss_fn = lm_loss
        self._grad_bytes = 0
        self._activation_bytes: int | None = None  # measured on the first step (``_recording``)

    def _build_parts(self, model: TransformerPipeline) -> list[nn.Module]:
        return [model.build_stage(0, 1)]

    @property
    def model(self) -> nn.Module:
        return self.parts[0]

    @property
    def model_parts(self) -> list[nn.Module]:
        return self.parts

    # ---- forward and backward -------------------------------------------------------------
    def forward_backward(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        """Accumulate gradients over this rank's micro-batches; return the global mean loss."""
        for part in self.parts:
            part.train()
        tokens, labels = self._local_batch(tokens, labels)
        with self._loss_context():
            total = self._run_microbatches(tokens, labels)
        self._grad_bytes = tensor_bytes(p.grad for p in self._params())
        return self._global_mean(total)

    def _local_batch(self, tokens, labels):
        return tokens.to(self.device), labels.to(self.device)

    def _loss_context(self):
        return contextlib.nullcontext()

    def _autocast(self):
        return autocast(self.layout, self.device) if uses_autocast(self.layout) else contextlib.nullcontext()

    def _run_microbatches(self, tokens, labels) -> torch.Tensor:
        model, mb = self.parts[0], self.layout.micro_batch
        n = tokens.shape[0] // mb
        total = torch.zeros((), device=self.device)
        counter = ActivationCounter(self.parts)
        for i, (x, y) in enumerate(zip(tokens.split(mb), labels.split(mb))):
            with set_gradient_sync(model, self.layout, sync=i == n - 1):
                with self._recording(counter) if i == 0 else contextlib.nullcontext(), self._autocast():
                    loss = self.loss_fn(model(x), y) / n
                (loss * self.scaler.scale).backward()
            total += _local(loss.detach())
        if self._activation_bytes is None:
            self._activation_bytes = counter.total
        return total

    def _recording(self, counter: ActivationCounter):
        """Saved-tensor hooks cost a Python call per saved tensor (10x a tiny model's step), and
        activations have the same shapes every step: they are measured on the first step only."""
        return counter.record() if self._activation_bytes is None else contextlib.nullcontext()

    def _global_mean(self, loss: torch.Tensor) -> float:
        return float(loss)

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        """Global mean loss of a batch (this dp rank's slice) without touching gradients."""
        for part in self.parts:
            part.eval()
        tokens, labels = self._local_batch(tokens, labels)
        with self._loss_context(), self._autocast():
            loss = _local(self._eval(tokens, labels))
        for part in self.parts:
            reshard(part)
        return self._global_mean(loss)

    def _eval(self, tokens, labels) -> torch.Tensor:
        return self.loss_fn(self.parts[0](tokens), labels)

    # ---- optimizer step ------------------------------------------------------------------
    def _params(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    def _norm_terms(self):
        """(gradient, number of ranks holding the same values) for each gradient counted."""
        return [(p.grad, 1) for p in self._params() if p.grad is not None]

    def _all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        return t

    def _sync_grads(self) -> None:
        """Reductions the data-parallel wrappers do not do (tied embeddings across stages)."""

    def grad_norm(self) -> float:
        """Global L2 norm of all gradients, each element counted once across all ranks."""
        terms = self._norm_terms()
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        if terms:  # one fused kernel for the per-tensor norms; their squares summed in float64
            norms = torch.stack(torch._foreach_norm([_local(g) for g, _ in terms])).double()
            copies = torch.tensor([c for _, c in terms], dtype=torch.float64, device=self.device)
            sq = (norms.pow(2) / copies).sum()
        return math.sqrt(float(self._all_reduce(sq)))

    def step(self, lr: float, max_norm: float) -> float:
        """Set lr, unscale, clip to ``max_norm`` (0: no clipping), step, zero grads; return grad norm.
        Under fp16 a non-finite norm skips the step (on every rank) and halves the loss scale."""
        self._sync_grads()
        grads = [_local(p.grad) for p in self._params() if p.grad is not None]
        if self.scaler.enabled:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        norm = self.grad_norm()
        if self.scaler.update(norm):
            coef = max_norm / (norm + 1e-6) if max_norm > 0 else 1.0
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
            for opt in self.optimizers:
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return norm

    # ---- coordination, checkpoints, memory ------------------------------------------------
    def any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank (all-reduce MAX)."""
        return bool(self._all_reduce(torch.tensor(int(flag), device=self.device), dist.ReduceOp.MAX))

    def barrier(self) -> None:
        """Wait for every rank."""

    def _tied_copy(self, part: nn.Module) -> bool:
        """A pipeline stage holding a tied LM head without the embedding: its optimizer state is
        saved under the embedding's name, the one the unsplit model uses."""
        inner = unwrap(part)
        return self.model_cfg.tie_embeddings and inner.tok_emb is None and inner.lm_head is not None

    @staticmethod
    def _rename(optim_sd: dict, old: str, new: str) -> dict:
        return {k.replace(f".{old}.", f".{new}.", 1) if k.split(".", 1)[1].startswith(old + ".") else k: v
                for k, v in optim_sd.items()}

    def state_dict(self) -> dict:
        model, optim = {}, {}
        for part, opt in zip(self.parts, self.optimizers):
            model.update(get_model_state_dict(part))
            part_optim = get_optimizer_state_dict(part, opt, options=OPTIM_OPTIONS)
            if self._tied_copy(part):
                part_optim = self._rename(part_optim, "lm_head.weight", "tok_emb.weight")
            optim.update(part_optim)
        return {"model": model, "optim": optim, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for part, opt in zip(self.parts, self.optimizers):
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
            optim = state["optim"]
            if self._tied_copy(part):
                optim = self._rename(optim, "tok_emb.weight", "lm_head.weight")
            set_optimizer_state_dict(part, opt, optim, options=OPTIM_OPTIONS)
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def memory_report(self) -> dict:
        """This rank's bytes: parameters, gradients (after the last ``forward_backward``),
        optimizer state on the device, activations saved per micro-batch (+ peak device memory on
        GPU, + ``host_optimizer_bytes`` of an offloaded optimizer: states and its copies of the
        parameter and gradient shards)."""
        on_device = [opt for opt in self.optimizers if not isinstance(opt, OffloadedOptimizer)]
        report = {"param_bytes": tensor_bytes(self._params()), "grad_bytes": self._grad_bytes,
                  "optimizer_bytes": tensor_bytes(t for opt in on_device for t in optimizer_tensors(opt)),
                  "activation_bytes": self._activation_bytes or 0}
        if len(on_device) < len(self.optimizers):
            report["host_optimizer_bytes"] = sum(opt.host_bytes() for opt in self.optimizers
                                                 if isinstance(opt, OffloadedOptimizer))
        if self.device.type == "cuda":
            report["peak_device_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return report


class DistributedEngine(Engine):
    """Any layout over the current process group: ``mesh`` -> tensor/sequence parallel ->
    context parallel -> data parallel (DDP / FSDP2) per model part, parts from ``Pipeline``."""

    def __init__(self, model_cfg: ModelConfig, layout: ParallelLayout, optim_cfg: OptimizerConfig,
                 global_batch: int, seed: int, device: torch.device):
        from luban.parallel.launch import init_distributed
        from luban.parallel.mesh import build_mesh, coordinate
        from luban.parallel.tensor_parallel import vocab_parallel_loss

        init_distributed(device)
        self.mesh = mesh = build_mesh(layout, device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank = coordinate(mesh, "dp_replicate") * layout.dp_shard + coordinate(mesh, "dp_shard")
        self.dp_size = layout.dp
        self.pp_rank, self.cp_rank, self.tp_rank = (coordinate(mesh, d) for d in ("pp", "cp", "tp"))
        self.layout = layout  # _prepare needs it during super().__init__
        super().__init__(model_cfg, layout, optim_cfg, global_batch, seed, device)
        if layout.tp > 1:
            self.loss_fn = vocab_parallel_loss(mesh["tp"], model_cfg.vocab)
        self._pipeline_loss = self._scaled_loss  # one object: the pipeline caches a schedule per loss fn
        self._tied = self._tied_embeddings()

    def _build_parts(self, model: TransformerPipeline) -> list[nn.Module]:
        if self.layout.pp == 1:
            return [self._prepare(model.build_stage(0, 1), 0)]
        n_micro = self.layout.num_microbatches(self.global_batch)
        self.pipeline = Pipeline(model, self.mesh["pp"], self.layout.schedule, self.layout.virtual_stages, n_micro,
                                 self.device, prepare=self._prepare)
        return self.pipeline.parts

    def _prepare(self, module: nn.Module, stage_id: int) -> nn.Module:
        from luban.parallel.context_parallel import apply_context_parallel, feed_positions
        from luban.parallel.tensor_parallel import apply_tensor_parallel

        layout = self.layout
        if layout.tp > 1:
            apply_tensor_parallel(module, self.mesh["tp"], layout.sp)
        if layout.cp > 1:
            apply_context_parallel(module, self.mesh["cp"])
        seq_factor = layout.cp * (layout.tp if layout.sp and module.tok_emb is None else 1)
        if seq_factor > 1:
            feed_positions(module, layout.cp, self.cp_rank, seq_factor)
        return apply_data_parallel(module, layout, self.mesh, self.device)

    def _tied_embeddings(self) -> list[nn.Parameter]:
        """Tied embedding copies on this rank when the pipeline splits them over stages."""
        from luban.parallel.pipeline import SCHEDULES, tie_group

        if self.layout.pp == 1 or not self.model_cfg.tie_embeddings:
            return []
        inner = [unwrap(p) for p in self.parts]
        tied = [m.tok_emb.weight for m in inner if m.tok_emb is not None]
        tied += [m.lm_head.weight for m in inner if m.lm_head is not None]
        self._tie_group = tie_group(self.mesh["pp"]) if SCHEDULES[self.layout.schedule][1] == "loop" else None
        return tied

    def _sync_grads(self) -> None:
        """Give DTensor gradients their parameter's layout (an embedding's gradient may come
        back replicated), then sum the tied embedding's two gradients (first stage's lookup,
        last stage's head)."""
        for p in self._params():
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        for p in self._tied:  # a copy without a gradient still joins the sum its partner waits in
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [_local(p.grad) for p in self._tied]
        if len(grads) == 2:  # V schedules: both stages on this rank
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif grads:
            dist.all_reduce(grads[0], group=self._tie_group)

    def _local_batch(self, tokens, labels):
        from luban.parallel.context_parallel import shard_sequence

        tokens, labels = tokens.to(self.device), labels.to(self.device)
        if self.layout.cp > 1:
            tokens, labels = (shard_sequence(t, self.layout.cp, self.cp_rank) for t in (tokens, labels))
        return tokens, labels

    def _loss_context(self):
        from luban.parallel.tensor_parallel import loss_parallel

        return loss_parallel() if self.layout.tp > 1 else contextlib.nullcontext()

    def _scaled_loss(self, logits, labels):
        return self.loss_fn(logits, labels) * self.scaler.scale

    def _run_microbatches(self, tokens, labels) -> torch.Tensor:
        if self.layout.pp == 1:
            return super()._run_microbatches(tokens, labels)
        counter = ActivationCounter(self.parts)
        with self._recording(counter), self._autocast():
            loss = self.pipeline.forward_backward(tokens, labels, self._pipeline_loss)
        if self._activation_bytes is None:
            self._activation_bytes = counter.total // self.pipeline.n_microbatches
        return loss / self.scaler.scale

    def _eval(self, tokens, labels) -> torch.Tensor:
        if self.layout.pp == 1:
            return super()._eval(tokens, labels)
        return self.pipeline.evaluate(tokens, labels, self.loss_fn)

    def _global_mean(self, loss: torch.Tensor) -> float:
        """Every dp x cp rank holds the mean of its share (pp and tp ranks agree already)."""
        loss = loss.detach().reshape(()).float().clone()
        dist.all_reduce(loss, group=self.mesh["dp_cp"].get_group())
        return float(loss) / (self.layout.dp * self.layout.cp)

    def _all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t

    def _norm_terms(self):
        stage_ranks = self.world_size // self.layout.pp
        skip = {id(unwrap(part).lm_head.weight) for part in self.parts  # the last stage's tied copy
                if self._tied and unwrap(part).lm_head is not None}
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

    def barrier(self) -> None:
        dist.barrier()


def build_engine(model_cfg: ModelConfig, layout: ParallelLayout, optim_cfg: OptimizerConfig,
                 global_batch: int, seed: int, device: torch.device) -> Engine:
    """The engine for the current process group and layout (single process for world size 1)."""
    from luban.parallel.launch import world_size

    check_layout(layout, model_cfg, global_batch, world_size=world_size())
    if layout.world_size == 1:
        return Engine(model_cfg, layout, optim_cfg, global_batch, seed, device)
    return DistributedEngine(model_cfg, layout, optim_cfg, global_batch, seed, device)
