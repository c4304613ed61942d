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
exists; and the bytes moved are counted on the micro-batches being measured. On a CUDA device
the copies overlap the compute: device-to-host on a side stream as tensors are saved, and in
backward the next ``PREFETCH`` storages are copied back ahead of use (``ActivationOffload``). Composes with every layout: the hooks wrap each micro-batch's
forward (pipeline schedules: the whole schedule), whatever parallelism the modules carry.
Selective recompute's saved operator outputs (GEMMs, attention, collectives) are kept in its own
cache, not behind these hooks: they stay on the device and are counted there.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from luban.parallel.memory import ActivationCounter
from luban.parallel.recompute import observe_saved


# saved storages the backward pass brings back ahead of use: it unpacks roughly in reverse order
# of packing, so the next few earlier ones are copied in while it computes (one transformer
# layer saves ~10-20 storages: this covers the next layer's)
PREFETCH = 16


class _Saved:
    """One saved storage's host copy: ``order`` the storages saved in one forward (this one at
    ``index``; the list outlives the hooks, which wrap the forward only, and holds weak references:
    an entry dies, host and device copies with it, when autograd drops what it saved), ``saved``
    the event after its device-to-host copy, ``device``/``fetched`` its copy back ahead of use and
    the event after it."""

    __slots__ = ("host", "order", "index", "saved", "device", "fetched", "__weakref__")

    def __init__(self, host: torch.UntypedStorage, order: list, saved):
        self.host, self.order, self.index, self.saved = host, order, len(order), saved
        self.device = self.fetched = None
        order.append(weakref.ref(self))


class ActivationOffload:
    """Saved-tensor hooks that move activations to host memory; ``hooks(measure)`` also measures.

    On a CUDA device the copies run on a side stream beside the compute: device-to-host when a
    tensor is saved (the side stream waits for the compute stream up to that point, and
    ``record_stream`` keeps the allocator from reusing the device memory until the copy is
    done), host-to-device for the ``PREFETCH`` storages the backward pass will need next; the
    compute stream waits only for the one it needs now. On a CPU the copies are synchronous."""

    def __init__(self, modules, device: torch.device, prefetch: int = PREFETCH):
        self.rule = ActivationCounter(modules)  # the parameter test, kept warm across steps
        self.pin = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.prefetch = prefetch
        self._measure: ActivationCounter | None = None  # set while a measured micro-batch runs
        self.host_bytes = 0  # bytes of the host copies made while measuring (one per storage and version)
        self._copies: dict = {}  # (storage address, version) -> (weak ref to it, its _Saved)
        self._order: list = []  # this forward's entries (weak references), in the order they were saved

    def _host_copy(self, t: torch.Tensor) -> _Saved:
        """The whole storage behind ``t``, once per storage and version: the views autograd saves
        of one activation (a fused QKV's q, k, v; a transposed input) share one host copy, as they
        share one device storage (which is what the memory accounting and the planner count)."""
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t._version)  # views share the version counter of their base
        hit = self._copies.get(key)
        if hit is None or hit[0].expired():  # a freed storage's address may be reused
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=self.pin)
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            saved = None
            if self.stream is not None and t.device.type == "cuda":
                self.stream.wait_stream(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(self.stream):
                    host.copy_(src, non_blocking=True)
                src.record_stream(self.stream)
                saved = torch.cuda.Event()
                saved.record(self.stream)
            else:
                host.copy_(src)
            entry = _Saved(host.untyped_storage(), self._order, saved)
            hit = self._copies[key] = (StorageWeakRef(storage), entry)
            if self._measure is not None:
                self.host_bytes += storage.nbytes()
        return hit[1]

    def _start_fetch(self, entry: _Saved, device: torch.device) -> None:
        """Copy ``entry`` back to ``device`` on the side stream, after its host copy is done."""
        with torch.cuda.stream(self.stream):
            if entry.saved is not None:
                self.stream.wait_event(entry.saved)
            buf = torch.empty(0, dtype=torch.uint8).set_(entry.host).to(device, non_blocking=True)
            entry.fetched = torch.cuda.Event()
            entry.fetched.record(self.stream)
        entry.device = buf

    def _fetch(self, entry: _Saved, device: torch.device) -> torch.UntypedStorage:
        """``entry``'s storage on ``device``: started ahead (with the ``prefetch`` saved before
        it, which the backward pass needs next), waited for by the compute stream only now."""
        if self.stream is None:  # no CUDA stream (another accelerator): a plain blocking copy
            return torch.empty(0, dtype=torch.uint8).set_(entry.host).to(device).untyped_storage()
        if entry.device is None:
            self._start_fetch(entry, device)
        for ref in reversed(entry.order[max(0, entry.index - self.prefetch):entry.index]):
            ahead = ref()
            if ahead is not None and ahead.fetched is None:  # alive and never copied back yet
                self._start_fetch(ahead, device)
        current = torch.cuda.current_stream(device)
        current.wait_event(entry.fetched)
        buf, entry.device = entry.device, None  # a second view of it (rare) fetches it again
        buf.record_stream(current)  # allocated on the side stream, used (and freed) on this one
        return buf.untyped_storage()

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
        entry, (dtype, size, stride, offset, device), spec = packed
        storage = entry.host if device.type == "cpu" else self._fetch(entry, device)  # then the same view of it
        local = torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)
        return local if spec is None else DTensor(local, spec[0], requires_grad=spec[1])

    @contextlib.contextmanager
    def hooks(self, measure: ActivationCounter | None = None):
        """Offload inside; with ``measure``, count what stays on the device into it and the bytes
        copied to the host into ``host_bytes`` (reset by the caller before a measured step)."""
        self._measure = measure
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), \
                    (observe_saved(measure.count) if measure is not None else contextlib.nullcontext()):
                yield self
        finally:
            self._measure = None
            self._copies.clear()
            self._order = []  # the next forward's (the entries keep theirs for the backward)
