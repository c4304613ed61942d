"""``kill -9`` of ``luban cluster serve`` at odd moments, then a restart: no job is lost, run twice
or charged twice (or charged for the crash), no process outlives its job, no node stays
allocated to a job that is gone. The service kills itself at the chosen point
(tests/cluster/crashpoints.py): a real crash, the database as committed, the jobs running on.

2026-11-28: an attempt claimed just before a crash (nothing started) was requeued as "never
launched" but charged node-hours from its claim to the restart: the whole outage, on every node.
A launcher's pid kept in a handle was trusted after its launcher died: once the system gave the
pid to another process, the job looked alive forever and `luban stop` sent SIGTERM to that
process."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from luban import procs
from luban.cluster.executors.local import LocalExecutor
from luban.cluster.launcher import node_tag
from tests.cluster import crashpoints
from tests.cluster.conftest import PYTHON, _launchers, wait_for

TRAINER = str(Path(__file__).with_name("fake_trainer.py"))
# one line per start of a rank (attempt, rank, pid), then a short run
COUNTER = ("import os, sys, time\nwith open(sys.argv[1], 'a') as f:\n"
           "    f.write(f\"{os.environ['LUBAN_JOB_ID']} {os.environ['LUBAN_NODE_RANK']} {os.getpid()}\\n\")\n"
           "time.sleep(float(sys.argv[2]))\n")


def crashing_service(service, monkeypatch, point: str, *args: str):
    """A service that kills itself with SIGKILL at ``point`` (once: its restart does not)."""
    # the fixture's own conftest module (pytest imports it under its own name, not tests.cluster.conftest)
    monkeypatch.setattr(sys.modules[service.__module__], "LUBAN", crashpoints.SERVE)
    monkeypatch.setenv(crashpoints.VAR, point)
    try:
        return service(*args)
    finally:
        monkeypatch.delenv(crashpoints.VAR)


def crashed(svc) -> None:
    wait_for(lambda: svc.proc.poll() is not None, 120, what="the service to kill itself at the crash point")
    assert svc.proc.returncode == -signal.SIGKILL, svc.log.read_text()[-2000:]


def allocations(svc) -> list[tuple[str, int, str]]:
    """(node, job id, that job's state) of every node allocation in the database."""
    with sqlite3.connect(svc.state / "luban.db") as db:
        return db.execute("SELECT a.node, a.job_id, j.state FROM allocations a "
                          "JOIN jobs j ON j.id = a.job_id").fetchall()


def chain(client, job_id: int) -> list[dict]:
    first = client.job(job_id)["chain_id"]
    return sorted((j for j in client.jobs(all_attempts=True) if j["chain_id"] == first), key=lambda j: j["id"])


def nothing_runs(svc, attempts: list[dict], pids=()) -> None:
    """No launcher of this service and no process of these attempts (by tag, and the pids given) is left."""
    def clear():
        tags = [node_tag(f"luban-{a['id']}-{a['chain_id']}", r) for a in attempts for r in range(a["nnodes"])]
        return not _launchers(svc.state) and not any(procs.members(t) for t in tags) and \
            not any(procs.alive(p) for p in pids)
    wait_for(clear, 60, what="every process of the jobs to end")


@pytest.mark.parametrize("point", ["claimed", "mid-start"])
def test_a_crash_while_a_job_starts(service, monkeypatch, tmp_path, point):
    svc = crashing_service(service, monkeypatch, point, "--nodes", "2", "--tick", "0.2")
    _, alice = svc.user("alice", {"NORMAL": 2})
    script, starts = tmp_path / "counter.py", tmp_path / "starts"
    script.write_text(COUNTER)
    job = alice.submit({"name": "two", "command": PYTHON, "args": [str(script), str(starts), "1"], "nodes": 2})["id"]
    crashed(svc)
    if point == "mid-start":  # rank 0 started: its job wrote its line
        wait_for(lambda: starts.exists() and starts.read_text().count("\n") == 1, 60, what="rank 0 of the first try")
    with sqlite3.connect(svc.state / "luban.db") as db:  # the claim is older than the launch grace (60 s)
        (state, handle), = db.execute("SELECT state, handle FROM jobs WHERE id = ?", (job,)).fetchall()
        assert (state, handle) == ("starting", None)
        db.execute("UPDATE jobs SET started_at = started_at - 600 WHERE id = ?", (job,))
    svc.start()
    assert alice.wait(job, timeout=120)["state"] == "succeeded"
    attempts = chain(alice, job)
    assert [a["state"] for a in attempts] == ["suspended", "succeeded"], attempts
    assert "LOST" in attempts[0]["stop_reasons"] and "never launched" in attempts[0]["reason"]
    assert attempts[0]["node_hours"] == 0, attempts[0]  # it never ran: the crash is not the user's to pay
    usage = {r["who"]: r["node_hours"] for r in alice.usage()}
    assert abs(usage["alice"] - attempts[1]["node_hours"]) < 1e-3, (usage, attempts)
    lines = [line.split() for line in starts.read_text().splitlines()]
    assert sorted(r for a, r, _ in lines if int(a) == attempts[1]["id"]) == ["0", "1"], lines  # ran once
    assert len(lines) == 2 + (point == "mid-start"), lines
    nothing_runs(svc, attempts, [int(p) for *_, p in lines])
    assert allocations(svc) == []


@pytest.mark.parametrize("point", ["suspending", "requeue"])
def test_a_crash_while_a_job_is_suspended_or_requeued(service, monkeypatch, tmp_path, point):
    svc = crashing_service(service, monkeypatch, point, "--nodes", "2", "--tick", "0.2", "--suspend-timeout", "60")
    _, alice = svc.user("alice", {"LOW": 2})
    _, bob = svc.user("bob", {"HIGH": 2})
    low = alice.submit({"name": "low", "command": PYTHON, "nodes": 2, "priority": "LOW", "workdir": str(tmp_path),
                        "args": [TRAINER, str(tmp_path / "low"), "30", "--sleep", "0.1"]})["id"]
    wait_for(lambda: "step 3\n" in alice.logs(low, 1)["text"], 90, what="the low job running")
    high = bob.submit({"name": "high", "command": "true", "nodes": 2, "priority": "HIGH"})["id"]
    crashed(svc)
    svc.start()
    assert bob.wait(high, timeout=120)["state"] == "succeeded"
    assert alice.wait(low, timeout=120)["state"] == "succeeded"
    attempts = chain(alice, low)
    assert [a["state"] for a in attempts] == ["suspended", "succeeded"], attempts  # requeued once, not lost
    assert attempts[0]["exit_code"] == 75
    ran = bob.job(high)
    assert ran["started_at"] >= attempts[0]["ended_at"] - 1e-6, (ran, attempts[0])  # never two jobs on a node
    for rank in range(2):
        log = alice.logs(low, rank)["text"]
        assert log.count("start: resumed at step") == 2 and "done at step 30" in log, log[-2000:]
    usage = {r["who"]: r["node_hours"] for r in alice.usage()}
    assert abs(usage["alice"] - sum(a["node_hours"] for a in attempts)) < 1e-3
    nothing_runs(svc, attempts + [ran])
    assert allocations(svc) == []


def test_a_handles_pid_that_now_belongs_to_another_process_is_not_the_job(tmp_path):
    """After a restart a handle's launcher pid may have been given to another process: the job is
    not running (its launcher died without an exit file: lost) and that process gets no signal."""
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        run_dir = tmp_path / "runs" / "9"
        run_dir.mkdir(parents=True)
        handle = json.dumps({"pids": [other.pid], "run_dir": str(run_dir), "tag": "luban-9-creuse"})
        executor = LocalExecutor()
        status = executor.poll(handle)
        assert status.done and status.lost, status
        executor.suspend(handle)
        executor.kill(handle)
        assert other.poll() is None and procs.alive(other.pid), "a process that is not the job's got a signal"
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait(10)


# A job that double-forks a daemon into a session of its own and exits while the service is down;
# where the job's cgroup can be made the daemon also drops LUBAN_JOB_TAG (only the cgroup holds it).
DAEMONIZER = r"""
import os, sys, time
out, go, clear = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if os.fork() == 0:
    os.setsid()
    if os.fork():
        os._exit(0)
    os.execve("/bin/sh", ["/bin/sh", "-c", f"echo $$ > {out}.tmp && mv {out}.tmp {out} && exec sleep 600"],
              {} if clear else dict(os.environ))
while not (os.path.exists(out) and os.path.exists(go)):
    time.sleep(0.05)
"""


def test_a_daemon_a_job_leaves_while_the_service_is_down_does_not_outlive_it(service, tmp_path):
    svc = service("--nodes", "1", "--tick", "0.2")
    _, alice = svc.user("alice", {"NORMAL": 1})
    script, pid_file, go = tmp_path / "daemonizer.py", tmp_path / "daemon.pid", tmp_path / "go"
    script.write_text(DAEMONIZER)
    clear = "1" if procs.cgroup2_root() is not None else "0"
    job = alice.submit({"name": "d", "command": PYTHON, "args": [str(script), str(pid_file), str(go), clear]})["id"]
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 60, what="the daemon")
    daemon = int(pid_file.read_text())
    svc.stop(signal.SIGKILL)
    go.touch()  # the job exits while the service is down, its daemon still running
    exit_file = svc.state / "runs" / str(job) / "rank0.exit"
    wait_for(exit_file.exists, 60, what="the job's end")
    assert not procs.alive(daemon), "the daemon outlived its job"
    svc.start()
    ended = alice.wait(job, timeout=60)
    assert ended["state"] == "succeeded"
    nothing_runs(svc, [ended], [daemon])
    assert allocations(svc) == []
