"""Checkpoints never surprise: unwritable or full storage is one line (start-up check; exit 74
at save time with the previous checkpoint intact), a changed model or optimizer is named before
loading, and resuming from an older checkpoint starts a branch instead of being undone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import resource
import sys
from pathlib import Path

import pytest

from tests.child import Child
from luban.train import checkpoint
from tests.train.conftest import luban, tiny_overrides


def sets(overrides):
    return sum((["--set", o] for o in overrides), [])


def test_unwritable_run_dir_is_refused_before_any_work(tiny, tmp_path):
    (tmp_path / "afile").write_text("x")
    for where, words in ((tmp_path / "afile" / "run", "cannot be written"), (Path("/proc/luban-run"), "cannot be")):
        out = luban("train", *sets(tiny(**{"run.dir": f'"{where}"'})))
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("luban: error: ") and words in lines[0], out.stderr


@pytest.fixture(scope="module")
def trained(small_dataset, tmp_path_factory):
    """A run trained once per module for the tests that start from it: ``trained(name, sets, dest)``
    copies the run of those ``--set`` keys (trained the first time it is asked for) to ``dest``.
    The copy is the folder a fresh run there would leave (same files, same bytes); each test
    changes only its own copy."""
    runs = {}

    def copy(name: str, keys: dict, dest: Path) -> Path:
        if name not in runs:
            runs[name] = tmp_path_factory.mktemp(name) / "run"
            luban("train", *sets(tiny_overrides(small_dataset, runs[name], **keys)), check=0)
        shutil.copytree(runs[name], dest, symlinks=True)
        return dest

    return copy


FOUR_STEPS = {"train.steps": 4, "train.checkpoint_every": 2}  # checkpoints at steps 2 and 4


@pytest.mark.parametrize("background", ["true", "false"])  # the failed write in the background thread, or inline
def test_a_full_disk_at_save_time_exits_74_and_keeps_the_previous_checkpoint(tiny, tmp_path, trained, background):
    run = trained("four-steps", FOUR_STEPS, tmp_path / "run")
    size = max(f.stat().st_size for f in (run / "checkpoints" / "step_0000004").iterdir())

    def small_files():  # writes past this size fail with EFBIG, as on a full disk (CPython ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))

    out = luban("train", "--resume", "auto", *sets(tiny(**{"train.steps": 8, "train.checkpoint_every": 2,
                                                           "train.async_checkpoint": background})),
                preexec_fn=small_files)
    assert out.returncode == 74, out.stdout[-2000:] + out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert "checkpoint step 6 could not be written" in line and "File too large" in line and "intact" in line
    assert "Traceback" not in out.stderr
    assert [p.name for p in checkpoint.step_dirs(run / "checkpoints")] == ["step_0000004", "step_0000002"]
    assert checkpoint.verify(run / "checkpoints" / "step_0000004") is None
    assert not list((run / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("change,words", [
    ({"model.hidden": 64}, "luban: error: model.hidden = 64: 32, as in the checkpoint --resume names"),
    ({"train.optimizer": '"sgd"'}, "luban: error: train.optimizer = 'sgd': 'adamw', as in the checkpoint"),
])
def test_a_changed_model_or_optimizer_is_named_before_loading(tiny, tmp_path, trained, change, words):
    trained("two-steps", {"train.steps": 2, "train.checkpoint_every": 2, "model.hidden": 32}, tmp_path / "run")
    out = luban("train", "--resume", "auto", *sets(tiny(**{"train.steps": 4, "model.hidden": 32, **change})))
    assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_resuming_an_older_checkpoint_starts_a_branch(tiny, tmp_path):
    run = tmp_path / "run"
    base = {"train.steps": 6, "train.checkpoint_every": 2, "train.keep_checkpoints": 3}
    luban("train", *sets(tiny(**base)), check=0)
    out = luban("train", "--resume", run / "checkpoints" / "step_0000002",
                *sets(tiny(**{**base, "train.steps": 4, "train.lr": 1e-3})), check=0)
    assert "[train] lr = 0.003 in the checkpoint, 0.001 now" in out.stdout, out.stdout
    assert "branching from step_0000002: 2 newer checkpoint(s) kept in" in out.stdout
    aside = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("aside-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["step_0000004", "step_0000006"]
    newest = checkpoint.latest_valid(run / "checkpoints")
    assert newest.name == "step_0000004" and json.loads((newest / "meta.json").read_text())["config"]["train"]["lr"] == 1e-3
    out = luban("train", "--resume", "auto", *sets(tiny(**{**base, "train.steps": 6, "train.lr": 1e-3})), check=0)
    assert f"resumed from {newest}" in out.stdout  # auto follows the branch, not the old step 6


def test_kill_9_at_random_moments_of_saving_always_leaves_a_valid_newest_checkpoint(tiny, tmp_path):
    """A save every step, kill -9 at random moments (mostly inside a save): after each kill the
    newest valid checkpoint loads, and training resumes from it."""
    import random
    import signal
    import time

    root_dir = Path(__file__).resolve().parents[2]

    run = tmp_path / "run"
    rng = random.Random(0)
    args = ["train", "--resume", "auto", *sets(tiny(**{"train.steps": 400, "train.checkpoint_every": 1,
                                                       "train.keep_checkpoints": 2, "model.hidden": 256}))]
    steps, newest_step = [], 0
    for attempt in range(4):
        # Its own log: a shared one would hold the previous run's step lines, and the wait below
        # would return at once. Step p+3 shown means the save of p+1 finished (each save waits for
        # the previous one before starting), so every run leaves a newer checkpoint than it found
        # however slow the machine; then a random moment within the next steps' saves.
        with Child([sys.executable, "-m", "luban", *args], log=tmp_path / f"train{attempt}.log", cwd=root_dir) as proc:
            proc.wait_for(rf"^step {newest_step + 3}/", 300)
            time.sleep(rng.uniform(0.0, 1.5))  # a random moment, not a synchronisation
            proc.send_signal(signal.SIGKILL)
            proc.wait(60)
        newest = checkpoint.latest_valid(run / "checkpoints")
        assert newest is not None and checkpoint.verify(newest) is None
        newest_step = int(newest.name.split("_")[1])
        steps.append(newest_step)
    assert all(a < b for a, b in zip(steps, steps[1:])), steps  # every restart resumed and went on


# Run `luban train ARGS` with the run dir turned read-only right after the trainer's start-up check,
# as when storage is remounted read-only mid-run: the next save meets EROFS (root included).
READ_ONLY_AFTER_CHECK = """
import subprocess, sys
import luban.train.trainer as trainer
from luban.cli import main
checked = trainer.check_run_dir
def check_then_read_only(run_dir, *args, **kwargs):
    checked(run_dir, *args, **kwargs)
    subprocess.run(["mount", "-o", "remount,bind,ro", sys.argv[1]], check=True)
trainer.check_run_dir = check_then_read_only
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root for a private mount")
def test_a_read_only_file_system_at_save_time_exits_74_and_keeps_the_previous_checkpoint(tiny, tmp_path, trained):
    run = trained("four-steps", FOUR_STEPS, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in (run / "checkpoints" / "step_0000004").iterdir() if p.is_file()}
    ckpts = run / "checkpoints"  # not the whole run dir: files open for writing there (metrics) make remount busy
    script = (f'mount --bind "{ckpts}" "{ckpts}" && exec "{sys.executable}" -c \'{READ_ONLY_AFTER_CHECK}\' "{ckpts}" '
              + " ".join(f"'{a}'" for a in ["train", "--resume", "auto",
                                            *sets(tiny(**{"train.steps": 8, "train.checkpoint_every": 2}))]))
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 74, out.stdout[-2000:] + out.stderr
    lines = out.stderr.strip().splitlines()
    assert "Traceback" not in out.stderr and lines[-1].startswith("luban: error: "), out.stderr
    assert "checkpoint step 6 could not be written" in lines[-1] and "Read-only file system" in lines[-1], lines[-1]
    assert [p.name for p in checkpoint.step_dirs(run / "checkpoints")] == ["step_0000004", "step_0000002"]
    assert checkpoint.verify(run / "checkpoints" / "step_0000004") is None
    assert before == {p.name: p.read_bytes() for p in (run / "checkpoints" / "step_0000004").iterdir() if p.is_file()}
