"""``luban.parallel.launch``: torchrun-style environment, signal forwarding, failure handling."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from luban.parallel.launch import host_cores, launch, rank_env, rank_threads, slurm_defaults
from tests.child import Child

CHILD = "tests.parallel._launch_child"


def test_children_get_torchrun_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch(["env", str(tmp_path)], nproc=2, nnodes=2, node_rank=1, master_port=29555, module=CHILD) == 0
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in (2, 3)]
    assert [(e["RANK"], e["LOCAL_RANK"]) for e in envs] == [("2", "0"), ("3", "1")]
    assert all(e["WORLD_SIZE"] == "4" and e["LOCAL_WORLD_SIZE"] == "2" and e["MASTER_PORT"] == "29555" for e in envs)
    assert all(e["OMP_NUM_THREADS"] == str(rank_threads(host_cores(), 2)) for e in envs)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the caller's choice wins
    assert launch(["env", str(tmp_path)], nproc=2, module=CHILD) == 0
    assert json.loads((tmp_path / "env0.json").read_text())["OMP_NUM_THREADS"] == "3"


def test_rank_threads_share_the_cores():
    assert [rank_threads(16, n) for n in (1, 2, 4, 8, 32)] == [16, 8, 4, 2, 1]
    assert rank_threads(2, 4) == 1 and rank_threads(3, 2) == 1


def _launch_in_subprocess(mode, tmp_path) -> Child:
    """A launch of 2 ranks of _launch_child in a child process, once both ranks are ready."""
    code = (f"import sys; from luban.parallel.launch import launch; "
            f"sys.exit(launch([{mode!r}, {str(tmp_path)!r}], nproc=2, module={CHILD!r}))")
    child = Child([sys.executable, "-c", code], log=tmp_path / "launch.log", cwd=os.getcwd(),
                  start_new_session=False)  # signals go to the launcher, as from a terminal or scheduler
    deadline = time.monotonic() + 300
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            raise AssertionError(f"ranks not ready (launcher exit {child.returncode})\n{child.tail()}")
        time.sleep(0.1)
    return child


def test_sigusr1_is_forwarded_and_suspension_reported(tmp_path):
    with _launch_in_subprocess("suspend", tmp_path) as proc:
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(300) == 75, proc.tail()  # the ranks sleep 3600 s unless the signal reaches them


def test_failed_rank_kills_the_others(tmp_path):
    with _launch_in_subprocess("fail", tmp_path) as proc:
        assert proc.wait(300) == 3, proc.tail()  # rank 0 sleeps 3600 s unless the launcher terminates it


def test_slurm_variables():
    env = {"SLURM_JOB_ID": "1234", "SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_PROCID": "9",
           "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}
    defaults = slurm_defaults(env)
    assert (defaults["nnodes"], defaults["node_rank"], defaults["master_port"]) == (4, 2, 21234)
    assert rank_env(env) == {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1"}
    assert rank_env({**env, "RANK": "0", "WORLD_SIZE": "2"}) == {"RANK": "0", "WORLD_SIZE": "2"}


def test_multinode_needs_a_port():
    with pytest.raises(ValueError, match="master_port"):
        launch(["env", "/nonexistent"], nproc=1, nnodes=2, module=CHILD)
