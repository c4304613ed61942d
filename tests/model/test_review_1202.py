"""Review of 2026-12-02: the rope table under context parallel.

A cp rank's stage gets its tokens' global positions from ``feed_positions``; the model built its
rope table of every ``seq_len`` position whenever positions were given (reading their largest would
wait for the device), so an imported model with ``max_position_embeddings`` 2^24 under cp built a
17 GB table on each rank whatever the sequence. The hook now passes the whole sequence's length as
``span``: the table covers that sequence, rounded up to a power of two, and its rows are unchanged.
"""

from __future__ import annotations

import dataclasses

import torch

from luban.model.presets import get_preset
from luban.model.transformer import Transformer, rope_tables
from luban.parallel.context_parallel import chunk_positions, feed_positions, shard_sequence


def test_cp_rope_table_covers_the_sequence_not_every_position():
    cfg = dataclasses.replace(get_preset("tiny-llama"), seq_len=1 << 24)
    cpu = torch.device("cpu")
    seen = {}
    for cp, rank, seq, rows in ((2, 1, 16, 16), (2, 0, 24, 32), (4, 3, 40, 64)):
        model = Transformer(cfg)
        feed_positions(model, cp, rank, seq_factor=cp)
        block = model.layers["0"]
        block.register_forward_pre_hook(lambda _m, args: seen.update(rope=args[1]))
        x = shard_sequence(torch.randint(0, cfg.vocab, (1, seq)), cp, rank)
        model(x)
        assert model._rope_cache[cpu][0].shape[0] == rows
        want = rope_tables(dataclasses.replace(cfg, seq_len=rows), chunk_positions(seq, cp, rank))
        assert torch.equal(seen["rope"][0], want[0]) and torch.equal(seen["rope"][1], want[1])


def test_positions_without_a_span_still_get_the_whole_table():
    cfg = dataclasses.replace(get_preset("tiny-llama"), seq_len=48)
    model = Transformer(cfg)
    cos, _sin = model.rope(torch.tensor([0, 47]), 2, torch.device("cpu"))
    assert model._rope_cache[torch.device("cpu")][0].shape[0] == 48 and cos.shape[0] == 2


# --- MoE: grouped GEMMs with device-side group offsets --------------------------------------------
# Every MoE layer's forward read its per-expert token counts on the host (``counts.tolist()`` for the
# per-expert loop, and ``bincount``, which reads its input's maximum on a GPU): one device wait per
# MoE layer and micro-batch. Where ``torch._grouped_mm`` has its fused kernel (bf16, Hopper; see test_review_1202b)
# the experts now run as three grouped GEMMs whose offsets stay on the device; on the CPU ATen's
# fallback of the same call equals the loop bitwise, so the path is checked here with the predicate
# forced on.

import pytest  # noqa: E402

from luban.model import moe  # noqa: E402
from luban.model.transformer import build_model  # noqa: E402


def _moe_step(cfg, grouped: bool, monkeypatch, precision=None):
    monkeypatch.setattr(moe, "grouped_gemm_ok", lambda device, dtype, widths, groups: grouped)
    model = build_model(cfg, seed=3)
    model.train()
    x = torch.randint(0, cfg.vocab, (2, cfg.seq_len), generator=torch.Generator().manual_seed(5))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = model(x[:, :-1], labels=x[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset,precision", [("tiny-moe", None), ("tiny-moe", "bf16"), ("mixtral-gelu", None)])
def test_grouped_experts_equal_the_loop(preset, precision, monkeypatch):
    cfg = get_preset("tiny-moe")
    if preset == "mixtral-gelu":
        cfg = dataclasses.replace(cfg, activation="gelu", router="softmax", shared_experts=0)
    cfg = dataclasses.replace(cfg, seq_len=33)
    loss_loop, grads_loop = _moe_step(cfg, False, monkeypatch, precision)
    loss_grouped, grads_grouped = _moe_step(cfg, True, monkeypatch, precision)
    assert torch.equal(loss_loop, loss_grouped)
    assert grads_loop.keys() == grads_grouped.keys()
    for name in grads_loop:  # bf16 too: each GEMM casts its operands as autocast does the loop's
        assert torch.equal(grads_loop[name], grads_grouped[name]), name


def test_grouped_moe_forward_reads_nothing_on_the_host(monkeypatch):
    cfg = dataclasses.replace(get_preset("tiny-moe"), seq_len=17)
    monkeypatch.setattr(moe, "grouped_gemm_ok", lambda device, dtype, widths, groups: True)
    layer = build_model(cfg, seed=0).layers["1"].mlp
    layer.train()

    def no_host_read(*_a, **_k):
        raise AssertionError("a MoE forward read the device on the host")

    x = torch.randn(2, 16, cfg.hidden)
    for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, no_host_read)
    monkeypatch.setattr(torch, "bincount", no_host_read)
    layer(x).sum()


def test_grouped_gemm_ok_only_where_the_fused_kernel_runs(monkeypatch):
    cuda = torch.device("cuda", 0)
    for capability, want in (((9, 0), True), ((10, 0), False), ((8, 0), False), ((12, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert moe.grouped_gemm_ok(cuda, torch.bfloat16, (64, 128), 8) is want, capability
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert not moe.grouped_gemm_ok(cuda, torch.float32, (64, 128), 8)  # fp32: ATen's host-reading fallback
    assert not moe.grouped_gemm_ok(cuda, torch.bfloat16, (60, 128), 8)  # 120-byte rows: not 16-byte aligned
    assert not moe.grouped_gemm_ok(torch.device("cpu"), torch.bfloat16, (64, 128), 8)


def test_grouped_experts_make_no_host_tensor(monkeypatch):
    """The grouped path's offsets and counts are made on the model's device: the whole engine step of
    a MoE under ``foreign_host`` (a tensor made without a device lands on meta and fails where a host
    tensor would meet CUDA ones), grouped GEMMs forced, fp32 and bf16, selective recompute too."""
    from luban.parallel.engine import OptimizerConfig, build_engine
    from luban.parallel.layout import ParallelLayout
    from tests.model.test_devices import foreign_host, small

    monkeypatch.setattr(moe, "grouped_gemm_ok", lambda device, dtype, widths, groups: True)
    cfg = small(get_preset("tiny-moe"))
    for options in (dict(), dict(precision="bf16"), dict(recompute="selective", precision="bf16")):
        engine = build_engine(cfg, ParallelLayout(**options), OptimizerConfig(name="adamw"), 2, seed=0,
                              device=torch.device("cpu"))
        tokens = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
        with foreign_host():
            loss = engine.forward_backward(tokens, tokens)
            norm = engine.step(1e-3, 1.0)
            metrics = engine.moe_metrics()
        assert loss == loss and norm == norm and metrics["moe_tokens_per_expert"], options
