"""The LM head and the cross-entropy loss as one operation: no fp32 copy of the logits.

The plain computation (``lm_loss(lm_head(h), labels)``) materialises the logits ``[b·s, V]``
in the compute dtype, then an fp32 copy of all of them, then log-softmax's output and, in
backward, its gradient: for GPT-2 124M at batch 16 × 1024 that is 3.3 GB of fp32 traffic a
step, and on an H100 it cost ~13 ms of a 63 ms step (issue #22's profile).

Two ways out, one contract (``head_loss(h, weight, labels)`` = ``lm_loss(h @ weightᵀ, labels)``):

* ``chunked_head_loss`` (eager): a ``torch.autograd.Function`` that walks the tokens in chunks
  of ``CHUNK_TOKENS`` rows; each chunk's logits are made in the compute dtype, reduced in fp32
  (log-sum-exp), and their gradient (softmax − one-hot) turned straight into the chunk's input
  gradient and its share of the weight gradient, so backward only scales the two saved
  gradients. No chunk outlives its iteration: peak extra memory is one chunk's logits, and
  the FLOPs are the unfused three GEMMs (no recompute). The approach of Liger-Kernel's
  ``LigerFusedLinearCrossEntropy`` (Hsu et al. 2024, arXiv:2410.10989, Sec. 3.2), written
  here in PyTorch (Liger's Triton kernels need a GPU; this runs on every device).
* under ``[train] compile`` the plain computation is compiled as one graph (``compiled``):
  Inductor fuses the fp32 cast, the log-softmax reduction and the gather into the GEMM's
  consumer, so no fp32 logits tensor exists either.

The weight gradient accumulates in fp32 across chunks (the parameter's dtype), the input
gradient is returned in ``h``'s dtype. Labels are all valid (luban packs documents without
padding), so the mean is over every token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# the GEMMs run on a vocabulary padded to a multiple of this (Megatron-LM's
# --make-vocab-size-divisible-by, default 128): GPT-2's 50,257 rows defeat the aligned
# tensor-core kernels (issue #22: an 8.3 ms pre-Hopper GEMM a step on an H100; 50,304 rows
# ran 6% faster). The parameter keeps its real size (checkpoints, HF, TP unchanged); the
# padded logits are -inf, so the loss and gradients are those of the real vocabulary.
VOCAB_MULTIPLE = 128

# rows of logits per chunk: 4096 × 50,304 × 4 bytes = 0.8 GB of fp32 at most in flight (GPT-2);
# Liger's default chunking aims at the same order (a chunk ~ the hidden size's multiple of rows)
CHUNK_TOKENS = 4096


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 (the unfused loss: pipeline's last
    stage, tensor parallel's vocab-parallel loss, evaluation of logits)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def plain_head_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The reference: logits, then the mean fp32 cross-entropy."""
    return lm_loss(F.linear(h, weight), labels)


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The GEMM's dtype as autocast would choose it (the autograd Function runs outside it)."""
    device = h.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(h.dtype, weight.dtype)


def padded_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The head weight in the GEMM dtype with its rows padded with zeros to a multiple of
    ``VOCAB_MULTIPLE`` (one copy: the cast autocast would make anyway; none when nothing to do)."""
    vocab = weight.shape[0]
    rows = -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if rows == vocab:
        return weight.to(dtype)
    w = torch.zeros((rows, weight.shape[1]), dtype=dtype, device=weight.device)
    w[:vocab] = weight
    return w


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, dtype, chunk):
        n, vocab = h.shape[0], weight.shape[0]
        w = padded_weight(weight, dtype)
        ctx.weight_dtype = weight.dtype
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=w.device) if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, n, chunk):
            hc, yc = h[start:start + chunk].to(dtype), labels[start:start + chunk]
            logits = (hc @ w.t()).float()
            logits[:, vocab:] = float("-inf")  # the padding: no probability, no gradient
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, yc[:, None]).squeeze(1)).sum()
            if grad_h is None and grad_w is None:
                continue
            # d(mean loss)/d(logits) = (softmax - onehot) / n, in place of the chunk's logits
            g = logits.sub_(lse[:, None]).exp_()
            g[torch.arange(g.shape[0], device=g.device), yc] -= 1.0  # index_put: deterministic on CUDA
            g = g.div_(n).to(dtype)
            if grad_h is not None:
                grad_h[start:start + chunk] = g @ w
            if grad_w is not None:
                grad_w += (g.t() @ hc)[:vocab].float()  # the padded rows: zero, dropped
        ctx.save_for_backward(grad_h, grad_w)
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return (None if grad_h is None else grad_h * grad_out.to(grad_h.dtype),
                None if grad_w is None else (grad_w * grad_out).to(ctx.weight_dtype), None, None, None)


def chunked_head_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                      chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """Mean next-token cross-entropy of ``h [..., H] @ weight [V, H]ᵀ`` against ``labels [...]``."""
    h2, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    dtype = _compute_dtype(h2, weight)
    with torch.autocast(h.device.type, enabled=False):  # the Function picks the GEMM dtype itself
        return _ChunkedHeadLoss.apply(h2, weight, y, dtype, chunk)


_compiled = None


def padded_head_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``plain_head_loss`` with the GEMM on the padded vocabulary and the padding masked."""
    vocab = weight.shape[0]
    pad = -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE - vocab
    if pad == 0:
        return plain_head_loss(h, weight, labels)
    logits = F.linear(h, F.pad(weight, (0, 0, 0, pad)))
    padding = torch.arange(vocab + pad, device=logits.device) >= vocab
    return lm_loss(logits.masked_fill(padding, float("-inf")), labels)


def compiled_head_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``padded_head_loss`` compiled as one graph (built on first use): the mask, the fp32
    cast and the cross-entropy fuse into the GEMM's consumer."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(padded_head_loss)
    return _compiled(h, weight, labels)
