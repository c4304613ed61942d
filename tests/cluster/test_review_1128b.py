"""Review of 2026-11-28 (b): a submission answered by no one (the service killed between its commit
and its answer) made a second job when retried; a Slurm job held there (`scontrol hold`) kept its
luban attempt `starting`, holding its nodes, for as long as the hold lasted; `--quantum -inf`
and other negative numbers argparse does not know were "(missing)"."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading

import pytest

from luban.cluster.models import Allocation, Event, Job, StopReason
from tests.cluster.conftest import LUBAN, PYTHON, migrate, require, wait_for
from tests.cluster.fake_slurm import count, job, no_tracebacks, ticks
from tests.cluster import test_quota_concurrency

cluster = test_quota_concurrency.cluster  # a fixture: PostgreSQL, schedulers and the API in this process

CRASH_VAR = "LUBAN_TEST_CRASH_SUBMIT"
# a service that SIGKILLs itself once a submission has committed, before it answers (install_crash)
SERVE = [*LUBAN[:2], "import tests.cluster.test_review_1128b as t; t.install_crash(); " + LUBAN[2]]


def install_crash() -> None:
    """In the service's process: ``kill -9`` right after the COMMIT of the first submission, before
    its answer is sent (the database keeps the job, the client gets no answer)."""
    if not os.environ.pop(CRASH_VAR, None):  # once: its restart does not crash
        return
    from sqlalchemy import event
    from sqlalchemy.orm import Session

    from luban.cluster import service

    record = service.record

    def record_then_mark(s, kind, *args, **kwargs):
        record(s, kind, *args, **kwargs)
        if kind == "submit":
            s.info[CRASH_VAR] = True

    service.record = record_then_mark

    @event.listens_for(Session, "after_commit")
    def _die(session):
        if session.info.get(CRASH_VAR):
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_a_submission_whose_answer_was_lost_in_a_crash_makes_one_job(service, monkeypatch, request, tmp_path,
                                                                      database):
    """The service killed after the submission committed and before it answered: the CLI said
    "unreachable", and the user's retry made a second job. Now the client sends an Idempotency-Key
    and retries a POST it got no answer to with the same key (here across the restart); the service
    answers a repeated key with the job it made. The same key with another spec is a one-line 409;
    keys are per user."""
    from luban.cluster.client import Client

    args = ["--nodes", "1", "--tick", "0.2"]
    if database == "postgresql":
        args += ["--db", request.getfixturevalue("pg_url")]
    conftest = sys.modules[service.__module__]  # the fixture's conftest module (pytest's own name for it)
    monkeypatch.setattr(conftest, "LUBAN", SERVE)
    monkeypatch.setenv(CRASH_VAR, "1")
    try:
        svc = service(*args)
    finally:
        monkeypatch.delenv(CRASH_VAR)
        monkeypatch.setattr(conftest, "LUBAN", LUBAN)
    token, _ = svc.user("alice", {"NORMAL": 1})
    spec = {"name": "once", "command": PYTHON, "args": ["-c", "pass"]}
    answer: dict = {}

    def submit() -> None:
        try:  # retry_for: rides out the restart below, however long it takes here
            answer["job"] = Client(svc.url, token, retry_for=300).submit(spec, key="k-" + secrets.token_hex(8))
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            answer["error"] = err

    thread = threading.Thread(target=submit, daemon=True)
    thread.start()
    wait_for(lambda: svc.proc.poll() is not None, 120, what="the service to kill itself after the commit")
    assert svc.proc.returncode == -signal.SIGKILL, svc.log.read_text()[-2000:]
    svc.start()  # the same state and database
    thread.join(300)
    assert not thread.is_alive() and "error" not in answer, (answer, svc.log.read_text()[-2000:])
    admin = svc.admin()
    jobs = admin.jobs(all_attempts=True)
    assert [j["id"] for j in jobs] == [answer["job"]["id"]], jobs  # was: two jobs after the retry
    assert [e["kind"] for e in admin.events(jobs[0]["id"])].count("submit") == 1

    job_file = tmp_path / "job.yaml"
    job_file.write_text(f"name: again\ncommand: {PYTHON}\nargs: ['-c', 'pass']\n")
    first = svc.cli("submit", "--key", "same-key", str(job_file), token=token).stdout
    again = svc.cli("submit", "--key", "same-key", str(job_file), token=token).stdout
    assert first.startswith("submitted job ") and again.startswith(f"job {first.split()[2]} was submitted with "
                                                                    "--key same-key before (it is "), (first, again)
    assert answer["job"].get("repeated"), answer  # the SDK's retry got the job its lost POST made
    job_file.write_text(f"name: other\ncommand: {PYTHON}\nargs: ['-c', 'pass']\n")
    other = svc.cli("submit", "--key", "same-key", str(job_file), token=token, check=False)
    assert other.returncode == 2 and other.stdout == "", other
    assert other.stderr.count("\n") == 1 and other.stderr.startswith("luban: error: Idempotency-Key = 'same-key': "
                                                                       "already submitted job "), other.stderr
    assert "(name differ)" in other.stderr and "(HTTP 409)" in other.stderr
    bob_token, _ = svc.user("bob", {"NORMAL": 1})
    bobs = svc.cli("submit", "--key", "same-key", str(job_file), token=bob_token).stdout
    assert bobs != first  # another user's key is another key
    assert len(admin.jobs(all_attempts=True)) == 3
    bad = svc.cli("submit", "--key", "no spaces", str(job_file), token=token, check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("luban: error: --key = 'no spaces': a key matching "), bad


def test_a_post_sent_but_not_answered_is_retried_with_its_key_and_the_error_names_it(monkeypatch):
    """A server that takes the submission and closes the connection without answering: the client
    retries it with the same Idempotency-Key (bounded), then says it may have been submitted and how
    to submit it at most once (--key). A service that cannot be connected to at all got nothing:
    said at once, as before."""
    from luban.cluster import client as client_module
    from luban.cluster.client import SUBMIT_KEY_HEADER, Client
    from luban.errors import LubanError

    monkeypatch.setattr(client_module, "SUBMIT_RETRY_S", 2.0)
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)  # the loop below sees `done` at least this often
    keys: list[str] = []
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    head += chunk
                for line in head.decode("latin-1").split("\r\n"):
                    if line.lower().startswith(SUBMIT_KEY_HEADER.lower() + ":"):
                        keys.append(line.split(":", 1)[1].strip())
            # closed without a word: the answer is lost

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        with pytest.raises(LubanError) as lost:
            Client(url, "t").submit({"name": "x", "command": "true"}, key="my-key-1")
    finally:
        done.set()
        server.close()
        thread.join(30)
    assert len(keys) >= 2 and set(keys) == {"my-key-1"}, keys  # retried, with the same key
    assert "may have been submitted" in str(lost.value) and "--key my-key-1" in str(lost.value), lost.value
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(LubanError) as refused:
        Client(f"http://127.0.0.1:{port}", "t").submit({"name": "x", "command": "true"})
    assert "unreachable" in str(refused.value) and "--key" not in str(refused.value)


def test_the_submit_key_migration_keeps_the_jobs_of_an_older_schema(db_url):
    """0003 adds jobs.submit_key (unique per user) to a database made by 0002, jobs and all."""
    from sqlalchemy import inspect, text

    from luban.cluster import db

    engine = db.make_engine(db_url)
    with engine.begin() as conn:
        migrate(conn, "upgrade", "0002")
        conn.execute(text("INSERT INTO users (name, token_hash, is_admin) VALUES ('alice', 'h', false)"))
        for _ in range(2):
            conn.execute(text(
                "INSERT INTO jobs (chain_id, restart_count, whole_life_state, \"user\", owner, name, spec, priority, "
                "node_group, nnodes, state, stop_reason, requested, reason, chain_submitted_at, place, queued_at, "
                "acked, nodes) VALUES ('c1', 0, 0, 'alice', 'user:alice', 'old', '{}', 2, 'default', 1, 'queued', 0, "
                "0, '', 1.0, 1.0, 1.0, false, '[]')"))
    db.upgrade(engine)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM jobs WHERE submit_key IS NULL")).scalar() == 2
    unique = [ix for ix in inspect(engine).get_indexes("jobs") if ix["name"] == "ux_jobs_user_submit_key"]
    assert unique and unique[0]["unique"] and unique[0]["column_names"] == ["user", "submit_key"]
    engine.dispose()


@pytest.mark.parametrize("reason", ["JobHeldAdmin", "JobHeldUser"])
def test_an_attempt_held_in_slurm_before_it_started_is_held_in_luban_and_frees_its_nodes(slurm, caplog, reason):
    """`scontrol hold` on the Slurm job of a starting attempt: it stayed PENDING there and `starting`
    in luban, its nodes held, for as long as the hold lasted. Now luban takes the hold as meant: the
    Slurm copy is cancelled, the attempt ends charged nothing (it never ran), its nodes are freed,
    and its requeued attempt is held in luban (an admin's hold for JobHeldAdmin), with events that
    say why; it does not start until released."""
    scheduler, submit, fake, calls, t = slurm
    (fake / "job").write_text(f"JobId=4242 JobState=PENDING Reason={reason} Dependency=(null) ExitCode=0:0\n")
    first = submit()
    scheduler.guarded_tick()  # started: sbatch
    assert job(scheduler, first).state == "starting"
    ticks(scheduler, t, 1)  # polled: held there
    ended = job(scheduler, first)
    assert ended.state == "suspended" and ended.started_at == ended.ended_at, (ended.state, ended.reason)
    assert f"Reason={reason}" in ended.reason and "luban release" in ended.reason
    assert "scancel 4242" in calls.read_text()  # was: never cancelled, `starting` on and on
    assert count(scheduler, Allocation) == 0
    with scheduler.sessions() as s:
        nxt = s.query(Job).filter(Job.chain_id == ended.chain_id, Job.id != first).one()
        events = [e.kind for e in s.query(Event).filter_by(job_id=nxt.id).order_by(Event.id)]
    admin_hold = StopReason.ADMIN_HOLD if reason == "JobHeldAdmin" else 0
    assert nxt.state == "queued" and nxt.requested == StopReason.HOLD | admin_hold, (nxt.state, nxt.requested)
    assert events == ["requeue", "hold"], events
    sbatches = calls.read_text().count("sbatch ")
    ticks(scheduler, t, 3)
    assert job(scheduler, nxt.id).state == "queued" and calls.read_text().count("sbatch ") == sbatches
    no_tracebacks(caplog)


@pytest.mark.exclusive("slurm")
def test_a_job_held_in_a_real_slurm_reads_as_held(tmp_path):
    """Against the real daemons (.ci/services.sh): a luban copy PENDING behind another job on its node,
    then `scontrol hold`: the executor's poll says so (Reason=JobHeldAdmin), and its kill takes it out
    of Slurm's queue."""
    import json
    import shutil

    from luban.cluster.executors.slurm import SlurmExecutor
    from tests.cluster.test_slurm import sleeping_launch, slurm_nodes, squeue_listed

    require(bool(shutil.which("sinfo")) and "node1" in slurm_nodes(), "a Slurm cluster with node1 idle")
    executor = SlurmExecutor(state_dir=str(tmp_path))
    tag = secrets.token_hex(4)

    launch, listed = (lambda i: sleeping_launch(tmp_path, tag, i)), squeue_listed

    blocker, held = launch(1), launch(2)
    try:
        executor.start(blocker)
        handle = executor.start(held)  # pending in Slurm: node1 is the blocker's (--exclusive)
        wait_for(lambda: listed(held.name)[1:] == ["PENDING"], 60, 0.5, "the second job pending in Slurm")
        subprocess.run(["scontrol", "hold", json.loads(handle)["slurm_id"]], check=True, timeout=60)
        status = wait_for(lambda: (lambda s: s if s.held else None)(executor.poll(handle)), 60, 0.5,
                          "the held job read as held")
        assert status.held == "JobHeldAdmin" and status.held_by_admin and not status.done and not status.started
        executor.kill(handle)
        wait_for(lambda: not listed(held.name), 60, 0.5, "the held copy gone from Slurm's queue")
    finally:
        for name in (blocker.name, held.name):
            subprocess.run(["scancel", f"--name={name}"], timeout=60)


@pytest.mark.exclusive("slurm")
def test_a_luban_job_held_in_a_real_slurm_is_held_in_luban_until_an_admin_releases_it(service, tmp_path):
    """End to end on the real daemons: a 4-node luban job pending in Slurm behind a job outside luban,
    then `scontrol hold` on it: luban cancels that Slurm job, frees the nodes and holds the chain (an
    admin's hold); the user cannot release it, an admin can, and it then runs to its end."""
    import shutil

    from luban.cluster.client import ApiError
    from tests.cluster.test_slurm import slurm_nodes

    require(bool(shutil.which("sinfo")), "a Slurm cluster (sinfo)")
    wait_for(lambda: len(slurm_nodes()) >= 4, 60, 1, "4 idle Slurm nodes (node1..node4, .ci/services.sh)")
    blocker = f"c2-blocker-{secrets.token_hex(3)}"
    svc = service("--executor", "slurm", "--tick", "0.3")
    names = [blocker]
    try:
        subprocess.run(["sbatch", "-J", blocker, "--nodelist=node1", "--exclusive", f"--output={tmp_path}/b.out",
                        "--wrap", "sleep 300"], check=True, capture_output=True, timeout=60)
        group = svc.admin().nodes()[0]["node_group"]
        _, alice = svc.user("alice", {"NORMAL": 4}, node_group=group)
        first = alice.submit({"name": "wide", "command": PYTHON, "args": ["-c", "pass"], "nodes": 4,
                              "workdir": str(tmp_path)})["id"]
        name = f"luban-{first}-{alice.job(first)['chain_id']}"
        names.append(name)

        def pending() -> str | None:
            out = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i %T"], capture_output=True, text=True,
                                 timeout=60).stdout.split()
            return out[0] if out[1:] == ["PENDING"] else None

        slurm_id = wait_for(pending, 120, 0.5, "the luban job pending in Slurm behind the blocker")
        assert alice.job(first)["state"] == "starting"
        subprocess.run(["scontrol", "hold", slurm_id], check=True, timeout=60)
        latest = wait_for(lambda: (lambda j: j if j["id"] != first else None)(alice.latest(first)), 120, 0.5,
                          "the attempt requeued after the hold in Slurm")
        ended = alice.job(first)
        assert ended["state"] == "suspended" and ended["node_hours"] == 0 and "JobHeldAdmin" in ended["reason"]
        assert latest["state"] == "queued" and latest["held"], latest
        assert not [n for n in svc.admin().nodes() if n["job"]], svc.admin().nodes()  # nodes freed
        wait_for(lambda: not subprocess.run(["squeue", "-h", "-n", name], capture_output=True, text=True,
                                            timeout=60).stdout.strip(), 60, 0.5, "the held Slurm job cancelled")
        with pytest.raises(ApiError, match="held by an admin"):
            alice.release(latest["id"])
        subprocess.run(["scancel", f"--name={blocker}"], timeout=60)
        svc.admin().release(latest["id"])
        assert alice.wait(first, timeout=180)["state"] == "succeeded"
    finally:
        for name in names:
            subprocess.run(["scancel", f"--name={name}"], timeout=60)


@pytest.mark.parametrize("value", ["-inf", "-1e3", "-1E+3", "-.5e1", "-nan", "-Infinity"])
def test_a_negative_number_argparse_does_not_know_reaches_the_flags_own_check(value):
    """`luban cluster simulate --quantum -inf` said `--quantum = (missing)`: argparse takes only -1 and
    -1.5 for negative numbers, and anything else beginning with '-' for an option. Now the flag's
    own one-line error, exit 2."""
    result = subprocess.run([*LUBAN, "cluster", "simulate", "--quantum", value], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.startswith("luban: error: --quantum = ") and "(missing)" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "a finite number in" in result.stderr
    days = subprocess.run([*LUBAN, "usage", "--days", value], capture_output=True, text=True, timeout=120)
    assert days.returncode == 2 and days.stderr.startswith("luban: error: --days = ") and \
        "(missing)" not in days.stderr, days.stderr


def test_an_empty_state_filter_is_refused_not_taken_for_no_filter():
    """`luban jobs --state ''` listed every job as if no filter was given, while `--state queued,,running`
    refused its empty name: both are refused now, before anything is asked of the service."""
    result = subprocess.run([*LUBAN, "jobs", "--state", "", "--url", "http://127.0.0.1:9", "--token", "x"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("luban: error: --state = '': one of queued"), result


def test_an_sdk_key_the_service_would_refuse_is_one_error_before_sending(monkeypatch):
    """`Client.submit(spec, key=...)` with a key no header can carry (non-ASCII) or the service refuses:
    one LubanError naming it, nothing sent."""
    from luban.cluster.client import Client
    from luban.errors import LubanError

    client = Client("http://127.0.0.1:9", "t")
    monkeypatch.setattr(client.http, "request", lambda *a, **k: pytest.fail("sent"))
    for key in ("ü", "a b", "", "x" * 65, 5):
        with pytest.raises(LubanError, match=r"^key = .*: a key matching "):
            client.submit({"name": "x", "command": "true"}, key=key)


def test_racing_repeats_of_one_key_make_one_job_on_postgresql(cluster):
    """The same submission sent at once on several connections (a client's retry racing its first POST
    still in flight) on PostgreSQL: one job; every answer names it, one 201 and the others 200."""
    from luban.cluster.client import SUBMIT_KEY_HEADER
    sessions, _, http, tokens = cluster
    headers = {"Authorization": f"Bearer {tokens['alice']}", SUBMIT_KEY_HEADER: "race-1"}
    bound = test_quota_concurrency.BOUND
    barrier, answers = threading.Barrier(6, timeout=bound), []

    def post() -> None:
        barrier.wait()
        answers.append(http.post("/api/jobs", json={"spec": {"name": "r", "command": "true"}}, headers=headers))

    threads = [threading.Thread(target=post) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(bound)
        assert not thread.is_alive()
    assert sorted(a.status_code for a in answers) == [200] * 5 + [201], [a.text for a in answers]
    assert len({a.json()["id"] for a in answers}) == 1
    with sessions() as s:
        assert s.query(Job).count() == 1
