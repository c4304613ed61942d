"""Review 2026-12-02 (b) of the MoE experts' grouped GEMMs: each test is one defect, and fails without its fix."""

from __future__ import annotations

import dataclasses

import torch

from luban.model import moe
from luban.model.presets import get_preset

CUDA = torch.device("cuda", 0)


def _capability(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_blackwell_runs_the_experts_loop(monkeypatch):
    """Blackwell's grouped kernel (CUTLASS sm100) leaves the accumulator of a group of zero length along K
    uncleared: the weight gradient of an expert that got no tokens in a micro-batch is garbage, not zeros
    (pytorch/pytorch#172439, NVIDIA/cutlass#2674); Hopper's is zeros. Blackwell was allowed the fused path."""
    _capability(monkeypatch, (10, 0))
    assert not moe.grouped_gemm_ok(CUDA, torch.bfloat16, (64, 128), 8)
    _capability(monkeypatch, (9, 0))
    assert moe.grouped_gemm_ok(CUDA, torch.bfloat16, (64, 128), 8)


def test_more_experts_than_the_kernel_takes_run_the_loop(monkeypatch):
    """The fused kernel refuses 1024 groups or more (``TORCH_CHECK(group_count < 1024)``, GroupMM.cu); a model
    may have 2^16 experts, and one of 1024 on a Hopper GPU in bf16 stopped at its first MoE forward."""
    _capability(monkeypatch, (9, 0))
    assert moe.grouped_gemm_ok(CUDA, torch.bfloat16, (64, 128), moe.GROUPED_MM_MAX_GROUPS)
    assert not moe.grouped_gemm_ok(CUDA, torch.bfloat16, (64, 128), moe.GROUPED_MM_MAX_GROUPS + 1)


def test_experts_ask_with_their_own_group_count(monkeypatch):
    asked = []
    monkeypatch.setattr(moe, "grouped_gemm_ok", lambda *args: asked.append(args) or False)
    cfg = dataclasses.replace(get_preset("tiny-moe"), experts=5, experts_per_token=2)
    experts = moe.Experts(cfg)
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    counts = torch.tensor([3, 0, 1, 2, 0])
    experts(torch.randn(6, cfg.hidden), counts)
    assert [(a[2], a[3]) for a in asked] == [((cfg.expert_ffn_hidden, cfg.hidden), 5)]
