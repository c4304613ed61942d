import subprocess
import sys
from pathlib import Path

import pytest
import torch

from luban.model.transformer import build_model


def tiny_overrides(data: Path, run: Path, **extra) -> list[str]:
    values = {"model.preset": '"tiny"', "model.seq_len": 32, "model.layers": 2, "data.path": f'"{data}"',
              "train.steps": 8, "train.global_batch": 4, "train.warmup_steps": 2, "train.eval_every": 4,
              "data.eval_batches": 1, "train.checkpoint_every": 0, "run.dir": f'"{run}"',
              "run.tensorboard": "false", "run.progress": '"plain"', **extra}
    return [f"{k}={v}" for k, v in values.items()]


def luban(*args, check=None, timeout=300, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "luban", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kw)
    if check is not None:
        assert proc.returncode == check, proc.stdout + proc.stderr
    return proc


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    from luban.train.sample import load_model

    model, _ = load_model(str(run))
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture
def tiny(small_dataset, tmp_path):
    return lambda name="run", **extra: tiny_overrides(small_dataset, tmp_path / name, **extra)


__all__ = ["luban", "final_weights", "assert_bitwise_equal", "build_model"]
