"""End to end on the local executor: real service process, real job processes, real signals."""

from __future__ import annotations

import re
from pathlib import Path

from luban.cluster.sdk import Client
from tests.cluster.conftest import PYTHON, wait_for

TRAINER = str(Path(__file__).with_name("fake_trainer.py"))


def trainer_spec(name, state, steps, priority, nodes=1, mode="signal", sleep=0.1):
    return {"name": name, "command": PYTHON, "args": [TRAINER, str(state), str(steps), "--mode", mode,
                                                        "--sleep", str(sleep)],
            "nodes": nodes, "priority": priority, "workdir": str(Path(state).parent)}


def attempts(client, job_id):
    chain = client.job(job_id)["chain_id"]
    return [j for j in client.jobs(all_attempts=True) if j["chain_id"] == chain]


def log_text(client, job_id, rank=0):
    return client.logs(job_id, rank)["text"]


def test_high_priority_preempts_low_which_checkpoints_and_resumes(service, tmp_path):
    svc = service("--nodes", "2", "--tick", "0.2", "--suspend-timeout", "60")
    _, alice = svc.user("alice", {"LOW": 2})
    bob_token, bob = svc.user("bob", {"HIGH": 2})
    state = tmp_path / "low.state"
    submitted = svc.cli("submit", "-n", "2", "-p", "LOW", "--name", "low", "--workdir", str(tmp_path), "--",
                        PYTHON, TRAINER, str(state), "40", "--sleep", "0.1",
                        token=alice.http.headers["Authorization"][7:])
    low = int(re.search(r"submitted job (\d+)", submitted.stdout).group(1))
    wait_for(lambda: "step 5\n" in log_text(alice, low), 60, what="low job to make progress")
    high = bob.submit({"name": "high", "command": PYTHON, "args": ["-c", "import time; time.sleep(1)"],
                       "nodes": 2, "priority": "HIGH"})["id"]
    assert bob.wait(high, timeout=120)["state"] == "succeeded"
    final = alice.wait(low, timeout=120)
    assert final["state"] == "succeeded"

    first, second = attempts(alice, low)
    assert first["state"] == "suspended" and first["exit_code"] == 75
    assert "PREEMPTED" in first["stop_reasons"]
    assert second["restart_count"] == 1 and second["first_id"] == first["id"] == low
    assert second["chain_id"] == first["chain_id"]
    assert bob.job(high)["started_at"] >= first["ended_at"], "high started before low released its nodes"

    log = log_text(alice, low)
    saved = int(re.search(r"checkpoint at step (\d+)", log).group(1))
    assert f"start: resumed at step {saved}, whole-life state {saved}," in log
    after = log[log.index(f"resumed at step {saved}"):]
    assert re.findall(r"^step (\d+)$", after, re.M) == [str(i) for i in range(saved + 1, 41)]
    assert "done at step 40" in log and "done at step 40" in log_text(alice, low, rank=1)
    assert final["whole_life_state"] == saved
    reasons = [e["message"] for e in alice.events(low) if e["kind"] == "suspend"]
    assert reasons and reasons[0].startswith("preempted: capacity")

    followed = svc.cli("logs", "-f", str(low), "--rank", "1", token=alice.http.headers["Authorization"][7:])
    assert "checkpoint at step" in followed.stdout and followed.stdout.rstrip().endswith("exited with code 0 ==")
    jobs = svc.cli("jobs", token=bob_token).stdout
    assert "high" in jobs and "low" not in jobs  # bob sees only his own


def test_polling_job_acknowledges_with_go_suspend(service, tmp_path):
    svc = service("--nodes", "1", "--tick", "0.2", "--suspend-timeout", "60")
    token, alice = svc.user("alice", {"NORMAL": 1})
    job = alice.submit(trainer_spec("poller", tmp_path / "p.state", 30, "NORMAL", mode="poll"))["id"]
    wait_for(lambda: "step 3\n" in log_text(alice, job), 60, what="progress")
    assert "suspend requested" in svc.cli("suspend", str(job), token=token).stdout
    assert alice.wait(job, timeout=120)["state"] == "succeeded"
    first, second = attempts(alice, job)
    assert first["state"] == "suspended" and "USER_SUSPEND" in first["stop_reasons"]
    assert "SUSPEND_TIMEOUT" not in first["stop_reasons"]
    assert any(e["kind"] == "ack" for e in alice.events(job))
    saved = int(re.search(r"checkpoint at step (\d+)", log_text(alice, job)).group(1))
    assert f"resumed at step {saved}" in log_text(alice, job)


def test_job_ignoring_the_signal_is_killed_after_the_deadline_then_stopped(service, tmp_path):
    svc = service("--nodes", "1", "--tick", "0.2", "--suspend-timeout", "1")
    token, alice = svc.user("alice", {"LOW": 1})
    _, bob = svc.user("bob", {"HIGH": 1})
    job = alice.submit(trainer_spec("deaf", tmp_path / "d.state", 10_000, "LOW", mode="ignore"))["id"]
    wait_for(lambda: "step 2\n" in log_text(alice, job), 60, what="progress")
    high = bob.submit({"name": "high", "command": "true", "priority": "HIGH"})["id"]
    assert bob.wait(high, timeout=60)["state"] == "succeeded"
    first = attempts(alice, job)[0]
    assert first["state"] == "suspended" and "SUSPEND_TIMEOUT" in first["stop_reasons"]
    assert first["exit_code"] == 137
    wait_for(lambda: attempts(alice, job)[-1]["state"] == "running", 60, what="requeued job running")
    svc.cli("stop", str(job), token=token)
    last = alice.wait(job, timeout=60)
    assert last["state"] == "stopped" and "USER_STOP" in last["stop_reasons"]


def test_same_priority_jobs_time_share_after_the_quantum(service, tmp_path):
    svc = service("--nodes", "1", "--tick", "0.2", "--quantum", "2", "--suspend-timeout", "30")
    _, alice = svc.user("alice", {"NORMAL": 1})
    _, bob = svc.user("bob", {"NORMAL": 1})
    a = alice.submit(trainer_spec("a", tmp_path / "a.state", 10_000, "NORMAL", sleep=0.05))["id"]
    wait_for(lambda: alice.job(a)["state"] == "running", 60, what="a running")
    b = bob.submit(trainer_spec("b", tmp_path / "b.state", 10_000, "NORMAL", sleep=0.05))["id"]
    wait_for(lambda: len(attempts(bob, b)) >= 2, 120, what="b to yield back after its quantum")
    first_a, first_b = attempts(alice, a)[0], attempts(bob, b)[0]
    assert "TIME_SHARE" in first_a["stop_reasons"] and "TIME_SHARE" in first_b["stop_reasons"]
    assert first_a["ended_at"] - first_a["started_at"] >= 2
    assert first_b["started_at"] >= first_a["ended_at"]
    for client, job in ((alice, a), (bob, b)):
        client.stop(job)
        assert client.wait(job, timeout=60)["state"] == "stopped"


def test_multi_node_job_gets_luban_rendezvous_variables_not_rank_variables(service, tmp_path):
    svc = service("--nodes", "3", "--gpus", "8", "--zones", "3", "--tick", "0.2")
    _, alice = svc.user("alice", {"NORMAL": 3})
    names = ("LUBAN_NODE_RANK", "LUBAN_NNODES", "LUBAN_MASTER_ADDR", "LUBAN_MASTER_PORT", "LUBAN_GPUS_PER_NODE",
             "LUBAN_NODE", "LUBAN_JOB_TAG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    show = f"import os; print(*[f'{{k}}={{os.environ.get(k, \"-\")}}' for k in {names!r}])"
    job = alice.submit({"name": "env", "command": PYTHON, "args": ["-c", show], "nodes": 3})["id"]
    assert alice.wait(job, timeout=60)["state"] == "succeeded"
    lines = [dict(kv.split("=") for kv in log_text(alice, job, r).splitlines()[1].split()) for r in range(3)]
    assert [x["LUBAN_NODE_RANK"] for x in lines] == ["0", "1", "2"]
    assert {x["LUBAN_NNODES"] for x in lines} == {"3"} and {x["LUBAN_GPUS_PER_NODE"] for x in lines} == {"8"}
    assert len({x["LUBAN_MASTER_PORT"] for x in lines}) == 1 and {x["LUBAN_MASTER_ADDR"] for x in lines} == {"127.0.0.1"}
    assert sorted(x["LUBAN_NODE"] for x in lines) == ["node1", "node2", "node3"]
    assert [x["LUBAN_JOB_TAG"].rsplit(".", 1)[1] for x in lines] == ["0", "1", "2"] and lines[0]["LUBAN_JOB_TAG"].startswith(f"luban-{job}-")
    # torchrun's "I am a rank" variables would make `luban train --nproc g` inside the job a rank
    assert {x[k] for x in lines for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")} == {"-"}


def test_admin_cli_yaml_submission_auto_priority_and_drain(service, tmp_path):
    svc = service("--nodes", "2", "--tick", "0.2")
    svc.cli("admin", "group", "add", "vision", "--data-dir", str(tmp_path / "shared"))
    token = svc.cli("admin", "user", "add", "carol", "--group", "vision").stdout.strip()
    svc.cli("admin", "quota", "set", "user:carol", "HIGH", "1")
    svc.cli("admin", "quota", "set", "user:carol", "NORMAL", "2")
    svc.cli("admin", "node", "drain", "node1")
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: yaml-job\ncommand: {PYTHON}\nargs: [-c, \"import os, time; print(os.environ['GREETING'], "
                    "os.environ['LUBAN_GROUP_DATA_DIR'], os.environ['LUBAN_NODE'], flush=True); time.sleep(600)\"]\n"
                    "env: {GREETING: hello}\nnodes: 1\npriority: AUTO\n")
    first = svc.cli("submit", str(spec), token=token).stdout
    assert "(yaml-job, 1 node(s), HIGH)" in first  # AUTO: the highest level with free quota
    job = int(re.search(r"submitted job (\d+)", first).group(1))
    carol = Client(svc.url, token)
    wait_for(lambda: "hello" in log_text(carol, job), 60, what="yaml job output")
    assert log_text(carol, job).splitlines()[1] == f"hello {tmp_path / 'shared'} node2"  # node1 is drained
    second = svc.cli("submit", "-p", "AUTO", "--", "sleep", "600", token=token).stdout
    assert "(sleep, 1 node(s), NORMAL)" in second  # HIGH quota is in use now
    nxt = int(re.search(r"submitted job (\d+)", second).group(1))
    wait_for(lambda: carol.job(nxt)["reason"].startswith("capacity"), 60, what="second job waiting")
    nodes = svc.cli("nodes").stdout
    assert re.search(r"node1 .* drain +-", nodes)
    assert re.search(rf"node2 .* up +{job} carol yaml-job \(running\)", nodes)
    assert re.search(r"user:carol +default +HIGH +1 +1", svc.cli("quota", token=token).stdout)
    svc.cli("admin", "node", "up", "node1")
    wait_for(lambda: carol.job(nxt)["nodes"] == ["node1"], 60, what="second job on node1 after 'up'")
    assert "stop requested" in svc.cli("stop", str(job), str(nxt), token=token).stdout
    assert [carol.wait(j, timeout=60)["state"] for j in (job, nxt)] == ["stopped", "stopped"]
