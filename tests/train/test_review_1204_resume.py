"""Resume and the optimizer's settings, a hostile review of 2026-12-04.

torch's ``Optimizer.load_state_dict`` restores the checkpoint's hyperparameters with its states. A
resume with ``train.beta1``, ``beta2``, ``weight_decay`` or ``momentum`` changed printed "beta1 = 0.9 in
the checkpoint, 0.5 now", recorded 0.5 in meta.json, and trained on with 0.9 (the loss curve was that
of an unchanged resume); and the checkpoint of a fused AdamW (plain-tensor parameters) resumed under
tensor parallel took ``fused`` over the DTensor optimizer's ``foreach``: a traceback at the first step
(that case runs in ``tests/parallel/test_layouts.py``, ``RESHARD_ADAMW``). The config now governs
the settings, the checkpoint the states.
"""

from __future__ import annotations

import pytest
import torch

from luban.model.config import ModelConfig
from luban.parallel.engine import build_engine
from luban.parallel.layout import ParallelLayout
from luban.parallel.optimizer import OptimizerConfig


def _engine(optim: OptimizerConfig):
    cfg = ModelConfig.from_dict({"preset": "tiny"})
    layout = ParallelLayout.from_dict({})
    return build_engine(cfg, layout, optim, 2, seed=0, device=torch.device("cpu")), cfg


def _step(engine, cfg):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq_len + 1), generator=g)
    engine.forward_backward(tokens[:, :-1], tokens[:, 1:])
    engine.step(1e-3, 1.0)


def _settings(engine) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for opt in engine.optimizers for g in opt.param_groups]


@pytest.mark.parametrize("before, after", [
    (OptimizerConfig(betas=(0.9, 0.95), weight_decay=0.1), OptimizerConfig(betas=(0.5, 0.6), weight_decay=0.0, eps=1e-6)),
    (OptimizerConfig(name="sgd", momentum=0.9, weight_decay=0.1), OptimizerConfig(name="sgd", momentum=0.5)),
])
def test_a_resume_trains_with_the_configs_optimizer_settings(before, after):
    """(An offloaded optimizer, ``offload = "optimizer"``, needs ZeRO: its resume with changed settings
    runs in the layout tests' spawns; it takes its groups from the device optimizer's at each step.)"""
    saved, cfg = _engine(before)
    _step(saved, cfg)
    state = saved.state_dict()
    resumed, _ = _engine(after)
    fresh = _settings(resumed)
    resumed.load_state_dict(state)
    assert _settings(resumed) == fresh  # the config's betas, eps, weight decay, momentum, fused/foreach
    opt = resumed.optimizers[0]
    states = [opt.state[p] for g in opt.param_groups for p in g["params"]]
    if after.name == "sgd":  # the states came from the checkpoint: SGD's momentum buffers, AdamW's step count
        assert all(torch.count_nonzero(s["momentum_buffer"]) for s in states)
        assert all(g["momentum"] == 0.5 for g in opt.param_groups)
    else:
        assert all(int(s["step"]) == 1 for s in states)
        assert all(g["betas"] == (0.5, 0.6) and g["eps"] == 1e-6 for g in opt.param_groups)
    assert opt.param_groups[0]["weight_decay"] == after.weight_decay
    _step(resumed, cfg)
    assert _settings(resumed) == [{**g, "lr": 1e-3} for g in fresh]
