"""Signals at any moment of start-up: a SIGUSR1 sent to a job's node launcher at once, or while
``luban train --nproc 2`` imports torch, starts its ranks or trains, always ends in exit 75
(or 0 if training finished first) — never a killed launcher, never a rank left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from luban import procs
from luban.cluster import launcher
from tests.conftest import tiny_toml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.multirank
def test_sigusr1_at_any_moment_of_start_up_gives_75_and_no_survivor(tmp_path):
    outcomes = {}
    for delay in (0.0, 0.4, 1.5, 4.0, 9.0):  # spawn, interpreter start, torch import, rank start, training
        case = tmp_path / f"d{delay}"
        case.mkdir()
        cfg = case / "c.toml"
        cfg.write_text(tiny_toml(case / "run", {"steps": 400, "global_batch": 2, "checkpoint_every": 0,
                                                "eval_every": 0}, parallel={"dp": 2}))
        tag = f"luban-sigtest-{os.getpid()}-{delay}"
        job = launcher.spawn(["--run-dir", str(case), "--log", str(case / "log{rank}"), "--rank", "0", "--tag", tag,
                              "--", sys.executable, "-m", "luban", "train", str(cfg), "--nproc", "2"], cwd=ROOT,
                             start_new_session=True)
        time.sleep(delay)
        job.send_signal(signal.SIGUSR1)
        code = job.wait(300)
        log = (case / "log0").read_text()
        outcomes[delay] = code
        assert code in (0, 75), f"delay {delay}: exit {code}\n{log[-3000:]}"
        assert procs.members(launcher.node_tag(tag, 0)) == [], f"delay {delay}: survivors"
        assert "Traceback" not in log, log[-3000:]
    assert 75 in outcomes.values()
