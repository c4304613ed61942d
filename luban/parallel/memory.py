"""Exact memory accounting from tensor storages.

Parameters, gradients and optimizer state are summed over the distinct storages behind this
rank's (local shards of) tensors. Activations are what autograd saves for backward: a
``torch.autograd.graph.saved_tensors_hooks`` pack hook sees every saved tensor of a
micro-batch; distinct storages that are not parameters are counted once each (views of one
activation share a storage). With recompute only the checkpoint inputs are saved, so the
measured figure drops accordingly (Korthikanti et al. 2022); selective recompute's saved
operator outputs sit in its own cache and are reported by its policy (``recompute.py``). Counted storages are kept alive
until the recording ends: a pipeline schedule frees a micro-batch's activations in its backward
before a later forward, and the allocator would hand the same addresses out again.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.distributed.tensor import DTensor

from luban.parallel.recompute import observe_saved


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _innermost(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a DTensor or a wrapper subclass (e.g. an async collective result)."""
    while True:
        inner = getattr(t, "_local_tensor", None)
        inner = inner if inner is not None else getattr(t, "elem", None)
        if not isinstance(inner, torch.Tensor):
            return t
        t = inner


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages behind the given tensors (shared storages counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = _innermost(t).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class ActivationCounter:
    """Counts distinct storages saved for backward inside ``record()``, parameters excluded.

    Parameters are looked up live from ``modules`` (FSDP2 registers freshly all-gathered
    parameters during forward, so a set taken beforehand would miss them)."""

    def __init__(self, modules):
        self.modules = list(modules)
        self.storages: dict[int, int] = {}
        self.params: dict[int, weakref.ref] = {}  # storage address -> the parameter holding it
        self.refreshes = 0  # parameter-set rebuilds (tests/parallel: few per micro-batch)
        self._alive: list = []

    def _is_param(self, ptr: int) -> bool:
        """``ptr`` is a parameter's storage now: FSDP2 frees a resharded parameter's storage,
        and a tensor allocated later may get its address (issue #22: the fused loss's saved
        gradients under ZeRO-3 were taken for parameters)."""
        ref = self.params.get(ptr)
        p = ref() if ref is not None else None
        return p is not None and _innermost(p).untyped_storage().data_ptr() == ptr

    def is_activation(self, t: torch.Tensor) -> bool:
        """Not (a view of) a parameter: the one rule for what counts and what is offloaded.

        A tensor whose view root has a ``grad_fn`` is an op's output, never a parameter (those
        are leaves), so only leaf-rooted tensors are looked up; an unknown one refreshes the
        parameter set (FSDP2 gathers parameters into new storages during the step)."""
        inner = _innermost(t)
        root = inner._base if inner._base is not None else inner
        if root.grad_fn is not None:
            return True
        ptr = inner.untyped_storage().data_ptr()
        if self._is_param(ptr):
            return False
        if ptr not in self.storages:
            self.params = {_innermost(p).untyped_storage().data_ptr(): weakref.ref(p)
                           for m in self.modules for p in m.parameters()}
            self.refreshes += 1
        return not self._is_param(ptr)

    def count(self, t: torch.Tensor) -> None:
        storage = _innermost(t).untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        self._alive.append(storage)  # until ``record`` ends: a freed storage's address is reused

    def _pack(self, t: torch.Tensor):
        if self.is_activation(t):
            self.count(t)
        return t

    @contextlib.contextmanager
    def record(self):
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t), observe_saved(self.count):
                yield self
        finally:
            self._alive.clear()

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer):
    return [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.ndim > 0]
