"""Optimizer offload (ZeRO-Offload, Ren et al. 2021, Sec. 4): optimizer states and the update on
the host, parameters and gradients on the device.

FSDP2's ``CPUOffloadPolicy`` moves parameters, gradients and optimizer state together (luban's
``offload = "params"``); PyTorch has no optimizer-only offload, so this is luban's own.
``OffloadedOptimizer`` wraps a host optimizer (AdamW or SGD, built by ``make``) over host copies
of this rank's parameter shards. Each step copies the local gradient shards to the host (pinned
memory, asynchronously, when an accelerator exists), runs the host optimizer, and copies the
updated shards back: 2 transfers of the rank's shard per step, as in ZeRO-Offload's Fig. 2.
Optimizer state stays on the host between steps. The host copies are taken from the device
before the first step, after ``load_state_dict`` (DCP loads the model first), and whenever a
local shard was written or replaced from outside since the last step.

Towards checkpoints it behaves like an optimizer over the device parameters: its state dict
holds the same entries, with the states of a DTensor parameter re-wrapped as DTensors with that
parameter's mesh and placements, so DCP saves global shapes and a checkpoint written with
offload loads without it and the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from luban.parallel.memory import local as _local
from luban.parallel.memory import optimizer_tensors, tensor_bytes


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    """Changes when ``t`` is written in place (its version) or replaced (FSDP2 swaps in a new
    local shard when a checkpoint is loaded)."""
    return t.data_ptr(), t._version


class OffloadedOptimizer(torch.optim.Optimizer):
    """An optimizer over device parameters whose states and update live on the host."""

    def __init__(self, param_groups: list[dict], make: Callable[[list[dict]], torch.optim.Optimizer]):
        pin = torch.cuda.is_available()
        self._params: list[torch.Tensor] = [p for g in param_groups for p in g["params"]]
        self._host = [self._host_copy(_local(p), pin) for p in self._params]
        self._grads = [torch.empty(h.shape, pin_memory=pin) for h in self._host]
        self._stamps = [None] * len(self._params)  # (storage address, version) of each local shard at the last sync
        host_groups, i = [], 0
        for g in param_groups:
            n = len(g["params"])
            host_groups.append({**g, "params": self._host[i:i + n]})
            i += n
        self.inner = make(host_groups)  # fills in every hyperparameter of every group
        device_groups = [{**inner, "params": list(g["params"])} for g, inner in zip(param_groups, self.inner.param_groups)]
        super().__init__(device_groups, defaults={})
        self.state = _StateView(self)  # keyed by device parameter, as checkpoint code expects

    @staticmethod
    def _host_copy(local: torch.Tensor, pin: bool) -> torch.Tensor:
        host = torch.empty(local.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
        return host.copy_(local.detach())

    def _sync_groups(self, source: list[dict], target: list[dict]) -> None:
        for src, dst in zip(source, target):
            dst.update({k: v for k, v in src.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("OffloadedOptimizer.step takes no closure")
        self._sync_groups(self.param_groups, self.inner.param_groups)
        for i, (p, host, grad) in enumerate(zip(self._params, self._host, self._grads)):
            local = _local(p)
            if _stamp(local) != self._stamps[i]:
                host.copy_(local)
            if p.grad is None:
                host.grad = None
            else:
                host.grad = grad.copy_(_local(p.grad), non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the gradients have arrived on the host
        self.inner.step()
        for i, (p, host) in enumerate(zip(self._params, self._host)):
            local = _local(p)
            if host.grad is not None:
                local.copy_(host, non_blocking=True)
            self._stamps[i] = _stamp(local)

    def state_dict(self) -> dict:
        self._sync_groups(self.param_groups, self.inner.param_groups)  # the hyperparameters as set now
        sd = self.inner.state_dict()
        sd["state"] = {i: {k: self._to_global(v, self._params[i]) for k, v in st.items()}
                       for i, st in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state = {i: {k: _local(v) if isinstance(v, DTensor) else v for k, v in st.items()}
                 for i, st in state_dict["state"].items()}
        self.inner.load_state_dict({**state_dict, "state": state})
        self._sync_groups(self.inner.param_groups, self.param_groups)
        self._stamps = [None] * len(self._params)  # parameters are loaded first: take them as they are now

    @staticmethod
    def _to_global(value, param: torch.Tensor):
        """A state tensor shaped like the parameter's local shard as a DTensor like the parameter."""
        if not isinstance(param, DTensor) or not torch.is_tensor(value) or value.shape != _local(param).shape:
            return value
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())

    def host_bytes(self) -> int:
        """Bytes this optimizer keeps on the host: states, parameter and gradient copies."""
        return tensor_bytes([*self._host, *self._grads, *optimizer_tensors(self.inner)])


class _StateView(Mapping):
    """``optimizer.state`` keyed by the device parameters (the host optimizer keys its copies); a
    parameter without state maps to ``{}``, as in a plain optimizer's ``defaultdict``."""

    def __init__(self, owner: OffloadedOptimizer):
        self.owner = owner

    def _pairs(self) -> list:
        inner = self.owner.inner.state
        return [(p, inner[h]) for p, h in zip(self.owner._params, self.owner._host) if h in inner]

    def __getitem__(self, param):
        return next((s for p, s in self._pairs() if p is param), {})

    def __contains__(self, param):
        return any(p is param for p, _ in self._pairs())

    def __iter__(self):
        return iter([p for p, _ in self._pairs()])

    def __len__(self):
        return len(self._pairs())
