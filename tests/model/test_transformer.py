import pytest
import torch

from luban.model import get_preset
from luban.model.transformer import build_model, init_weights, lm_loss
from luban.parallel.recompute import apply_recompute


def _grads(model, x):
    model.zero_grad()
    lm_loss(model(x), x).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_recompute_modes_give_identical_gradients(name):
    cfg = get_preset(name)
    x = torch.randint(0, cfg.vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    model = build_model(cfg, seed=3)
    ref = _grads(model, x)
    for mode in ("full", "selective", "full:2"):
        apply_recompute(model, mode)
        got = _grads(model, x)
        assert all(torch.equal(ref[n], got[n]) for n in ref), mode
    assert [b.recompute for b in model.layers.values()] == [True, False, True, False]


def test_init_depends_only_on_seed_and_name():
    cfg = get_preset("tiny-llama")
    full = build_model(cfg, seed=7)
    stage = build_model(cfg, seed=0)
    del stage.layers["0"], stage.layers["1"]
    stage.tok_emb = None
    init_weights(stage, cfg, seed=7)
    ref = dict(full.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, ref[name]), name
    assert not torch.equal(build_model(cfg, seed=8).layers["2"].attn.wq.weight, ref["layers.2.attn.wq.weight"])


def test_tied_embeddings_share_storage_and_positions_matter():
    cfg = get_preset("tiny")
    model = build_model(cfg)
    assert model.lm_head.weight is model.tok_emb.weight
    x = torch.randint(0, cfg.vocab, (1, 8))
    a = model(x)
    b = model(x, positions=torch.arange(8) + 3)
    assert a.shape == (1, 8, cfg.vocab) and not torch.allclose(a, b)


def test_gqa_matches_explicitly_repeated_heads():
    q = torch.randn(1, 4, 6, 32)  # 4 heads sharing 2 kv heads, as tiny-llama
    k, v = torch.randn(1, 2, 6, 32), torch.randn(1, 2, 6, 32)
    from luban.model.transformer import causal_attention

    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(causal_attention(q, k, v), ref)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # the reference path
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qk_norm_under_autocast_uses_the_fused_kernel_with_the_same_arithmetic(dtype):
    """The heads come out of their projection in the autocast dtype, the norm's weight is fp32:
    mixed dtypes made ``rms_norm`` warn and decompose (no fused kernel on a GPU). ``head_norm``
    passes fp32 in and rounds once, which is what the decomposition computed."""
    from torch.overrides import TorchFunctionMode

    from luban.model.transformer import head_norm

    class Dtypes(TorchFunctionMode):  # (input, weight) dtypes of every rms_norm call
        calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.rms_norm, torch.nn.functional.rms_norm):
                self.calls.append((args[0].dtype, (args[2] if len(args) > 2 else kwargs["weight"]).dtype))
            return func(*args, **(kwargs or {}))

    norm = torch.nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 8, 4, 16, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    mixed = norm(x)  # the decomposed path, as before
    mixed_grads = torch.autograd.grad(mixed.float().square().sum(), (x, norm.weight))
    with Dtypes() as seen:
        fused = head_norm(norm, x)
    assert seen.calls and all(a == b for a, b in seen.calls), seen.calls
    fused_grads = torch.autograd.grad(fused.float().square().sum(), (x, norm.weight))
    assert fused.dtype == dtype and torch.equal(fused, mixed)
    for a, b in zip(fused_grads, mixed_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2 if a.dtype == dtype else 1e-5)
    same = head_norm(norm, x.detach().float())  # matching dtypes: the norm itself
    assert torch.equal(same, norm(x.detach().float()))
