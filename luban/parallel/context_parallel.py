"""Context parallelism: ring attention (Liu et al. 2023) over load-balanced sequence chunks.

luban's own code, because PyTorch's ``torch.distributed.tensor.experimental.context_parallel``
dispatches to the flash/efficient SDPA kernels, which do not run on CPU (and its API is
still experimental). Everything here is plain autograd over differentiable functional
collectives, so it is exact on any device and needs no hand-written backward.

The sequence is cut into 2·cp chunks; cp rank r holds chunks r and 2cp-1-r, so every rank
has the same share of the causal mask's work (the "zig-zag" balance of Megatron-LM's CP and
Llama 3). Each attention layer computes its queries against its own key/value block, then
passes the K/V block round the ring cp-1 times (``all_to_all_single_autograd`` with a single
peer: the backward sends gradients the other way). Partial results are merged exactly with
the online-softmax rule: out = Σ_j exp(lse_j - lse)·out_j, lse = logsumexp_j lse_j.

This composes with the split-backward pipeline schedules (zero-bubble, dualpipev), which
run ``torch.autograd.grad`` towards the stage inputs first (dI) and from the saved
"intermediates" to the weights later (dW): K and V are functions of the stage input, so
every ring shift's backward (the all-to-all in the other direction) lies on the dI path and
runs once, in the same order on every cp rank; the dW pass starts where the parameters meet
the input path (the projections' matmuls, the norms' products) and reaches no collective.
(The first stage's input, tokens, has no gradient: it skips dI and runs one full backward in
its dW slot, identically on every cp rank.) Data parallelism over the cp ranks must then be
FSDP2 with zero 1 or 2 (see ``ParallelLayout.check_keys``), as for dp.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from luban.model.transformer import Transformer

MASKED = -1e30  # finite "minus infinity": fully masked rows get weight exp(MASKED - lse) = 0, no NaN


def chunk_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of the tokens cp rank ``rank`` holds (chunks r and 2cp-1-r)."""
    chunk = seq_len // (2 * cp)
    idx = torch.arange(seq_len, device=device).view(2 * cp, chunk)
    return torch.cat([idx[rank], idx[2 * cp - 1 - rank]])


def shard_sequence(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This rank's load-balanced share of [b, s] tokens or labels."""
    return x[:, chunk_positions(x.shape[1], cp, rank, x.device)]


def _ring_shift(x: torch.Tensor, mesh: DeviceMesh, rank: int, cp: int) -> torch.Tensor:
    """Send ``x`` to rank+1, receive rank-1's (differentiable)."""
    n = x.numel()
    send = [n if r == (rank + 1) % cp else 0 for r in range(cp)]
    recv = [n if r == (rank - 1) % cp else 0 for r in range(cp)]
    out = funcol.all_to_all_single_autograd(x.reshape(-1), recv, send, mesh)
    return funcol.wait_tensor(out).view_as(x) if isinstance(out, funcol.AsyncCollectiveTensor) else out.view_as(x)


def _block(q, k, v, mask, scale):
    """Attention of q against one K/V block: (output, log-sum-exp), in fp32 (autocast off: under
    fp16 autocast the scores would be half precision and ``MASKED`` would not fit)."""
    with torch.autocast(q.device.type, enabled=False):
        scores = (q @ k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask, MASKED)
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        return torch.exp(scores - lse) @ v, lse


class RingAttention:
    """Drop-in ``Attention.attention_fn`` for q/k/v [b, heads, s/cp, d] of this rank's chunks."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh, self.cp, self.rank = mesh, mesh.size(), mesh.get_local_rank()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float = 0.0) -> torch.Tensor:
        if dropout:
            raise NotImplementedError("attention dropout is not supported under context parallel")
        if k.shape[1] != q.shape[1]:  # grouped-query attention
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        dtype, seq = q.dtype, q.shape[2] * self.cp
        q, kv = q.float(), torch.stack([k.float(), v.float()])
        q_pos = chunk_positions(seq, self.cp, self.rank, q.device)
        out = lse = None
        for step in range(self.cp):
            src = (self.rank - step) % self.cp
            mask = q_pos[:, None] >= chunk_positions(seq, self.cp, src, q.device)[None, :]
            o, l = _block(q, kv[0], kv[1], mask, q.shape[-1] ** -0.5)
            if out is None:
                out, lse = o, l
            else:
                new = torch.logaddexp(lse, l)
                out, lse = out * torch.exp(lse - new) + o * torch.exp(l - new), new
            if step < self.cp - 1:
                kv = _ring_shift(kv, self.mesh, self.rank, self.cp)
        return out.to(dtype)


def apply_context_parallel(model: Transformer, cp_mesh: DeviceMesh) -> None:
    """Swap every block's attention core for ring attention."""
    ring = RingAttention(cp_mesh)
    for block in model.layers.values():
        block.attn.attention_fn = ring


def feed_positions(model: Transformer, cp: int, cp_rank: int, seq_factor: int) -> None:
    """Make ``model`` (a stage) use this rank's global token positions: its input holds
    s / ``seq_factor`` tokens (cp chunks, and tp shards for a sequence-parallel stage input).
    A forward pre-hook, so pipeline stages need no extra input; it passes the whole sequence's
    length as ``span``, so the rope table covers that sequence, not every ``seq_len`` position."""
    def add_positions(_module, args, kwargs):
        if kwargs.get("positions") is None and (len(args) < 2 or args[1] is None):
            x = args[0]
            seq = x.shape[1] * seq_factor
            kwargs = {**kwargs, "positions": chunk_positions(seq, cp, cp_rank, x.device), "span": seq}
        return args[:1], kwargs

    model.register_forward_pre_hook(add_positions, with_kwargs=True)
