"""The executors when what they drive misbehaves: Slurm's commands down, slow, missing or printing
garbage (fake ``sbatch``/``scontrol``/``scancel`` on PATH, no Slurm needed), and a local start
that fails part way. An attempt is never declared lost while it may still run, and an attempt
that failed to start leaves nothing running."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from luban import procs
from luban.cluster import launcher
from luban.cluster.executors import Launch, Unavailable
from luban.cluster.executors import slurm as slurm_module
from luban.cluster.executors.local import LocalExecutor
from luban.cluster.executors.slurm import SlurmExecutor
from luban.errors import LubanError
from tests.cluster.conftest import _launchers


def fake_slurm(tmp_path: Path, monkeypatch, **scripts: str) -> Path:
    """Put shell scripts named like Slurm's commands first on PATH; every call is appended to calls.log."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.log"
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n{body}\n')
        path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return calls


def a_launch(tmp_path: Path, nodes: int = 1, command: list[str] | None = None) -> Launch:
    return Launch(job_id=7, name="luban-7-cfault", nodes=[f"node{i + 1}" for i in range(nodes)],
                  command=command or ["true"], env={"PATH": os.environ["PATH"]}, run_dir=str(tmp_path / "runs" / "7"),
                  log_pattern=str(tmp_path / "logs" / "rank{rank}.log"))


def handle(tmp_path: Path, slurm_id: str = "42") -> str:
    (tmp_path / "runs" / "7").mkdir(parents=True, exist_ok=True)
    return json.dumps({"slurm_id": slurm_id, "run_dir": str(tmp_path / "runs" / "7"), "ranks": 1,
                       "tag": "luban-7-cfault"})


def test_slurmctld_down_is_not_a_lost_job(tmp_path, monkeypatch):
    """2026-11-28: any scontrol failure read as "forgotten by slurmctld": with the controller down for
    a moment every running attempt was declared lost (failed, LOST) while Slurm ran it on."""
    fake_slurm(tmp_path, monkeypatch, scontrol='echo "slurm_load_jobs error: Unable to contact slurm controller '
                                               '(connect failure)" >&2; exit 1')
    status = SlurmExecutor(state_dir=str(tmp_path)).poll(handle(tmp_path))
    assert not status.done and not status.lost


def test_a_job_slurmctld_forgot_is_read_from_its_exit_files_or_lost(tmp_path, monkeypatch):
    fake_slurm(tmp_path, monkeypatch, scontrol='echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1')
    executor, h = SlurmExecutor(state_dir=str(tmp_path)), handle(tmp_path)
    assert executor.poll(h).lost
    launcher.write_atomic(launcher.exit_file(tmp_path / "runs" / "7", 0), "3")
    status = executor.poll(h)
    assert status.done and status.exit_code == 3 and not status.lost


@pytest.mark.parametrize("sbatch", ['echo "Submitted batch job 12"', 'printf "\\033]0;x\\007\\n"', "sleep 30"],
                         ids=["not-parsable", "garbage", "hangs"])
def test_an_sbatch_whose_job_cannot_be_followed_fails_the_start_and_cancels_it(tmp_path, monkeypatch, sbatch):
    """2026-11-28: an sbatch that printed something else than a job id was taken as the id (the
    attempt then looked lost while its Slurm job ran); one that timed out raised TimeoutExpired, the
    attempt failed and a job it may have submitted ran on. Now: one line, and scancel by its name."""
    calls = fake_slurm(tmp_path, monkeypatch, sbatch=sbatch, scancel="exit 0")
    monkeypatch.setattr(slurm_module, "TIMEOUT_S", 1)
    with pytest.raises(RuntimeError) as err:
        SlurmExecutor(state_dir=str(tmp_path)).start(a_launch(tmp_path))
    assert "\n" not in str(err.value), err.value
    assert "scancel --name=luban-7-cfault" in calls.read_text()


def test_missing_slurm_commands_are_one_line(tmp_path, monkeypatch):
    """Before a service starts (``check``): a LubanError naming every command missing. After: an
    outage (``Unavailable``), so a job whose start meets a missing ``sbatch`` waits and is not failed,
    and nothing is cancelled for a submission that never happened."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch, no scontrol
    executor = SlurmExecutor(state_dir=str(tmp_path))
    with pytest.raises(LubanError, match="not found: sbatch, squeue, scontrol, scancel"):
        executor.check()
    with pytest.raises(Unavailable, match="sbatch not found: install slurm-wlm"):
        executor.start(a_launch(tmp_path))
    with pytest.raises(Unavailable, match="scontrol not found"):
        executor.discover()
    calls = fake_slurm(tmp_path, monkeypatch, squeue=":", scancel="exit 0")  # no sbatch: nothing to cancel
    with pytest.raises(Unavailable, match="sbatch not found"):
        executor.start(a_launch(tmp_path))
    assert "scancel" not in calls.read_text() and not (tmp_path / "runs" / "7" / slurm_module.CANCELLED).exists()


def test_a_local_start_that_fails_part_way_leaves_nothing_running(tmp_path, monkeypatch):
    """2026-11-28: when the second rank's launcher could not be started (fork refused at the process
    limit, E2BIG) the attempt failed but the first rank's launcher and its job ran on."""
    real, calls, started = launcher.spawn, [], []

    def second_fails(argv, **popen):
        calls.append(argv)
        if len(calls) == 2:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        started.append(real(argv, **popen))
        return started[-1]

    monkeypatch.setattr(launcher, "spawn", second_fails)
    executor = LocalExecutor(nodes=2)
    launch = a_launch(tmp_path, nodes=2, command=["sleep", "600"])
    try:
        with pytest.raises(BlockingIOError):
            executor.start(launch)
        assert started and all(p.poll() is not None for p in started), "a launcher of the failed start runs on"
        assert not _launchers(tmp_path)
        assert not procs.tagged(launcher.node_tag(launch.name, 0)), "the job of the failed start is still running"
    finally:
        for pid in _launchers(tmp_path):
            os.killpg(pid, 9)
        procs.kill_job(launcher.node_tag(launch.name, 0))


def test_a_launcher_that_writes_its_exit_file_and_ends_between_two_looks_is_not_lost(tmp_path, monkeypatch):
    """``poll`` looked for the exit file, then for the launcher: one that wrote its file and ended in
    between read as "lost: launcher gone, no exit code", and a job that succeeded failed (four
    schedulers under load, tests/cluster/test_quota_concurrency.py, 1 run in 6; 2026-11-28)."""
    executor = LocalExecutor()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    handle = json.dumps({"pids": [2 ** 22 + 1], "run_dir": str(run_dir), "tag": "none"})

    def ends_now(handle, pid):  # the launcher's last act, then it is gone
        launcher.exit_file(run_dir, 0).write_text("0")
        return False

    monkeypatch.setattr(executor, "_live", ends_now)
    status = executor.poll(handle)
    assert (status.done, status.exit_code, status.lost) == (True, 0, False), status
