"""The optimizer factory: AdamW (weight decay on matrices only) or SGD over one model part's
parameters, on the device or offloaded to the host (``luban.parallel.offload``).

The learning rate is 0 here: the trainer sets it every step (``Engine.step``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from luban.parallel.offload import OffloadedOptimizer


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
