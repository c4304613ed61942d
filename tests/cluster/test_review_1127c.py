"""Review of 2026-11-27 (c): the platform as a careless or unlucky user or admin meets it."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import PYTHON, wait_for

SLEEP = {"name": "sleeper", "command": PYTHON, "args": ["-c", "import time; time.sleep(600)"]}


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    from tests.cluster.conftest import Service, kill_jobs

    state = tmp_path_factory.mktemp("review1127c")
    service = Service(state, ["--nodes", "2", "--tick", "0.2", "--suspend-timeout", "20"]).start()
    yield service
    service.stop()
    kill_jobs(state)


def test_stop_by_a_chains_first_id_waits_for_the_attempt_it_stopped(svc):
    """`luban stop 1` after job 1 was suspended and requeued (attempt 2 runs) stops attempt 2: it
    waited for job 1, ended long ago, and returned while attempt 2 still ran ("job 1 suspended")."""
    token, alice = svc.user("alice", {"NORMAL": 1})
    first = alice.submit(SLEEP)["id"]
    wait_for(lambda: alice.job(first)["state"] == "running", 60, what="the first attempt running")
    alice.suspend(first)
    latest = wait_for(lambda: (j := alice.latest(first))["state"] == "running" and j["id"] != first and j, 60,
                      what="the next attempt running")
    result = svc.cli("stop", "--timeout", "60", str(first), token=token)
    assert f"stop requested for job {latest['id']} (running)" in result.stdout
    assert f"job {latest['id']} stopped" in result.stdout
    assert alice.job(latest["id"])["state"] == "stopped"  # ended when the command returned


def test_luban_s_own_variables_come_from_luban_not_the_submitter_or_the_spec(svc):
    """A job submitted from inside another (its LUBAN_NODE, LUBAN_GROUP_DATA_DIR exported) or with
    them in its spec: a job of no group got the other job's group directory, and under Slurm (the
    launcher keeps a LUBAN_NODE it finds) the other job's node name."""
    from luban import jobenv

    inside = {"LUBAN_NODE": "node9", "LUBAN_GROUP": "vision", "LUBAN_GROUP_DATA_DIR": "/data/vision",
              "LUBAN_GROUP_ENV_DIR": "/env/vision", "LUBAN_NODES": "node9", "HOME": "/home/x"}
    assert jobenv.inheritable(inside) == {"HOME": "/home/x"}
    _, bob = svc.user("bob", {"NORMAL": 1})
    show = "import os; print(sorted((k, v) for k, v in os.environ.items() if k.startswith('LUBAN_GROUP')), " \
           "os.environ['LUBAN_NODE'])"
    job = bob.submit({"name": "env", "command": PYTHON, "args": ["-c", show], "env": inside})["id"]
    assert bob.wait(job, timeout=60)["state"] == "succeeded"
    text = bob.logs(job)["text"]
    assert "[] node" in text and "vision" not in text and "node9" not in text, text


def test_a_hold_that_lands_between_a_ticks_plan_and_its_start_keeps_the_job_queued(slurm, monkeypatch):
    """`luban hold` answered "held by alice" for a queued job the running tick had already planned to
    start: the claim checked only that the job was still queued, so it started, shown "running (held)"."""
    from luban.cluster import policy
    from tests.cluster.conftest import api_client
    from tests.cluster.fake_slurm import job

    scheduler, submit, fake, calls, t = slurm
    job_id = submit()
    http, admin = api_client(scheduler)
    plan = policy.plan

    def plan_then_hold(snapshot):
        result = plan(snapshot)
        assert [start[0] for start in result.starts] == [job_id]
        answer = http.post(f"/api/jobs/{job_id}/hold", headers=admin)  # the user's hold, at this moment
        assert answer.status_code == 200 and answer.json()["held"], answer.text
        return result

    monkeypatch.setattr(policy, "plan", plan_then_hold)
    scheduler.tick()
    held = job(scheduler, job_id)
    assert held.state == "queued" and held.nodes == [], (held.state, held.nodes)
    assert "sbatch" not in (calls.read_text() if calls.exists() else "")


def test_a_stop_and_a_hold_at_the_same_moment_both_count_on_postgresql(pg_url, in_process, tmp_path, monkeypatch):
    """Requests (stop, suspend, hold, go_suspend) read a job's `requested` flags, or'ed theirs in and
    wrote them back without locking the row: on PostgreSQL a hold whose transaction spanned a stop's
    wrote its flags over the stop's — the stop was lost (the job was held, not stopped, and `luban
    stop` waited in vain). The row is locked when read now; the second request waits for the first."""
    import threading

    from luban.cluster import service
    from luban.cluster.executors import make
    from luban.cluster.models import Job, StopReason

    api = in_process(pg_url, make("local", nodes=1), state=tmp_path / "state")
    sessions, http = api.sessions, api.http
    alice = {"Authorization": "Bearer " + api.user("alice", 1)}
    job_id = http.post("/api/jobs", json={"spec": {"name": "j", "command": "true"}}, headers=alice).json()["id"]

    record, answers, threads = service.record, [], []

    def stop_meanwhile(s, kind, *args, **kw):  # the hold has read the flags and not yet written them
        if kind == "hold" and not threads:
            threads.append(threading.Thread(target=lambda: answers.append(http.post(f"/api/jobs/{job_id}/stop",
                                                                                    headers=alice))))
            threads[0].start()
            threads[0].join(3)  # done at once before the fix; now it waits for the hold's transaction
        return record(s, kind, *args, **kw)

    monkeypatch.setattr(service, "record", stop_meanwhile)
    assert http.post(f"/api/jobs/{job_id}/hold", headers=alice).status_code == 200
    threads[0].join(30)
    assert answers and answers[0].status_code == 200, answers
    with sessions() as s:
        requested = s.get(Job, job_id).requested
    assert requested & StopReason.USER_STOP and requested & StopReason.HOLD, requested


def test_small_things_a_careless_user_meets(svc):
    """A held job stopped while queued was listed "stopped (held)" (held: true) forever; `luban submit`
    with neither a file nor a command said "name is missing"; a user in no group submitting to a group
    was told "(your group: None)"."""
    token, carol = svc.user("carol", {"NORMAL": 1})
    job = carol.submit(SLEEP)["id"]
    wait_for(lambda: carol.job(job)["state"] == "running", 60, what="carol's first job running")
    queued = carol.submit(SLEEP)["id"]  # waits for carol's quota
    assert carol.hold(queued)["held"]
    svc.cli("stop", "--timeout", "60", str(queued), token=token)
    assert carol.job(queued)["state"] == "stopped" and not carol.job(queued)["held"]
    listing = svc.cli("jobs", "--all", token=token).stdout
    assert "(held)" not in listing, listing
    carol.stop(job)
    for args in (["submit"], ["submit", "--"], ["submit", "-n", "1"]):
        result = svc.cli(*args, token=token, check=False)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result
        assert "a command after --" in result.stderr and "name is missing" not in result.stderr, result.stderr
    result = svc.cli("submit", "--group", "vision", "--", PYTHON, "-c", "pass", token=token, check=False)
    assert result.returncode == 2 and "you are in no group" in result.stderr and "None" not in result.stderr, \
        result.stderr


def test_usage_over_a_period_reads_only_the_attempts_in_it(slurm, monkeypatch):
    """`luban usage --days 1` (GET /api/usage) read every attempt ever started into the service and
    measured each, at every call: the table keeps every attempt, so many short jobs made everyone's
    usage slower and bigger (GET /api/jobs and the dashboard's daily usage choose in SQL already)."""
    from luban.cluster import service
    from luban.cluster.models import Job
    from tests.cluster.conftest import api_client

    scheduler, submit, fake, calls, t = slurm
    http, admin = api_client(scheduler)
    now = scheduler.clock.now()
    with scheduler.sessions.begin() as s:
        for i in range(50):  # long over: ended 30 days ago
            s.add(Job(chain_id=f"c{i}", user="alice", owner="user:alice", name="old", spec={}, priority=10,
                      node_group="debug", nnodes=1, state="succeeded", chain_submitted_at=0.0, place=0.0,
                      queued_at=0.0, started_at=now - 31 * 86400, ended_at=now - 30 * 86400))
        s.add(Job(chain_id="recent", user="alice", owner="user:alice", name="new", spec={}, priority=10,
                  node_group="debug", nnodes=2, state="succeeded", chain_submitted_at=0.0, place=0.0,
                  queued_at=0.0, started_at=now - 7200, ended_at=now - 3600))
    measured = []
    monkeypatch.setattr(service, "node_hours", lambda job, *a, **kw: measured.append(job.id) or 2.0)
    answer = http.get("/api/usage", params={"since": now - 86400}, headers=admin)
    assert answer.status_code == 200 and answer.json() == [{"who": "alice", "attempts": 1, "node_hours": 2.0}]
    assert len(measured) == 1, f"{len(measured)} attempts read for one in the period"


def test_admin_user_set_without_a_group_is_refused_not_a_removal(svc):
    """`luban admin user set NAME` with no --group sent {"group": null}: the user silently left its
    group (its group's jobs and quota out of reach). Now --group G or --no-group is required."""
    admin = svc.admin()
    admin.add_group("ml")
    svc.user("dave", {}, group="ml")
    result = svc.cli("admin", "user", "set", "dave", check=False)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--no-group" in result.stderr, result
    assert {u["name"]: u["group"] for u in admin.users()}["dave"] == "ml"
    assert "group -" in svc.cli("admin", "user", "set", "dave", "--no-group").stdout
    assert {u["name"]: u["group"] for u in admin.users()}["dave"] is None


def test_stopping_several_jobs_goes_on_past_one_that_has_ended(svc):
    """`luban stop A B` where A ended a moment before: one error about A (exit 2), and B was never
    asked to stop — it ran on. An attempt already ended is said as such, and the others are stopped."""
    token, erin = svc.user("erin", {"NORMAL": 2})
    done = erin.submit({"name": "quick", "command": PYTHON, "args": ["-c", "pass"]})["id"]
    assert erin.wait(done, timeout=60)["state"] == "succeeded"
    sleeper = erin.submit(SLEEP)["id"]
    wait_for(lambda: erin.job(sleeper)["state"] in ("starting", "running"), 60, what="the sleeper started")
    result = svc.cli("stop", "--timeout", "60", str(done), str(sleeper), token=token, check=False)
    assert result.returncode == 0, result
    assert f"job {done} already succeeded" in result.stdout and f"job {sleeper} stopped" in result.stdout
    assert erin.job(sleeper)["state"] == "stopped"
    result = svc.cli("stop", "999999", token=token, check=False)  # what is not a job is still an error
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "not found" in result.stderr, result
