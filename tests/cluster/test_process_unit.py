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
