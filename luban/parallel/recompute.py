"""Activation recompute: ``[parallel] recompute = "none" | "selective" | "full" | "full:K"``.

* ``full`` checkpoints whole blocks (``torch.utils.checkpoint``, non-reentrant): a block keeps
  only its input and runs its forward again in backward; ``full:K`` does so for every K-th
  layer (by global index, so pipeline stages agree).
* ``selective`` is op-level selective activation checkpointing (SAC,
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts``; torchtitan's
  ``selective_ac_option = "op"``): each block is checkpointed, but the outputs of the
  operators that are expensive to run again are saved — every GEMM (``aten.mm``/``addmm``:
  the projections and the experts' loop; ``aten._grouped_mm``: the experts as grouped GEMMs,
  ``luban.model.moe.grouped_gemm_ok``), the fused attention kernels (output and log-sum-exp;
  with SDPA's flash/efficient/cuDNN/CPU-flash kernels there is no s x s score tensor to
  save, which is what Korthikanti et al. 2022 Sec. 4.2 recompute) and the functional
  collectives (sequence/expert parallel all-gathers, reduce-scatters, all-to-alls: nothing
  is sent twice). Everything else — norms, rope, activations, residual adds, dropout, the
  autocast casts of inputs and weights, routing's gathers and scatters — is recomputed in
  backward from those saved outputs: cheap elementwise work in exchange for the bytes.
* Under context parallel the attention core is luban's ring attention, whose math-path
  blocks materialise s x s/cp scores through batched matmuls: there ``selective`` keeps
  Korthikanti's scheme and checkpoints the attention core alone (``Attention.recompute_core``).

The saved outputs live in SAC's own cache, not behind saved-tensor hooks, so the memory
accounting (``ActivationCounter``) and the activation offload cannot see them there: the
forward mode (``_Saving``) reports each one to ``observers`` (they stay on the device under
activation offload).

The two dispatch modes are PyTorch's own (``_CachingTorchDispatchMode`` records in forward,
``_CachedTorchDispatchMode`` replays in the recompute; private names of torch.utils.checkpoint,
present in torch 2.11-2.13), subclassed here for two things PyTorch lacks: reporting the saved
outputs (torch 2.11 calls the policy before the operator runs, without its output), and a cache
that a second backward pass may read again (``_Entries``, ``_Queue``).
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils.checkpoint import (CheckpointPolicy, _CachedTorchDispatchMode, _CachingTorchDispatchMode,
                                    noop_context_fn)

try:  # torch 2.13: the cache is keyed by call index, and a read entry is overwritten with this marker
    from torch.utils.checkpoint import _CONSUMED
except ImportError:  # torch 2.11, 2.12: a list per operator, its entries popped in call order
    _CONSUMED = None

from luban.parallel.layout import parse_recompute


def _ops(namespace, *names) -> set:
    """The default overloads of the named operators this torch build has."""
    return {getattr(namespace, n).default for n in names if hasattr(namespace, n)}


# what selective recompute saves (torchtitan ``_op_sac_save_list`` @ 2025, minus its "every
# other mm" thinning: luban saves every GEMM output and recomputes only elementwise work; its MoE experts run
# as ``_grouped_mm`` where the fused kernel exists, a GEMM like the others)
SAVED_OPS = frozenset(
    _ops(torch.ops.aten, "mm", "addmm", "_grouped_mm",
         "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_fused_attention_overrideable")
    | _ops(torch.ops._c10d_functional, "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
           "all_to_all_single"))

# callables given each saved output (a plain tensor, a DTensor or a tuple of them) while a
# forward runs: ``ActivationCounter.record`` and ``ActivationOffload.hooks`` register here
observers: list = []


@contextlib.contextmanager
def observe_saved(callback):
    """Call ``callback(tensor)`` for every tensor selective recompute saves inside."""
    observers.append(callback)
    try:
        yield
    finally:
        observers.remove(callback)


def _report(out) -> None:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        # torch.compile traces with fake (functionalised) tensors: nothing is stored then
        if isinstance(t, torch.Tensor) and not isinstance(t, (FakeTensor, FunctionalTensor)):
            for observe in observers:
                observe(t)


def save_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """SAC policy: save GEMMs, fused attention and collectives; recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _Saving(_CachingTorchDispatchMode):
    """SAC's forward mode, which also hands each saved output to ``observers``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if observers and func in SAVED_OPS:
            _report(out)
        return out


# The split-backward pipeline schedules (zero-bubble, dualpipev) run two backward passes over one
# forward — inputs first, then weights — and each recomputes the block; PyTorch's SAC lets each
# saved output be read once ("backward an extra time"). The two caches below keep them instead,
# freed with the checkpoint's frame: when autograd frees the block's graph.

class _Entries(dict):
    """torch 2.13: one operator's outputs by call index; the marker for "read" is not written."""

    def __setitem__(self, key, value):
        if value is not _CONSUMED:
            super().__setitem__(key, value)


class _Queue(list):
    """torch 2.11, 2.12: one operator's outputs in call order; ``pop(0)`` (how the recompute reads
    them) returns the next one without removing it, and each recompute starts at the first."""

    def __init__(self):
        super().__init__()
        self.read = 0

    def pop(self, index=-1):
        assert index == 0, index
        self.read += 1
        return self[self.read - 1]


class _Replaying(_CachedTorchDispatchMode):
    """SAC's recompute mode; on torch 2.11-2.12 it starts each recompute at the cache's first entries
    (torch 2.13 resets its own call counter on entry)."""

    def __enter__(self):
        for entries in self.storage.values():
            if isinstance(entries, _Queue):
                entries.read = 0
        return super().__enter__()


def selective_context():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` under selective recompute: what
    ``create_selective_checkpoint_contexts(save_policy)`` makes, with the saved outputs reported and
    kept for a second backward pass."""
    storage = collections.defaultdict(_Queue if _CONSUMED is None else _Entries)
    return _Saving(save_policy, storage), _Replaying(save_policy, storage, False)


def apply_recompute(module, recompute: str, ring_attention: bool = False) -> None:
    """Set each block of ``module`` (a ``Transformer`` or a pipeline stage of one) to the
    recompute mode; ``ring_attention``: context parallel's core (selective checkpoints it)."""
    mode, every = parse_recompute(recompute)
    for name, block in module.layers.items():
        sac = mode == "selective" and not ring_attention
        block.recompute = (mode == "full" and int(name) % every == 0) or sac
        block.checkpoint_context = selective_context if sac else noop_context_fn
        block.attn.recompute_core = mode == "selective" and ring_attention


def recomputed_flops_mode(recompute: str, cp: int) -> str:
    """The recompute mode ``luban.model.flops`` should count for this runtime's hardware FLOPs:
    selective recomputes no GEMM and no attention core except under context parallel."""
    return "none" if parse_recompute(recompute)[0] == "selective" and cp == 1 else recompute


__all__ = ["SAVED_OPS", "apply_recompute", "observe_saved", "recomputed_flops_mode", "save_policy",
           "selective_context"]
