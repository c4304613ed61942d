"""The optimizer factory: AdamW (weight decay on matrices only) or SGD over one model part's
parameters, on the device or offloaded to the host (``luban.parallel.offload``).

The learning rate is 0 here: the trainer sets it every step (``Engine.step``). ``init_state``: the
state of an optimizer that has not stepped yet, for its checkpoint."""

from __future__ import annotations

from collections.abc import Callable
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


@torch.no_grad()
def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has not stepped yet the state its first step starts from (AdamW: step
    0, zero moments; SGD: a zero momentum buffer), before a state dict is built: a checkpoint needs
    the keys, and torch's ``get_optimizer_state_dict`` otherwise makes them with a step on zero
    gradients at lr 0 that counts (AdamW's step 1: its bias correction one step ahead from then on)
    and decays (SGD's momentum buffer = weight_decay * weight). An fp16 run whose first steps all
    overflowed and that saved then (a suspension, ``checkpoint_every``) trained on from that state,
    saving or not: it, and the run resumed from it, parted from the same run straight through."""
    if len(optimizer.state) or any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        return
    kept = [(g["lr"], g.get("weight_decay")) for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        if "weight_decay" in group:
            group["weight_decay"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p) if p.requires_grad else None
    optimizer.step()
    for group, (lr, decay) in zip(optimizer.param_groups, kept):
        group["lr"] = lr
        if decay is not None:
            group["weight_decay"] = decay
    optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0


def load_keeping_hyperparameters(optimizer: torch.optim.Optimizer, load: Callable[[], None]) -> None:
    """Run ``load()`` (a state dict into ``optimizer``), then give every group back its own
    hyperparameters: the checkpoint brings the states, the config the settings. torch's
    ``load_state_dict`` takes the checkpoint's (betas, eps, weight decay, momentum, and ``fused`` /
    ``foreach``): a resume with a changed ``train.beta1`` trained on with the old one while saying it
    applied the new, and a checkpoint of a fused AdamW (plain tensors) resumed under tensor parallel
    (DTensor parameters, which take ``foreach``) ran the fused kernel on DTensors: a crash."""
    own = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    load()
    for group, kept in zip(optimizer.param_groups, own):
        group.update(kept)


def _optimizer(groups: list[dict], cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    """The torch optimizer: AdamW with the fused kernel where the device has one (foreach for
    DTensor parameters), or SGD."""
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=0.0, momentum=cfg.momentum)
    fused = device.type in ("cuda", "cpu") and not any(isinstance(p, DTensor) for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=0.0, betas=cfg.betas, eps=cfg.eps, fused=fused)
