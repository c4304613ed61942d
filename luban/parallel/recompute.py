"""Activation recompute: ``[parallel] recompute = "none" | "selective" | "full" | "full:K"``.

* ``full`` checkpoints whole blocks (``torch.utils.checkpoint``, non-reentrant): a block keeps
  only its input and runs its forward again in backward; ``full:K`` does so for every K-th
  layer (by global index, so pipeline stages agree).
* ``selective`` is op-level selective activation checkpointing (SAC,
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts``; torchtitan's
  ``selective_ac_option = "op"``): each block is checkpointed, but the outputs of the
  operators that are expensive to run again are saved — every GEMM (``aten.mm``/``addmm``:
  the projections and the experts), the fused attention kernels (output and log-sum-exp;
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
policy reports each one to ``observers`` (they stay on the device under activation offload).
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts, noop_context_fn

try:  # SAC's two dispatch modes (what ``create_selective_checkpoint_contexts`` returns), built here
    # on a cache whose entries a second backward pass may read again (``_Entries``); private names
    # of torch.utils.checkpoint, present in torch 2.11-2.13
    from torch.utils.checkpoint import _CONSUMED, _CachedTorchDispatchMode, _CachingTorchDispatchMode
except ImportError:  # a torch without them: PyTorch's own contexts (a split backward then fails loudly)
    _CONSUMED = None

from luban.parallel.layout import parse_recompute


def _ops(namespace, *names) -> set:
    """The default overloads of the named operators this torch build has."""
    return {getattr(namespace, n).default for n in names if hasattr(namespace, n)}


# what selective recompute saves (torchtitan ``_op_sac_save_list`` @ 2025, minus its "every
# other mm" thinning: luban saves every GEMM output and recomputes only elementwise work)
SAVED_OPS = frozenset(
    _ops(torch.ops.aten, "mm", "addmm",
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
    if op in SAVED_OPS:
        if observers and ctx.op_output is not None:
            _report(ctx.op_output)
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class _Entries(dict):
    """One operator's cached outputs that survive being read. PyTorch's SAC marks an entry
    consumed when the recompute reads it and refuses a second read ("backward an extra time"),
    but the split-backward pipeline schedules (zero-bubble, dualpipev) run two backward passes
    over one forward — inputs first, then weights — and each recomputes the block. The entries
    are freed with the checkpoint's frame instead: when autograd frees the block's graph."""

    def __setitem__(self, key, value):
        if value is not _CONSUMED:
            super().__setitem__(key, value)


def selective_context():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` under selective recompute:
    ``create_selective_checkpoint_contexts(save_policy)`` with entries kept for a second pass."""
    if _CONSUMED is None:
        return create_selective_checkpoint_contexts(save_policy)
    storage = collections.defaultdict(_Entries)
    return _CachingTorchDispatchMode(save_policy, storage), _CachedTorchDispatchMode(save_policy, storage)


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
