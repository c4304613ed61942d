"""What users see, as Slurm users expect: history with exit codes and node-hours, usage per user,
how each job ended, hold/release, time limits, strict --state, logs -f's exit status."""

from __future__ import annotations

import re

import pytest

from luban.cluster.cli import parse_duration
from luban.errors import LubanError
from tests.cluster.conftest import wait_for


def test_slurm_style_durations():
    assert [parse_duration(t) for t in ("5", "1:30", "2:00:00", "1-0", "1-2:03", "0-0:0:9")] == [
        300, 90, 7200, 86400, 93780, 9]
    for bad in ("", "x", "-1", "1:2:3:4", "0", "1--2"):
        with pytest.raises(LubanError, match="--time"):
            parse_duration(bad)


def test_history_usage_hold_release_time_limit_and_follow(service):
    svc = service("--nodes", "1", "--tick", "0.2")
    token, alice = svc.user("alice", {"NORMAL": 1})
    ok = alice.submit({"name": "ok", "command": "true"})["id"]
    bad = alice.submit({"name": "bad", "command": "sh", "args": ["-c", "echo bye; exit 3"]})["id"]
    assert alice.wait(bad, timeout=60)["state"] == "failed"
    follow = svc.cli("logs", "-f", str(bad), token=token, check=False)
    assert follow.returncode == 3 and "bye" in follow.stdout and "failed: exit code 3" in follow.stderr

    out = svc.cli("jobs", "--all", token=token).stdout
    head = out.splitlines()[0].split()
    assert {"EXIT", "NODE-HOURS", "REASON"} <= set(head)
    assert re.search(rf"^{ok} .* succeeded +0 +\d+\.\d\d .*exit code 0$", out, re.M), out
    assert re.search(rf"^{bad} .* failed +3 +\d+\.\d\d .*exit code 3$", out, re.M), out
    assert "{" not in out  # no raw dicts

    bogus = svc.cli("jobs", "--state", "bogus", token=token, check=False)
    assert bogus.returncode == 2 and bogus.stderr.startswith("luban: error: --state = 'bogus': one of queued")
    assert len(bogus.stderr.strip().splitlines()) == 1

    # hold: a queued job does not start while held, even on a free node
    busy = alice.submit({"name": "busy", "command": "sleep", "args": ["600"]})["id"]
    wait_for(lambda: alice.job(busy)["state"] == "running", 60, what="busy running")
    later = alice.submit({"name": "later", "command": "true"})["id"]
    assert "held by alice" in svc.cli("hold", str(later), token=token).stdout
    svc.cli("stop", str(busy), token=token)
    wait_for(lambda: "held" in svc.cli("jobs", token=token).stdout, 10, what="held shown")
    import time

    time.sleep(1.0)  # several ticks with a free node
    assert alice.job(later)["state"] == "queued"
    svc.cli("release", str(later), token=token)
    assert alice.wait(later, timeout=60)["state"] == "succeeded"
    assert svc.cli("hold", str(later), token=token, check=False).returncode == 2  # not queued any more

    # time limit: killed when it runs past it, and the reason says so
    out = svc.cli("submit", "-t", "0:02", "--", "sleep", "600", token=token).stdout
    limited = int(re.search(r"submitted job (\d+)", out).group(1))
    final = alice.wait(limited, timeout=60)
    assert final["state"] == "failed" and "TIME_LIMIT" in final["stop_reasons"]
    assert final["reason"].startswith("time limit of 2s reached")

    usage = svc.cli("usage", "--days", "1", token=token).stdout
    assert re.search(r"^alice +\d+ +\d+\.\d\d$", usage, re.M), usage
    assert svc.cli("usage", "--days", "nan", token=token, check=False).returncode == 2


def test_quotas_default_to_the_nodes_group_and_unknown_groups_are_refused(service):
    svc = service("--nodes", "1", "--node-group", "gpu-a", "--tick", "0.2")
    svc.admin().add_user("bob")
    out = svc.cli("admin", "quota", "set", "user:bob", "NORMAL", "1").stdout
    assert "quota user:bob gpu-a" in out
    bad = svc.cli("admin", "quota", "set", "user:bob", "NORMAL", "1", "--node-group", "nope", check=False)
    assert bad.returncode == 2 and "node_group = 'nope': one of the node groups: gpu-a" in bad.stderr


def test_a_preempted_job_names_the_job_it_yielded_to(service, tmp_path):
    svc = service("--nodes", "1", "--tick", "0.2", "--suspend-timeout", "30")
    _, lo = svc.user("lo", {"LOW": 1})
    _, hi = svc.user("hi", {"HIGH": 1})
    low = lo.submit({"name": "low", "command": "sleep", "args": ["600"], "priority": "LOW"})["id"]
    wait_for(lambda: lo.job(low)["state"] == "running", 60, what="low running")
    high = hi.submit({"name": "high", "command": "true", "priority": "HIGH"})["id"]
    assert hi.wait(high, timeout=60)["state"] == "succeeded"
    first = [j for j in lo.jobs(all_attempts=True) if j["id"] == low][0]
    assert first["state"] == "suspended" and f"(for job {high})" in first["reason"], first["reason"]
    lo.stop(lo.latest(low)["id"])


def test_jobs_get_the_submitters_environment_or_exactly_what_is_listed(service, tmp_path):
    import os

    svc = service("--nodes", "1", "--tick", "0.2")
    token, alice = svc.user("alice", {"NORMAL": 1})
    show = "for k in LUBAN_SOAK_A LUBAN_SOAK_B RANK WORLD_SIZE; do eval echo $k=\\${$k:-unset}; done; " \
           "case \"$LUBAN_CLUSTER_TOKEN\" in \"$SUBMITTER_TOKEN\") echo TOKEN-COPIED;; *) echo TOKEN-OWN;; esac"

    def submit(*flags):
        env = dict(os.environ, LUBAN_CLUSTER_URL=svc.url, LUBAN_CLUSTER_TOKEN=token, LUBAN_SOAK_A="a1",
                   LUBAN_SOAK_B="b1", RANK="7", WORLD_SIZE="9", SUBMITTER_TOKEN=token)
        import subprocess

        from tests.cluster.conftest import LUBAN

        out = subprocess.run([*LUBAN, "submit", *flags, "--", "sh", "-c", show], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        job = int(re.search(r"submitted job (\d+)", out.stdout).group(1))
        assert alice.wait(job, timeout=60)["state"] == "succeeded"
        return alice.logs(job)["text"]

    everything = submit()
    assert "LUBAN_SOAK_A=a1" in everything and "LUBAN_SOAK_B=b1" in everything
    assert "RANK=unset" in everything and "WORLD_SIZE=unset" in everything  # rank variables are never copied
    listed = submit("--export", "LUBAN_SOAK_A,SUBMITTER_TOKEN")
    assert "LUBAN_SOAK_A=a1" in listed and "LUBAN_SOAK_B=unset" in listed
    assert "TOKEN-OWN" in everything and "TOKEN-OWN" in listed  # the job's token is its own, never the submitter's
