"""A job's processes are one unit (luban.procs): whatever a job starts — children in sessions of
their own, double-forked daemons, the ranks of ``luban train --nproc N`` — ends with it, on stop,
on kill, when its main process exits, and when a launcher is killed with -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from luban import procs
from luban.cluster.launcher import node_tag, speaks_suspend
from tests.cluster.conftest import PYTHON, ROOT, wait_for

# A job that escapes its process group twice over: a child in a new session and a daemon that
# double-forks into another; it writes their pids, then stays (mode "stay") or exits at once,
# leaving them behind ("leave").
SPAWNER = r"""
import os, subprocess, sys, time
out, mode = sys.argv[1], sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
pid = os.fork()
if pid == 0:
    os.setsid()
    if os.fork():
        os._exit(0)
    with open(out + ".daemon.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(out + ".daemon.tmp", out + ".daemon")
    time.sleep(600)
    os._exit(0)
os.waitpid(pid, 0)
with open(out + ".child.tmp", "w") as f:
    f.write(str(child.pid))
os.rename(out + ".child.tmp", out + ".child")
print("spawned", flush=True)
if mode == "stay":
    time.sleep(600)
"""


def spawned(prefix: Path) -> list[int]:
    wait_for(lambda: all(Path(f"{prefix}.{k}").exists() for k in ("child", "daemon")), 60, what="spawned pids")
    return [int(Path(f"{prefix}.{k}").read_text()) for k in ("child", "daemon")]


def with_env(name: str, value: str) -> list[int]:
    """Live processes whose environment has ``name=value``."""
    needle, out = f"{name}={value}".encode(), []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if needle in Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0") and procs.alive(
                        int(entry.name)):
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def gone(pids) -> bool:
    return not any(procs.alive(p) for p in pids)


@pytest.fixture
def spawner(tmp_path):
    path = tmp_path / "spawner.py"
    path.write_text(SPAWNER)
    return path


def run_launcher(tmp_path, tag, command):
    """The node launcher as rank 0: its processes carry node_tag(tag, 0)."""
    return subprocess.Popen([PYTHON, "-m", "luban.cluster.launcher", "--run-dir", str(tmp_path / "run"), "--log",
                             str(tmp_path / "rank{rank}.log"), "--rank", "0", "--tag", tag, "--", *command], cwd=ROOT)


def test_sigterm_to_the_node_launcher_kills_every_process_of_the_job(tmp_path, spawner):
    tag = f"luban-test-{os.getpid()}-term"
    launcher = run_launcher(tmp_path, tag, [PYTHON, str(spawner), str(tmp_path / "p"), "stay"])
    pids = spawned(tmp_path / "p")
    assert all(procs.alive(p) for p in pids) and set(pids) <= set(procs.members(node_tag(tag, 0)))
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(60) == 137
    assert gone(pids) and procs.members(node_tag(tag, 0)) == []
    assert (tmp_path / "run" / "rank0.exit").read_text() == "137"  # written only once nothing is left
    assert "killed (all processes of the job ended)" in (tmp_path / "rank0.log").read_text()


def test_what_a_job_leaves_behind_dies_when_it_exits(tmp_path, spawner):
    tag = f"luban-test-{os.getpid()}-leave"
    launcher = run_launcher(tmp_path, tag, [PYTHON, str(spawner), str(tmp_path / "p"), "leave"])
    assert launcher.wait(60) == 0
    pids = spawned(tmp_path / "p")
    assert gone(pids) and procs.members(node_tag(tag, 0)) == []


def test_kill_job_finds_processes_by_tag_alone(tmp_path, spawner):
    tag = f"luban-test-{os.getpid()}-tag"
    job = subprocess.Popen([PYTHON, str(spawner), str(tmp_path / "p"), "stay"], start_new_session=True,
                           env=dict(os.environ, **{procs.TAG_VAR: tag}))
    pids = spawned(tmp_path / "p")
    assert set(pids) | {job.pid} <= set(procs.tagged(tag))
    assert procs.kill_job(tag) == []
    job.wait(10)
    assert gone(pids)


def test_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path):
    code = ("import sys; from luban.parallel.launch import launch; "
            f"sys.exit(launch(['suspend', {str(tmp_path)!r}], nproc=2, module='tests.parallel._launch_child'))")
    launcher = subprocess.Popen([PYTHON, "-c", code], cwd=ROOT)
    wait_for(lambda: all((tmp_path / f"ready{r}").exists() for r in (0, 1)), 60, what="ranks ready")
    ranks = with_env(procs.PARENT_VAR, str(launcher.pid))
    assert len(ranks) == 2
    assert len({os.getpgid(r) for r in ranks}) == 1 and os.getpgid(ranks[0]) != os.getpgid(launcher.pid)
    launcher.kill()
    launcher.wait(10)
    wait_for(lambda: gone(ranks), 30, what="ranks to follow their launcher (PR_SET_PDEATHSIG)")


def test_which_commands_hold_early_signals():
    assert speaks_suspend(["luban", "train", "c.toml"]) and speaks_suspend(["/v/bin/luban", "demo"])
    assert speaks_suspend([sys.executable, "-m", "luban", "train", "c.toml"])
    assert not speaks_suspend(["luban", "plan", "search"]) and not speaks_suspend(["python", "train.py"])


def test_stop_returns_only_when_nothing_of_the_job_runs(service, tmp_path, spawner):
    svc = service("--nodes", "1", "--tick", "0.2")
    token, alice = svc.user("alice", {"NORMAL": 1})
    job = alice.submit({"name": "escaper", "command": PYTHON, "args": [str(spawner), str(tmp_path / "p"), "stay"]})
    pids = spawned(tmp_path / "p")
    tag = node_tag(f"luban-{job['id']}-{alice.job(job['id'])['chain_id']}", 0)
    assert set(pids) <= set(procs.members(tag))
    out = svc.cli("stop", str(job["id"]), token=token).stdout
    assert f"job {job['id']} stopped" in out
    assert gone(pids) and procs.members(tag) == []  # at the moment `luban stop` returned


# -- exactly once across a service crash ---------------------------------------------------------
COUNTER = "import os, sys, time\nopen(sys.argv[1], 'a').write(f'{os.getpid()}\\n')\ntime.sleep(600)\n"


def _crash_between_start_and_record(svc, job_id: int) -> None:
    """kill -9 the service, then make the database look as if it died after starting the job but
    before recording its handle (the window the issue names), long enough ago to be looked at."""
    import sqlite3

    svc.stop(signal.SIGKILL)
    with sqlite3.connect(svc.state / "luban.db") as db:
        db.execute("UPDATE jobs SET handle = NULL, started_at = started_at - 600 WHERE id = ?", (job_id,))


@pytest.mark.parametrize("executor", ["local", pytest.param("slurm", marks=pytest.mark.exclusive("slurm"))])
def test_a_job_started_before_a_crash_is_adopted_not_run_twice(service, tmp_path, executor):
    args = ("--nodes", "1", "--tick", "0.2") if executor == "local" else ("--executor", "slurm", "--tick", "0.3")
    if executor == "slurm":
        from tests.cluster.conftest import require
        from tests.cluster.test_slurm import slurm_nodes

        require(bool(slurm_nodes()), "a Slurm cluster (sinfo lists idle nodes)")
    svc = service(*args)
    group = svc.admin().nodes()[0]["node_group"]
    token, alice = svc.user("alice", {"NORMAL": 1}, node_group=group)
    script, starts = tmp_path / "counter.py", tmp_path / "starts"
    script.write_text(COUNTER)
    job = alice.submit({"name": "once", "command": PYTHON, "args": [str(script), str(starts)]})["id"]
    wait_for(lambda: starts.exists() and alice.job(job)["state"] == "running", 60, what="job running")
    _crash_between_start_and_record(svc, job)
    again = service(*args, state=svc.state)
    wait_for(lambda: any(e["kind"] == "adopt" for e in again.admin().events(job)), 60, what="adoption")
    time.sleep(1.0)  # a few ticks: a second copy would have started by now
    assert len(starts.read_text().split()) == 1
    assert again.admin().job(job)["state"] == "running" and len(again.admin().jobs(all_attempts=True)) == 1
    pid = int(starts.read_text().split()[0])
    again.cli("stop", str(job))
    wait_for(lambda: not procs.alive(pid), 30, what="the job's process to end")


def test_a_partial_start_before_a_crash_is_killed_and_requeued(service, tmp_path):
    svc = service("--nodes", "2", "--tick", "0.2")
    token, alice = svc.user("alice", {"NORMAL": 2})
    script, starts = tmp_path / "counter.py", tmp_path / "starts"
    script.write_text(COUNTER)
    job = alice.submit({"name": "two", "command": PYTHON, "args": [str(script), str(starts)], "nodes": 2})["id"]
    wait_for(lambda: starts.exists() and len(starts.read_text().split()) == 2, 60, what="both ranks")
    first = [int(p) for p in starts.read_text().split()]
    _crash_between_start_and_record(svc, job)
    # as if the crash came while the second launcher was being started: only rank 0 exists
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"luban.cluster.launcher" in argv and argv[argv.index(b"--rank") + 1] == b"1" and \
                    str(svc.state).encode() in b" ".join(argv):
                os.kill(int(entry.name), signal.SIGKILL)
    again = service("--nodes", "2", "--tick", "0.2", state=svc.state)
    wait_for(lambda: len(again.admin().jobs(all_attempts=True)) == 2, 60, what="requeued attempt")
    assert again.admin().job(job)["state"] == "suspended" and "LOST" in again.admin().job(job)["stop_reasons"]
    wait_for(lambda: gone(first), 30, what="the partial first copy to be killed")


def test_node_down_and_service_shutdown_end_every_process(service, tmp_path, spawner):
    svc = service("--nodes", "2", "--tick", "0.2", "--suspend-timeout", "2", "--on-shutdown", "kill")
    token, alice = svc.user("alice", {"NORMAL": 2})
    job = alice.submit({"name": "a", "command": PYTHON, "args": [str(spawner), str(tmp_path / "a"), "stay"]})["id"]
    first = spawned(tmp_path / "a")
    node = alice.job(job)["nodes"][0]
    svc.cli("admin", "node", "down", node)  # the spawner ignores SIGUSR1's checkpoint: killed after 2 s
    wait_for(lambda: gone(first), 60, what="the job on the downed node to end")
    for k in ("child", "daemon"):
        Path(f"{tmp_path / 'a'}.{k}").unlink()
    wait_for(lambda: alice.latest(job)["nodes"] not in ([], [node]), 60, what="the requeued attempt elsewhere")
    pids = spawned(tmp_path / "a")  # the second attempt's, on the other node
    assert first[0] not in pids and all(procs.alive(p) for p in pids)
    svc.stop()  # SIGTERM: --on-shutdown kill ends every job before the service exits
    assert gone(pids)
