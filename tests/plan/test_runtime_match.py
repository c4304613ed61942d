"""runtime="luban" predictions against what PyTorch allocates for luban's own model.

Parameters, gradients and optimizer state come from ``Engine.memory_report`` (storages);
saved activations per micro-batch are the distinct non-parameter storages that autograd saves
for backward (``saved_tensors_hooks``) and that selective recompute keeps in its cache, as the
runtime measures them (``ActivationCounter``).
"""

import pytest
import torch

from luban.model.presets import get_preset
from luban.model.transformer import build_model
from luban.parallel.recompute import apply_recompute
from luban.parallel.engine import Engine, OptimizerConfig, autocast
from luban.parallel.layout import ParallelLayout
from luban.parallel.memory import ActivationCounter
from luban.plan.estimate import estimate


def saved_activation_bytes(cfg, layout, batch, seq):
    model = build_model(cfg)
    apply_recompute(model, layout.recompute)
    model.train()
    counter = ActivationCounter([model])  # selective recompute's cache included (its policy reports it)
    x = torch.randint(0, cfg.vocab, (batch, seq))
    with counter.record(), autocast(layout, torch.device("cpu")):
        model(x, labels=x)  # the micro-batch loop's path: the head and loss fused (one stage, tp = 1)
    return counter.total


@pytest.mark.parametrize("name,precision,recompute", [
    (name, precision, recompute) for name in ("tiny", "tiny-llama", "tiny-moe") for precision, recompute in
    (("fp32", "none"), ("fp32", "selective"), ("fp32", "full:2"), ("bf16", "none"), ("bf16", "selective"),
     ("bf16", "full"))])
def test_activations_per_microbatch_within_10pct(name, precision, recompute):
    cfg = get_preset(name).replace(layers=3)
    batch, seq = (1, 96) if precision == "fp32" else (3, 64)
    layout = ParallelLayout(precision=precision, recompute=recompute, micro_batch=batch)
    est = estimate(cfg, "dgx-a100-80g", layout, global_batch=batch, seq=seq, runtime="luban")
    measured = saved_activation_bytes(cfg, layout, batch, seq)
    assert est.activation_bytes_per_microbatch == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("optimizer,momentum", [("adamw", 0.0), ("sgd", 0.0), ("sgd-momentum", 0.9)])
def test_model_states_within_2pct(optimizer, momentum):
    cfg = get_preset("tiny-llama")
    layout = ParallelLayout(precision="bf16")
    engine = Engine(cfg, layout, OptimizerConfig(name="adamw" if optimizer == "adamw" else "sgd", momentum=momentum),
                    global_batch=2, seed=0, device=torch.device("cpu"))
    x = torch.randint(0, cfg.vocab, (2, 32))
    engine.forward_backward(x, x)
    engine.step(lr=1e-3, max_norm=1.0)
    engine.forward_backward(x, x)
    report = engine.memory_report()
    est = estimate(cfg, "dgx-a100-80g", layout, global_batch=2, seq=32, runtime="luban", optimizer=optimizer)
    assert est.param_bytes == pytest.approx(report["param_bytes"], rel=0.02)
    assert est.grad_bytes == pytest.approx(report["grad_bytes"], rel=0.02)
    assert est.optimizer_bytes == pytest.approx(report["optimizer_bytes"], rel=0.02, abs=1)
