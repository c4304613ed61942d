"""Review of 2026-12-02 (e): a MoE ``capacity_factor`` cut without a host read.

The cut kept ``order[position < capacity]``: a boolean index, whose length is data, so every MoE
layer waited for the device once per micro-batch on a GPU even where the grouped GEMMs kept the
rest of the layer on the device. The experts now compute GShard's fixed buffers (``capacity_slots``,
``MoE.capped``): capacity rows per expert, the kept ones padded with zero rows, every size the host's.

The detector: the layer's forward and backward on ``meta`` tensors, which have no data, so any read
of a value (``tolist``, ``item``, a boolean index's ``nonzero``) raises. On the old code the capped
layer failed there with "register_meta function for torch.nonzero()".
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from luban.model import moe
from luban.model.presets import get_preset
from luban.model.transformer import build_model
from tests.model.test_moe import CFG, _layer, _reference


def _meta_step(monkeypatch, grouped: bool, capacity_factor: float):
    """One forward and backward of a tiny-moe MoE layer in bf16 on ``meta`` (no data to read)."""
    monkeypatch.setattr(moe, "grouped_gemm_ok", lambda device, dtype, widths, groups: grouped)
    monkeypatch.setattr(moe, "compute_dtype", lambda x: x.dtype)  # autocast has no meta device
    cfg = dataclasses.replace(get_preset("tiny-moe"), seq_len=17, capacity_factor=capacity_factor)
    layer = build_model(cfg, seed=0).layers["1"].mlp.train().to("meta", torch.bfloat16)
    x = torch.randn(2, 16, cfg.hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    return y, x.grad


@pytest.mark.parametrize("grouped,capacity_factor", [(True, 1.0), (True, 0.5), (False, 1.0), (True, 0.0)],
                         ids=["grouped-capped", "grouped-capped-half", "loop-capped", "grouped-dropless"])
def test_moe_forward_and_backward_read_no_data(monkeypatch, grouped, capacity_factor):
    y, grad = _meta_step(monkeypatch, grouped, capacity_factor)
    assert y.shape == grad.shape == (2, 16, get_preset("tiny-moe").hidden)


def test_the_meta_detector_catches_a_host_read(monkeypatch):
    """The dropless loop reads its counts on the host (by design, off Hopper): the detector sees it."""
    with pytest.raises(NotImplementedError, match="meta"):
        _meta_step(monkeypatch, False, 0.0)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("factor", [1.0, 0.5, 2.0])
def test_capped_layer_and_its_gradients_equal_the_token_by_token_reference(router, factor):
    """Forward and every gradient (router, experts, shared expert, input) of the capped layer equal
    the per-token reference that leaves the dropped assignments out (the first ``capacity`` tokens of
    an expert in micro-batch order are kept)."""
    cfg = CFG.replace(router=router, capacity_factor=factor)
    tokens = 24
    capacity = moe.MoE.capacity(_layer(cfg), tokens)
    layer = _layer(cfg).eval()  # eval: the same cut, no aux loss in the gradient
    if router == "sigmoid":
        layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, cfg.experts))
    x = torch.randn(tokens, cfg.hidden, generator=torch.Generator().manual_seed(7), requires_grad=True)
    _, ids, _ = layer.router(x)
    seen, drop = {}, set()
    for t in range(tokens):
        for e in ids[t].tolist():
            seen[e] = seen.get(e, 0) + 1
            if seen[e] > capacity:
                drop.add((t, e))
    assert drop or factor == 2.0, "the cases at factor <= 1 need an overloaded expert"
    g = torch.randn(tokens, cfg.hidden, generator=torch.Generator().manual_seed(8))
    y = layer(x)
    (y * g).sum().backward()
    ours = {n: p.grad.clone() for n, p in layer.named_parameters()} | {"x": x.grad.clone()}
    layer.zero_grad()
    x.grad = None
    want = _reference(layer, x, drop)
    (want * g).sum().backward()
    theirs = {n: p.grad.clone() for n, p in layer.named_parameters()} | {"x": x.grad.clone()}
    assert torch.allclose(y, want, atol=1e-6)
    for name in ours:
        assert torch.allclose(ours[name], theirs[name], atol=1e-5), name


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_capped_grouped_gemms_equal_the_capped_loop(monkeypatch, precision):
    """The fixed buffers through ``torch._grouped_mm`` (ATen's CPU fallback) and through the loop."""
    from tests.model.test_review_1202 import _moe_step

    cfg = dataclasses.replace(get_preset("tiny-moe"), seq_len=33, capacity_factor=0.75)
    loss_loop, grads_loop = _moe_step(cfg, False, monkeypatch, precision)
    loss_grouped, grads_grouped = _moe_step(cfg, True, monkeypatch, precision)
    assert torch.equal(loss_loop, loss_grouped)
    for name in grads_loop:
        assert torch.equal(grads_loop[name], grads_grouped[name]), name


def test_capacity_slots_are_distinct_and_keep_the_first_tokens():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [2, 0]])  # expert 0: 4 assignments, capacity 2
    order, slot, kept, routed = moe.capacity_slots(ids, 3, 2)
    assert routed.tolist() == [4, 2, 2] and kept.tolist() == [2, 2, 2]
    assert len(set(slot.tolist())) == slot.numel()  # a write per slot: no order between writers to pick
    inside = {int(order[i]): int(s) for i, s in enumerate(slot.tolist()) if s < 3 * 2}
    # expert 0 keeps tokens 0 and 1 (assignments 0, 2), drops tokens 2 and 3 (assignments 4, 7)
    assert inside == {0: 0, 2: 1, 1: 2, 5: 3, 3: 4, 6: 5}


def test_a_capacity_no_expert_can_reach_is_dropless_not_a_huge_buffer(monkeypatch):
    """A careless ``capacity_factor = 1000`` asked for buffers of 1000x the dropless rows: an expert gets
    a token at most once, so a capacity of T or more drops nothing and runs the dropless path."""
    cfg = CFG.replace(capacity_factor=1000.0)
    layer = _layer(cfg).eval()
    assert layer.capacity(24) is None and _layer(CFG.replace(capacity_factor=1.0)).capacity(24) == 8
    capped = []
    monkeypatch.setattr(moe.MoE, "capped", lambda *a: capped.append(a))
    x = torch.randn(24, cfg.hidden, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert torch.allclose(layer(x), _reference(layer, x), atol=1e-6)
    assert not capped
