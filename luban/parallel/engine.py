"""``Engine``: what the trainer drives, whatever the layout.

The trainer only ever calls this API; everything about how the model is split across ranks
(and how gradients, optimizer state and activations move) hides behind it:

* ``forward_backward(tokens, labels)`` runs all micro-batches of this rank's share of the
  global batch, accumulates gradients and returns the global mean loss;
* ``step(lr, max_norm)`` clips by global gradient norm, applies the optimizer, zeroes grads;
* ``state_dict()`` / ``load_state_dict()`` use global parameter names (DCP-ready), so a
  checkpoint saved under one layout loads under another;
* ``memory_report()`` gives this rank's exact bytes of parameters, gradients, optimizer state.

This module builds the single-process engine; ``luban.parallel`` extends it to meshes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from luban.model.config import ModelConfig
from luban.model.transformer import build_model, lm_loss
from luban.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"  # adamw | sgd
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    momentum: float = 0.0


def build_optimizer(params, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (fused kernel where the device has one) or SGD; lr is set every step by the trainer."""
    params = list(params)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=0.0, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=0.0, betas=cfg.betas, eps=cfg.eps, fused=fused)


def autocast(layout: ParallelLayout, device: torch.device):
    """bf16/fp16 autocast for forward (weights and optimizer stay fp32: mixed precision)."""
    if layout.precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if layout.precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages behind the given tensors (shared storages counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class Engine:
    """Single-process engine: gradient accumulation over micro-batches, AMP, clipping."""

    rank = 0
    world_size = 1
    dp_rank = 0
    dp_size = 1

    def __init__(self, model_cfg: ModelConfig, layout: ParallelLayout, optim_cfg: OptimizerConfig,
                 global_batch: int, seed: int, device: torch.device):
        self.model_cfg, self.layout, self.device = model_cfg, layout, device
        self.global_batch = global_batch
        self.model = build_model(model_cfg, seed=seed, recompute=layout.recompute).to(device)
        self.optimizer = build_optimizer(self.model.parameters(), optim_cfg, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=layout.precision == "fp16")

    @property
    def model_parts(self) -> list[nn.Module]:
        return [self.model]

    def _micro_batches(self, tokens, labels):
        mb = self.layout.micro_batch
        return zip(tokens.split(mb), labels.split(mb))

    def forward_backward(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        """Accumulate gradients over this rank's micro-batches; return the mean loss."""
        self.model.train()
        tokens, labels = tokens.to(self.device), labels.to(self.device)
        n = tokens.shape[0] // self.layout.micro_batch
        total = torch.zeros((), device=self.device)
        for x, y in self._micro_batches(tokens, labels):
            with autocast(self.layout, self.device):
                loss = lm_loss(self.model(x), y) / n
            self.scaler.scale(loss).backward()
            total += loss.detach()
        return float(total)

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        self.model.eval()
        with autocast(self.layout, self.device):
            return float(lm_loss(self.model(tokens.to(self.device)), labels.to(self.device)))

    def step(self, lr: float, max_norm: float) -> float:
        """Set lr, unscale, clip to ``max_norm`` (0: no clipping), step, zero grads; return grad norm."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def memory_report(self) -> dict:
        params = list(self.model.parameters())
        optim = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.ndim > 0]
        return {"param_bytes": tensor_bytes(params), "grad_bytes": tensor_bytes(p.grad for p in params),
                "optimizer_bytes": tensor_bytes(optim)}


def build_engine(model_cfg: ModelConfig, layout: ParallelLayout, optim_cfg: OptimizerConfig,
                 global_batch: int, seed: int, device: torch.device) -> Engine:
    """The engine for the current process group and layout (single process for world size 1)."""
    if layout.world_size != 1:
        raise NotImplementedError("multi-rank layouts are built by luban.parallel (in progress)")
    return Engine(model_cfg, layout, optim_cfg, global_batch, seed, device)
