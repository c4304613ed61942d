"""A fake Slurm for the scheduler's tests: shell scripts named like Slurm's commands (``sbatch``,
``scontrol``, ``squeue``, ``scancel``) first on PATH, with nothing else, an injected clock, SQLite. The
``slurm`` fixture (conftest.py) is ``setup``; the helpers read what the scheduler did.

Each fake command: the file "down" makes it fail as Slurm's commands do without slurmctld, "hang"
makes it outlive TIMEOUT_S, "sbatch-down" fails sbatch alone (a partial outage); scontrol answers
from the file "job" (default: the job runs) and lists the nodes of the file "nodes" (default: two)."""

from __future__ import annotations

import logging
import shutil

from sqlalchemy import func, select

from luban.cluster.executors import slurm as slurm_module
from luban.cluster.executors.slurm import SlurmExecutor
from luban.cluster.models import Job
from tests.cluster.test_clock import FakeTime

DOWN = 'echo "$0: error: Unable to contact slurm controller (connect failure)" >&2; exit 1'
FAKES = {
    "sbatch": 'if [ -f "$D/sbatch-down" ]; then ' + DOWN + '; fi; echo 4242',  # sbatch alone down: a partial outage
    "scontrol": 'if [ "$2" = node ] && [ -f "$D/nodes" ]; then cat "$D/nodes"; '
                'elif [ "$2" = node ]; then echo "NodeName=node1 Partitions=debug AvailableFeatures=zone1"; '
                'echo "NodeName=node2 Partitions=debug AvailableFeatures=zone1"; '
                'elif [ -f "$D/job" ]; then cat "$D/job"; else echo "JobId=4242 JobState=RUNNING ExitCode=0:0"; fi',
    "squeue": ':',
    "scancel": ':',
}


def setup(tmp_path, monkeypatch, caplog, in_process):
    """The ``slurm`` fixture (tests/cluster/conftest.py): (scheduler, submit(), fake-Slurm folder, its
    calls.log, FakeTime) over SQLite, the service in this process (``in_process``, which disposes it)."""
    fake = tmp_path / "fake"
    bin_dir = fake / "bin"
    bin_dir.mkdir(parents=True)
    calls = fake / "calls.log"
    tools = fake / "tools"  # what the fakes use, and no real Slurm command: PATH holds only these two
    tools.mkdir()
    for tool in ("cat", "sleep"):
        (tools / tool).symlink_to(shutil.which(tool))
    for name, body in FAKES.items():
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nD={fake}\necho "{name} $*" >> {calls}\n'
                        f'if [ -f "$D/hang" ]; then sleep 30; fi\nif [ -f "$D/down" ]; then {DOWN}; fi\n{body}\n')
        path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{tools}")
    monkeypatch.setattr(slurm_module, "TIMEOUT_S", 1)
    t = FakeTime()
    state = tmp_path / "state"
    api = in_process(executor=SlurmExecutor(state_dir=str(state)), state=state, time=t)
    token = api.user("alice", 2, node_group="debug")

    def submit() -> int:
        r = api.http.post("/api/jobs", json={"spec": {"name": "j", "command": "true"}},
                          headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 201, r.text
        return r.json()["id"]

    caplog.set_level(logging.DEBUG, logger="luban.cluster")
    return api.scheduler, submit, fake, calls, t


def job(scheduler, job_id: int) -> Job:
    with scheduler.sessions() as s:
        return s.get(Job, job_id)


def count(scheduler, what) -> int:
    with scheduler.sessions() as s:
        return s.scalar(select(func.count()).select_from(what))


def logged(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def no_tracebacks(caplog) -> None:
    assert not [r for r in caplog.records if r.exc_info], \
        [r.getMessage() for r in caplog.records if r.exc_info][:3]


def running_job(scheduler, submit) -> int:
    """A job submitted, started and seen running (two ticks)."""
    j = submit()
    scheduler.guarded_tick()  # started
    scheduler.guarded_tick()  # seen running
    assert job(scheduler, j).state == "running"
    return j


def ticks(scheduler, t, n: int, seconds: float = 1) -> None:
    """``n`` ticks, ``seconds`` of the fake clock before each."""
    for _ in range(n):
        t.elapse(seconds)
        scheduler.guarded_tick()
