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

from tests.child import read_lines, wait_or_fail
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
        code = wait_or_fail(job, 300, lambda: (case / "log0").read_text())
        log = (case / "log0").read_text()
        outcomes[delay] = code
        assert code in (0, 75), f"delay {delay}: exit {code}\n{log[-3000:]}"
        assert procs.members(launcher.node_tag(tag, 0)) == [], f"delay {delay}: survivors"
        assert "Traceback" not in log, log[-3000:]
    assert 75 in outcomes.values()


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("start_at", ["step 1/", "step 4/4"])
def test_signal_storm_through_training_and_shutdown_never_kills_a_rank(tmp_path, start_at):
    """SIGUSR1 every 20 ms from the first (or the last) step's line until the job exits: signals
    reach the ranks while they train, save and shut down. CPython's finalisation resets Python
    signal handlers to the default action, so without ``preempt.settle`` a late one killed a rank
    that had finished (CI: exit 138 after step 400/400), or the node launcher itself (-10)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(tiny_toml(tmp_path / "run", {"steps": 4, "global_batch": 2, "checkpoint_every": 2,
                                                "eval_every": 0}, parallel={"dp": 2}))
    tag = f"luban-storm-{os.getpid()}"
    log_path = tmp_path / "log0"
    job = launcher.spawn(["--run-dir", str(tmp_path), "--log", str(tmp_path / "log{rank}"), "--rank", "0", "--tag", tag,
                          "--", sys.executable, "-m", "luban", "train", str(cfg), "--nproc", "2"], cwd=ROOT,
                         start_new_session=True)
    deadline, sent = time.monotonic() + 300, 0
    while job.poll() is None and time.monotonic() < deadline:
        if sent or (log_path.exists() and start_at in log_path.read_text()):
            try:
                job.send_signal(signal.SIGUSR1)
                sent += 1
            except ProcessLookupError:
                break
        time.sleep(0.02)
    code = wait_or_fail(job, 60, log_path.read_text)
    log = log_path.read_text()
    assert sent > 0, log[-3000:]
    assert code in (0, 75), f"exit {code} after {sent} signals\n{log[-3000:]}"
    assert "Traceback" not in log, log[-3000:]
    assert procs.members(launcher.node_tag(tag, 0)) == [], "survivors"


def test_leave_exits_with_the_code_without_interpreter_teardown():
    """preempt.leave: with torch loaded, flushed output and the decided code via os._exit (no C++
    destructors, which aborted suspended ranks with 134); without torch it returns to Python."""
    script = ("import sys, atexit; from luban.train import preempt; atexit.register(print, 'teardown ran');"
              "preempt.leave(3); print('returned'); import torch; print('buffered', end=''); preempt.leave(75)")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 75, done.stderr
    assert done.stdout == "returned\nbuffered"  # flushed; atexit (interpreter teardown) never ran


@pytest.mark.slow
@pytest.mark.multirank
def test_a_rank_killed_mid_run_is_one_line_and_no_traceback(tmp_path):
    """kill -9 of one rank of ``luban train --nproc 2``: the launcher names it in one line and exits
    128 + 9; the surviving rank, whose collective failed, prints no traceback (it printed ~36
    lines: a hostile sweep, 2026-11-27) and nothing of either rank outlives the launcher."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(tiny_toml(tmp_path / "run", {"steps": 100000, "global_batch": 2, "checkpoint_every": 0,
                                                "eval_every": 0}, parallel={"dp": 2}))
    err = tmp_path / "err"
    with open(err, "w") as stderr, open(tmp_path / "out", "w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "luban", "train", str(cfg), "--nproc", "2"], cwd=ROOT,
                                stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "step 5/" not in (tmp_path / "out").read_text():  # both ranks are in their training loop
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "out").read_text() + err.read_text()
            time.sleep(0.5)
        ranks = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                text=True, timeout=30).stdout.split()]
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        code = wait_or_fail(proc, 120, err.read_text)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in err.read_text().splitlines() if "find_unused_parameters" not in line]  # torch's DDP note
    assert code == 137 and lines == ["luban: error: rank 1 was killed by SIGKILL; the other ranks were stopped "
                                     "(exit 137; resume with --resume auto)"], err.read_text()
    assert all(not Path(f"/proc/{pid}").exists() for pid in ranks)


@pytest.mark.multirank
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_closed_output_pipe_suspends_the_run_with_a_checkpoint(tmp_path, nproc):
    """`luban train ... | head -3`: the reader goes away after 3 lines. The run used to end at once
    (exit 141), losing every step since its last checkpoint; now it saves at the end of the step
    and exits 75, and `--resume auto` goes on from there."""
    run = tmp_path / "run"
    cfg = tmp_path / "c.toml"
    cfg.write_text(tiny_toml(run, {"steps": 2000, "global_batch": 2, "checkpoint_every": 0, "eval_every": 0,
                                   "log_every": 1}, parallel={"dp": nproc}, run_keys={"progress": "plain"}))
    err_path = tmp_path / "stderr"
    with open(err_path, "wb") as err:
        job = subprocess.Popen([sys.executable, "-m", "luban", "train", str(cfg), "--nproc", str(nproc)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        try:  # as head -3 does: read three lines, then close the pipe
            lines = read_lines(job, 3, 300, err_path.read_text)
        finally:
            job.stdout.close()
        code = wait_or_fail(job, 300, err_path.read_text)
    stderr = err_path.read_text()
    assert len(lines) == 3 and code == 75, (lines, code, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    saved = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved and int(saved[-1].removeprefix("step_")) >= 1, saved
    assert "suspended on a closed output pipe" in stderr, stderr[-3000:]
