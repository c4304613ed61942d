"""Exact resume: straight runs and interrupted runs end bitwise equal; saves are atomic."""

import json
import signal
import sys
import time

import pytest

from tests.child import Child
from luban.config import load_config
from luban.errors import EXIT_SUSPENDED
from luban.train import checkpoint
from luban.train.preempt import SuspendFlag
from luban.train.trainer import Trainer

from .conftest import assert_bitwise_equal, final_weights, luban


def _train(overrides, stop_at=None, resume=None, monkeypatch=None):
    trainer = Trainer(load_config(None, overrides))
    if stop_at is not None:
        monkeypatch.setattr(SuspendFlag, "agreed", lambda self: trainer.step == stop_at)
    return trainer.train(resume)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_half_then_resume_equals_straight(tiny, tmp_path, monkeypatch, optimizer):
    extra = {"train.optimizer": f'"{optimizer}"', "train.momentum": 0.9 if optimizer == "sgd" else 0.0}
    _train(tiny("straight", **extra))
    first = _train(tiny("split", **extra), stop_at=4, monkeypatch=monkeypatch)
    assert first.suspended and first.step == 4
    monkeypatch.undo()
    second = _train(tiny("split", **extra), resume="auto")
    assert second.step == 8 and not second.suspended
    assert_bitwise_equal(final_weights(tmp_path / "straight"), final_weights(tmp_path / "split"))
    steps = [r["step"] for line in (tmp_path / "split" / "metrics.jsonl").open() if "step" in (r := json.loads(line))]
    assert steps == list(range(1, 9))


def test_suspend_by_signal_k_times_is_bitwise_exact(tiny, tmp_path):
    """SIGUSR1 at arbitrary moments, resume each time: same weights as one uninterrupted run."""
    luban("train", "--resume", "auto", *sum((["--set", s] for s in tiny("straight", **{"train.steps": 12})), []),
          check=0)
    args = ["train", "--resume", "auto", *sum((["--set", s] for s in tiny("suspended", **{"train.steps": 12})), [])]
    suspensions = 0
    for wait_for_step in (2, 5, 9, None):
        with Child([sys.executable, "-m", "luban", *args], log=tmp_path / f"run{suspensions}.log") as proc:
            if wait_for_step is not None:
                deadline = time.monotonic() + 300
                while not any(line.startswith("step ") and int(line.split()[1].split("/")[0]) >= wait_for_step
                              for line in proc.output().splitlines()):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        break  # finished (or failed) before that step: the exit code below says which
                    time.sleep(0.02)
                else:
                    proc.send_signal(signal.SIGUSR1)
            proc.wait(300)
            out = proc.output()
        if proc.returncode == EXIT_SUSPENDED:
            suspensions += 1
            assert "suspended on SIGUSR1" in out
        else:
            assert proc.returncode == 0, out
            break
    assert suspensions >= 2
    assert_bitwise_equal(final_weights(tmp_path / "straight"), final_weights(tmp_path / "suspended"))


def test_second_sigint_exits_at_once(tiny, tmp_path):
    # steps of ~4 s on an idle 2-core host, so both signals land within one step even when a
    # loaded host delays the second one (at ~1 s steps, CI once saw the step end in between)
    big = {"train.steps": 500, "model.hidden": 512, "model.seq_len": 128, "train.global_batch": 64}
    args = ["train", *sum((["--set", s] for s in tiny(**big)), [])]
    with Child([sys.executable, "-m", "luban", *args], log=tmp_path / "train.log") as proc:
        proc.wait_for(r"^step ", 300)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, proc.tail()
    assert checkpoint.step_dirs(tmp_path / "run" / "checkpoints") == []  # nothing saved (the folder is made at start-up)


def test_crash_during_save_keeps_previous_checkpoint(tiny, tmp_path, monkeypatch):
    overrides = tiny(**{"train.checkpoint_every": 4})
    _train(overrides)
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in checkpoint.step_dirs(root)] == ["step_0000008", "step_0000004"]

    def killed(*_):
        raise KeyboardInterrupt("killed while writing the manifest")

    trainer = Trainer(load_config(None, overrides + ["train.steps=9"]))
    trainer.resume("auto")
    trainer.step = 9
    monkeypatch.setattr(checkpoint, "write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        trainer.save()
    # a Ctrl-C's KeyboardInterrupt removes the half-written folder (a kill -9 leaves it: the next save
    # sweeps it, tests/train/test_checkpoint_safety.py and test_review_1202f.py kill real children)
    assert not (root / ".tmp-step_0000009").exists()
    assert checkpoint.latest_valid(root).name == "step_0000008"

    # a damaged newest checkpoint is skipped by --resume auto
    victim = next((root / "step_0000008").glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert "CRC32" in checkpoint.verify(root / "step_0000008")
    assert checkpoint.latest_valid(root).name == "step_0000004"


def test_keep_last_k(tiny, tmp_path):
    _train(tiny(**{"train.checkpoint_every": 2, "train.keep_checkpoints": 2}))
    names = [p.name for p in checkpoint.step_dirs(tmp_path / "run" / "checkpoints")]
    assert names == ["step_0000008", "step_0000006"]
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "run" / "checkpoints").iterdir())


def test_resume_explicit_bad_directory_is_one_line_error(tiny, tmp_path):
    proc = luban("train", "--resume", tmp_path / "nope", *sum((["--set", s] for s in tiny()), []))
    assert proc.returncode == 2 and "--resume" in proc.stderr and "Traceback" not in proc.stderr


def test_measuring_the_cpu_peak_leaves_the_rng_alone():
    """The trainer measures the CPU's matmul peak (MFU) once per process, after a resume restored
    the RNG: drawing its operands from the global RNG made a resumed run's RNG state part from the
    uninterrupted run's (seen in the multi-rank resume test, test_resume_layouts.py)."""
    import torch

    from luban.plan.probe import measure_matmul_peak

    before = torch.get_rng_state()
    assert measure_matmul_peak(seconds=0.02) > 0
    assert torch.equal(before, torch.get_rng_state())
