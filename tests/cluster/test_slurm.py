"""The Slurm executor against real daemons (slurmctld + slurmd node1..node4 from .ci/services.sh)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cluster.conftest import PYTHON, require, wait_for

TRAINER = str(Path(__file__).with_name("fake_trainer.py"))
# one 4-node cluster for the whole run: a test that waits for 4 idle nodes, or whose jobs must
# preempt each other, must not share it with another worker's Slurm jobs
pytestmark = pytest.mark.exclusive("slurm")


def slurm_nodes() -> list[str]:
    if not shutil.which("sinfo"):
        return []
    result = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
    return sorted(line.split()[0] for line in result.stdout.splitlines() if line.split()[1:2] == ["idle"])


def sleeping_launch(tmp_path: Path, tag: str, i: int):
    """Job ``i`` of a test's own Slurm jobs (``tag``): ``sleep 300`` on node1, exclusive."""
    import os

    from luban.cluster.executors import Launch

    return Launch(job_id=i, name=f"luban-{i}-c{tag}", nodes=["node1"], command=["sleep", "300"],
                  env={"PATH": os.environ["PATH"], "LUBAN_CLUSTER_TOKEN": f"t{i}"},
                  run_dir=str(tmp_path / "runs" / str(i)), log_pattern=str(tmp_path / f"{i}-rank{{rank}}.log"))


def squeue_listed(name: str) -> list[str]:
    """``squeue``'s job id and state of the job called ``name`` (empty: not in Slurm's queue)."""
    return subprocess.run(["squeue", "-h", "-n", name, "-o", "%i %T"], capture_output=True, text=True,
                          timeout=60).stdout.split()


@pytest.fixture
def slurm(service):
    require(bool(shutil.which("sinfo")) and bool(slurm_nodes()), "a Slurm cluster (sinfo lists idle nodes)")
    wait_for(lambda: len(slurm_nodes()) >= 4, 60, 1, "4 idle Slurm nodes (node1..node4, .ci/services.sh)")
    svc = service("--executor", "slurm", "--tick", "0.3", "--suspend-timeout", "60")
    yield svc
    for line in subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, timeout=300).stdout.splitlines():
        if line.split()[1].startswith("luban-") and str(svc.state) in slurm_job(line.split()[0]).get("Command", ""):
            subprocess.run(["scancel", line.split()[0]], timeout=300)


def slurm_job(name_or_id: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", name_or_id], capture_output=True, text=True, timeout=300).stdout
    return dict(t.partition("=")[::2] for t in out.split())


def test_nodes_come_from_slurm(slurm):
    names = {n["name"]: n for n in slurm.admin().nodes()}
    assert set(slurm_nodes()) <= set(names)
    group = names["node1"]["node_group"]
    assert group == subprocess.run(["sinfo", "-h", "-n", "node1", "-o", "%R"], capture_output=True,
                                   text=True, timeout=300).stdout.split()[0]
    assert names["node1"]["labels"]["zone"] == "zone1" and names["node4"]["labels"]["zone"] == "zone2"


def test_preempt_checkpoint_resume_on_slurm(slurm, tmp_path):
    group = slurm.admin().nodes()[0]["node_group"]
    alice_token, alice = slurm.user("alice", {"LOW": 3}, node_group=group)
    _, bob = slurm.user("bob", {"HIGH": 2}, node_group=group)
    out = slurm.cli("submit", "-n", "3", "-p", "LOW", "--name", "low", "--workdir", str(tmp_path), "--",
                    PYTHON, TRAINER, str(tmp_path / "low"), "40", "--sleep", "0.1", token=alice_token).stdout
    low = int(re.search(r"submitted job (\d+)", out).group(1))
    wait_for(lambda: "step 5\n" in alice.logs(low, 2)["text"], 90, 0.5, "low job progress on Slurm")
    first = alice.job(low)
    name = f"luban-{low}-{first['chain_id']}"
    slurm_id = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True, timeout=300).stdout.strip()
    sl = slurm_job(slurm_id)
    assert sl["JobName"] == name and sl["OverSubscribe"] == "NO"  # --exclusive
    assert sl["NumNodes"] == "3" and sl["JobState"] == "RUNNING"
    high = bob.submit({"name": "high", "command": PYTHON, "args": ["-c", "import time; time.sleep(1)"],
                       "nodes": 2, "priority": "HIGH"})["id"]
    assert bob.wait(high, timeout=180)["state"] == "succeeded"
    assert alice.wait(low, timeout=180)["state"] == "succeeded"
    chain = [j for j in alice.jobs(all_attempts=True) if j["chain_id"] == first["chain_id"]]
    assert [j["state"] for j in chain] == ["suspended", "succeeded"]
    assert chain[0]["exit_code"] == 75 and "PREEMPTED" in chain[0]["stop_reasons"]
    assert set(chain[0]["nodes"]) & set(bob.job(high)["nodes"])
    for rank in range(3):
        log = alice.logs(low, rank)["text"]
        saved = int(re.search(r"checkpoint at step (\d+)", log).group(1))
        assert f"resumed at step {saved}" in log and "done at step 40" in log
    node_names = {re.search(r"on (node\d+) as ", line).group(1)
                  for line in alice.logs(low, 0)["text"].splitlines() if "started" in line}
    assert node_names <= {"node1", "node2", "node3", "node4"}
