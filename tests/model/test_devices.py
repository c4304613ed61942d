"""Every preset and every single-GPU option keeps its tensors on the model's device.

No GPU here, so a stand-in catches a tensor made on the host inside a GPU path: the real CPU
run with the *default* device set to ``meta`` (``foreign_host``). A factory call without
``device=`` (``torch.arange(n)``, ``torch.zeros(...)``) then makes a meta tensor, and meeting
the model's CPU tensors fails exactly where, on a GPU, a host tensor would meet CUDA ones
("Expected all tensors to be on the same device"). It runs the whole engine step (forward,
backward, clipping, optimizer, evaluation), MoE included, for one preset of every family at
a small size, under every single-GPU option.

(``FakeTensorMode`` on a fake ``cuda`` device was tried: on a CPU-only torch its embedding
aborts the process, so it cannot be a test here.)

On 3457f4b this fails for every Llama-family preset (rope's frequency table was built on the
host) and for every MoE in bf16 (``index_add_`` of bf16 rows into an fp32 output).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from luban.model.presets import PRESETS, get_preset
from luban.parallel.engine import OptimizerConfig, build_engine
from luban.parallel.layout import ParallelLayout


@contextlib.contextmanager
def foreign_host():
    """Tensors made without an explicit device land on ``meta``: any of them meeting the
    model's tensors is a host tensor on a device path."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def small(cfg):
    """The preset's family and features (arch, norms, rope, GQA ratio, qk-norm, explicit head
    size, MoE with its shared experts, dense layers and router) at a size a CPU runs in ms."""
    gqa = cfg.kv_heads != cfg.heads
    head_dim = 24 if cfg.head_dim * cfg.heads != cfg.hidden else 16
    dense = min(cfg.dense_layers, 1)
    return cfg.replace(hidden=64, heads=4, kv_heads=2 if gqa else 4, head_dim=head_dim, ffn_hidden=96,
                       layers=dense + 2, vocab=min(cfg.vocab, 515), seq_len=32,
                       experts=min(cfg.experts, 4), experts_per_token=min(cfg.experts_per_token, 2),
                       expert_ffn_hidden=32, dense_layers=dense)


def families():
    """One preset per distinct family/feature set (the shapes differ only in size otherwise)."""
    seen, names = set(), []
    for name, cfg in PRESETS.items():
        key = (cfg.arch, cfg.norm, cfg.activation, cfg.position, cfg.bias, cfg.tie_embeddings, cfg.qk_norm,
               cfg.kv_heads != cfg.heads, cfg.head_dim * cfg.heads != cfg.hidden, cfg.experts > 0,
               cfg.shared_experts > 0, cfg.dense_layers > 0, cfg.router)
        if key not in seen:
            seen.add(key)
            names.append(name)
    return names


# every single-GPU option (precision, recompute, offload, ZeRO at dp 1) on the tiny presets;
# the other families (the same code paths at other sizes and features) in fp32 and bf16
OPTIONS = [dict(), dict(precision="bf16"), dict(precision="fp16"), dict(recompute="selective"),
           dict(recompute="full", precision="bf16"), dict(offload="activations", precision="bf16"),
           dict(offload="optimizer", zero=1), dict(zero=1), dict(zero=3, precision="bf16")]
TINY = ("tiny", "tiny-llama", "tiny-moe")


@pytest.mark.parametrize("preset", families())
def test_engine_step_makes_no_host_tensor(preset):
    cfg = small(get_preset(preset))
    adamw = OptimizerConfig(name="adamw")
    for options in OPTIONS if preset in TINY else OPTIONS[:2]:
        engine = build_engine(cfg, ParallelLayout(**options), adamw, 2, seed=0, device=torch.device("cpu"))
        tokens = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
        labels = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
        with foreign_host():
            loss = engine.forward_backward(tokens, labels)
            norm = engine.step(1e-3, 1.0)
            engine.eval_loss(tokens, labels)
        assert loss == loss and norm == norm, (preset, options)
