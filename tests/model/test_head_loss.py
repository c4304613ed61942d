"""The fused head + loss equals the plain computation (logits, fp32 cross-entropy)."""

from __future__ import annotations

import pytest
import torch

from luban.model.head_loss import chunked_head_loss, compiled_head_loss, padded_head_loss, plain_head_loss


def _case(dtype=torch.float32, n=(3, 37), h=48, v=517, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*n, h, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(v, h, generator=g, dtype=torch.float32).mul_(0.2).requires_grad_()
    y = torch.randint(0, v, n, generator=g)
    return x, w, y


def _grads(fn, x, w, y, **kw):
    x.grad = w.grad = None
    loss = fn(x, w, y, **kw)
    loss.backward()
    return loss.detach(), x.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("chunk", [1, 16, 111, 4096])
def test_chunked_equals_plain_fp32(chunk):
    x, w, y = _case()
    ref = _grads(plain_head_loss, x, w, y)
    got = _grads(chunked_head_loss, x, w, y, chunk=chunk)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_chunked_equals_plain_under_bf16_autocast():
    """Same GEMM dtype as autocast's (bf16), reductions in fp32: within bf16 rounding."""
    x, w, y = _case()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _grads(plain_head_loss, x, w, y)
        got = _grads(chunked_head_loss, x, w, y, chunk=32)
    assert got[2].dtype == torch.float32 and got[1].dtype == x.dtype
    torch.testing.assert_close(got[0], ref[0], rtol=2e-3, atol=2e-3)
    for a, b in zip(got[1:], ref[1:]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-4)


def test_no_fp32_logits_are_kept_for_backward():
    """What the fused loss saves: the two gradients (input-sized and weight-sized), never a
    [tokens, vocab] tensor; the plain loss keeps the fp32 log-probabilities."""
    x, w, y = _case(n=(4, 64), v=1000)
    for fn, expect_logits in ((plain_head_loss, True), (chunked_head_loss, False)):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            fn(x, w, y)
        assert ((256, 1000) in shapes) == expect_logits, (fn.__name__, shapes)


def test_no_grad_computes_only_the_loss():
    x, w, y = _case()
    with torch.no_grad():
        torch.testing.assert_close(chunked_head_loss(x, w, y, chunk=8), plain_head_loss(x, w, y), rtol=1e-5, atol=1e-6)


def test_compiled_equals_plain():
    x, w, y = _case()
    ref = _grads(plain_head_loss, x, w, y)
    got = _grads(compiled_head_loss, x, w, y)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("vocab", [128, 129, 257, 50257 % 1000])
def test_padding_the_vocabulary_changes_nothing(vocab):
    """The GEMMs run on rows padded to a multiple of 128 with -inf logits: the loss and both
    gradients are the real vocabulary's, and the weight gradient keeps the weight's shape."""
    from luban.model.head_loss import VOCAB_MULTIPLE, padded_weight

    x, w, y = _case(v=vocab)
    assert padded_weight(w, torch.float32).shape[0] % VOCAB_MULTIPLE == 0
    ref = _grads(plain_head_loss, x, w, y)
    for fn, kw in ((chunked_head_loss, {"chunk": 50}), (padded_head_loss, {})):
        got = _grads(fn, x, w, y, **kw)
        assert got[2].shape == w.shape
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
