"""Activation offload (``[parallel] offload = "activations"``): seed 002's "swap activations to
host memory in the forward pass, back in the backward pass".

Every tensor autograd saves for backward, parameters excepted, is copied to host memory when it
is saved (the pack hook of ``torch.autograd.graph.saved_tensors_hooks``) and copied back to the
device when the backward pass needs it (the unpack hook). The device then holds no saved
activation between a layer's forward and its backward: only the tensors being computed, and each
node's saved tensors while its backward runs. The copies are exact, so a run with the offload
matches one without bit for bit (``tests/parallel/test_activation_offload.py``).

luban's own rather than ``torch.autograd.graph.save_on_cpu``: that one copies parameters too
(every weight once more per micro-batch), keeps a tensor already on the CPU as it is (on a CPU
device nothing moves, so nothing could be measured or tested here), copies each saved view of one
activation on its own, and does not keep strides (a transposed view comes back contiguous, and a
GEMM on it may round differently). Here: parameters are recognised by storage
(``ActivationCounter.is_activation``, the rule the memory accounting uses); each storage is copied
once per version and its views are rebuilt on it with their own offset and strides; DTensors
(tensor parallel) are offloaded as their local shard; host buffers are pinned where a CUDA device
exists; and the bytes moved are counted on the micro-batches being measured. Composes with every layout: the hooks wrap each micro-batch's
forward (pipeline schedules: the whole schedule), whatever parallelism the modules carry.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from luban.parallel.memory import ActivationCounter


class ActivationOffload:
    """Saved-tensor hooks that move activations to host memory; ``hooks(measure)`` also measures."""

    def __init__(self, modules, device: torch.device):
        self.rule = ActivationCounter(modules)  # the parameter test, kept warm across steps
        self.pin = device.type == "cuda"
        self._measure: ActivationCounter | None = None  # set while a measured micro-batch runs
        self.host_bytes = 0  # bytes of the host copies made while measuring (one per storage and version)
        self._copies: dict = {}  # (storage address, version) -> (weak ref to it, its host copy)

    def _host_copy(self, t: torch.Tensor) -> torch.UntypedStorage:
        """The whole storage behind ``t``, once per storage and version: the views autograd saves
        of one activation (a fused QKV's q, k, v; a transposed input) share one host copy, as they
        share one device storage (which is what the memory accounting and the planner count)."""
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t._version)  # views share the version counter of their base
        hit = self._copies.get(key)
        if hit is None or hit[0].expired():  # a freed storage's address may be reused
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=self.pin)
            host.copy_(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage), non_blocking=self.pin)
            hit = self._copies[key] = (StorageWeakRef(storage), host.untyped_storage())
            if self._measure is not None:
                self.host_bytes += storage.nbytes()
        return hit[1]

    def _pack(self, t: torch.Tensor):
        if not self.rule.is_activation(t):
            return t  # a parameter (or a view of one): it stays where it is
        local = t._local_tensor if isinstance(t, DTensor) else t
        if isinstance(local, AsyncCollectiveTensor):  # sequence parallel's collective result: wait for it
            local = local.wait()
        if type(local) is not torch.Tensor:  # another wrapper subclass: left on the device
            if self._measure is not None:
                self._measure.count(t)
            return t
        view = (local.dtype, local.size(), local.stride(), local.storage_offset(), local.device)
        spec = (t._spec, t.requires_grad) if isinstance(t, DTensor) else None
        return self._host_copy(local), view, spec

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, (dtype, size, stride, offset, device), spec = packed
        if device.type != "cpu":  # the whole storage back, then the same view of it
            host = torch.empty(0, dtype=torch.uint8).set_(host).to(device, non_blocking=self.pin).untyped_storage()
        local = torch.empty(0, dtype=dtype, device=device).set_(host, offset, size, stride)
        return local if spec is None else DTensor(local, spec[0], requires_grad=spec[1])

    @contextlib.contextmanager
    def hooks(self, measure: ActivationCounter | None = None):
        """Offload inside; with ``measure``, count what stays on the device into it and the bytes
        copied to the host into ``host_bytes`` (reset by the caller before a measured step)."""
        self._measure = measure
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            self._measure = None
            self._copies.clear()
