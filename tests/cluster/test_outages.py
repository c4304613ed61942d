"""Outages around the service: its database gone for a while, the service itself down while jobs
end, clients that hold connections open. Nothing is lost, nothing is charged twice, no traceback
reaches a user, and the jobs' SDK rides the outage out."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shlex
import signal
import socket
import sys

import httpx
import pytest

from luban.cluster.client import Client
from tests.cluster.conftest import LUBAN, wait_for

# `luban` whose submissions retry a lost answer or a 503 for 2 s, not client.SUBMIT_RETRY_S
QUICK_RETRY = [*LUBAN[:2], "import luban.cluster.client as c; c.SUBMIT_RETRY_S = 2.0; " + LUBAN[2]]


def _database_open(pg_url: str, open_: bool) -> None:
    """Let the throwaway database accept connections, or refuse them and drop the ones it has (a
    PostgreSQL restart as the service sees it, without touching the server other tests use)."""
    import psycopg

    name = pg_url.rsplit("/", 1)[1]
    admin_url = pg_url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS {'true' if open_ else 'false'}")
        if not open_:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))


def test_a_database_outage_is_a_503_on_every_call_and_the_sdk_rides_it_out(service, pg_url, monkeypatch):
    """2026-11-27: a POST while PostgreSQL was down failed in the token check, outside the app's
    handlers: a bare 500 'Internal Server Error' with a traceback in the service log, and `luban
    submit` said the URL might not be a luban service; the SDK gave up at once on the 503s.
    2026-12-02: `luban submit`'s 503 said nothing of whether the job was made (a 503 may come after
    the COMMIT) nor how to retry without making it twice. Now it retries with its key, then ends its
    line with the `luban submit --key KEY ...` that repeats it; that command makes the job once."""
    conftest = sys.modules[service.__module__]  # the fixture's conftest module: svc.cli runs its LUBAN
    monkeypatch.setattr(conftest, "LUBAN", QUICK_RETRY)
    svc = service("--nodes", "1", "--tick", "0.2", "--db", pg_url)
    token, alice = svc.user("alice", {"NORMAL": 1})
    _database_open(pg_url, False)
    try:
        for method in ("GET", "POST"):
            r = httpx.request(method, svc.url + "/api/jobs", headers={"Authorization": f"Bearer {token}"},
                              json={"spec": {"name": "j", "command": "true"}}, timeout=30)
            assert r.status_code == 503, (method, r.status_code, r.text[:300])
            assert "database is unavailable" in r.json()["detail"]
        warned = svc.log.read_text().count("database error")
        submit = ["submit", "-n", "1", "--name", "once", "-e", "A=b c", "-t", "90", "--", "true", "x y"]
        result = svc.cli(*submit, token=token, check=False)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert "database is unavailable" in result.stderr and "Traceback" not in result.stderr
        assert svc.log.read_text().count("database error") >= warned + 2  # retried with its key
        hint = re.search(r"\(HTTP 503\); the job may have been submitted: to retry without making it twice "
                         r"\(within 24 h\), run in this shell: cd (\S+) && (luban submit --key ([0-9a-f]{32}) .*)$",
                         result.stderr.strip())
        assert hint, result.stderr
        here, again, key = shlex.split(hint.group(1)), shlex.split(hint.group(2)), hint.group(3)
        assert here == [os.getcwd()], here
        assert again == ["luban", "submit", "--key", key, "--url", svc.url, "-n", "1", "--name", "once", "-e",
                         "A=b c", "-t", "1:30:00", "--", "true", "x y"], again  # -t 90: minutes; the URL: $LUBAN_CLUSTER_URL
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            patient = pool.submit(Client(svc.url, token, retry_for=120).whoami)  # as a job's SDK call
            warned = svc.log.read_text().count("database error")
            wait_for(lambda: svc.log.read_text().count("database error") > warned, 60,
                     what="the SDK's call to meet the outage")
            assert not patient.done()
            wait_for(lambda: PAUSED in svc.log.read_text(), 60, what="the scheduler to note the outage")
            _database_open(pg_url, True)
            assert patient.result(timeout=120)["user"] == "alice"
    finally:
        _database_open(pg_url, True)
    assert alice.submit({"name": "after", "command": "true"})["state"] == "queued"
    made = svc.cli(*again[1:], token=token).stdout  # the command the error named: the job, made once
    assert made.startswith("submitted job "), made
    repeat = svc.cli(*again[1:], token=token).stdout
    assert repeat.startswith(f"job {made.split()[2]} was submitted with --key {key} before"), repeat
    same = svc.cli(*submit[:1], "--key", "other-key", *submit[1:], token=token).stdout  # as the user typed it
    specs = {j["id"]: j["spec"] for j in alice.jobs(all_attempts=True)}
    assert specs[int(made.split()[2])] == specs[int(same.split()[2])]  # the command repeats that spec
    wait_for(lambda: RESUMED in svc.log.read_text(), 60, what="the scheduler to note the database is back")
    text = svc.log.read_text()
    assert "Exception in ASGI application" not in text
    # the scheduler ticked every 0.2 s through the outage: one line when it began, one when it ended
    assert "Traceback" not in text and text.count(PAUSED) == 1 and text.count(RESUMED) == 1, text[-3000:]


PAUSED = "database unavailable: scheduling paused until it is back"
RESUMED = "scheduling resumed"


def test_the_scheduler_logs_a_database_outage_once_not_every_tick(tmp_path, caplog):
    """2026-11-27: every tick while the database was down logged a full traceback ('scheduling tick
    failed'), up to 5 a second at --tick 0.2. Now: one warning when it starts, one line when it ends."""
    import logging

    from luban.cluster import db
    from luban.cluster.executors.local import LocalExecutor
    from luban.cluster.scheduler import Scheduler, Settings

    working = db.sessions(db.open_checked(str(tmp_path / "luban.db")))
    down = db.sessions(db.make_engine(db.url_for(str(tmp_path / "absent" / "luban.db"))))  # cannot be opened
    scheduler = Scheduler(working, LocalExecutor(), Settings(state_dir=str(tmp_path)))
    scheduler.sync_nodes()
    caplog.set_level(logging.INFO, logger="luban.cluster")
    scheduler.sessions = down
    for _ in range(10):
        scheduler.guarded_tick()
    scheduler.sessions = working
    for _ in range(3):
        scheduler.guarded_tick()
    lines = [r.getMessage() for r in caplog.records if r.name == "luban.cluster"]
    assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records if r.exc_info]
    assert sum(PAUSED in m for m in lines) == 1 and sum(RESUMED in m for m in lines) == 1, lines
    assert lines.index(next(m for m in lines if PAUSED in m)) < lines.index(next(m for m in lines if RESUMED in m))


def test_an_attempt_that_ends_while_the_service_is_down_is_charged_until_its_end(service):
    """2026-11-27: the end of an attempt was the moment the scheduler saw it, so a job that ended
    while the service was down (a crash, an upgrade) was charged node-hours for the whole outage."""
    svc = service("--nodes", "1", "--tick", "0.2")
    _, alice = svc.user("alice", {"NORMAL": 1})
    job = alice.submit({"name": "short", "command": "sleep", "args": ["1"]})["id"]
    wait_for(lambda: alice.job(job)["state"] == "running", 60, what="the job running")
    svc.stop(signal.SIGKILL)
    exit_file = svc.state / "runs" / str(job) / "rank0.exit"
    wait_for(exit_file.exists, 60, what="the job's end while the service is down")
    down_until = exit_file.stat().st_mtime
    svc.start()  # seconds after the job's end: what the attempt was charged until before
    ended = alice.wait(job, timeout=60)
    assert ended["state"] == "succeeded"
    assert ended["ended_at"] == down_until, (ended["ended_at"], down_until)
    charged = (ended["ended_at"] - ended["started_at"]) / 3600
    assert abs(ended["node_hours"] - charged) < 1e-4 and charged * 3600 < 30
    usage = {r["who"]: r["node_hours"] for r in alice.usage()}
    assert abs(usage["alice"] - charged) < 1e-4


def test_a_client_that_never_finishes_its_request_is_cut_off(service):
    """2026-11-27: uvicorn kept a connection that never finished its request's head open forever;
    about a thousand of them (no token needed) took every file descriptor of the service: every
    user's call was refused (and accept's EMFILE flooded the log). Now the head has HEAD_TIMEOUT_S, and past
    ``connection_cap()`` connections new ones are closed at once."""
    from luban.cluster.service import HEAD_TIMEOUT_S

    svc = service("--nodes", "1", "--tick", "0.2")
    with socket.create_connection(("127.0.0.1", svc.port), timeout=5) as slow, \
            socket.create_connection(("127.0.0.1", svc.port), timeout=5) as idle:
        slow.sendall(b"GET /api/whoami HTTP/1.1\r\nHost: x\r\n")  # and never the blank line

        def cut(sock) -> bool:
            sock.settimeout(0.2)
            try:
                return sock.recv(1) == b""
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True

        wait_for(lambda: cut(slow) and cut(idle), HEAD_TIMEOUT_S + 30, what="the server to close both connections")
    assert svc.admin().whoami()["user"] == "admin"  # a client that sends its request is served as before


def _read_until_closed(sock, timeout: float) -> bytes:
    """What the server sends until it closes the connection; fails (never hangs) after ``timeout``."""
    import time

    got, deadline = b"", time.monotonic() + timeout
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"the server kept the connection open for {timeout}s; it sent {got[:300]!r}")


@pytest.mark.parametrize("trickle", [True, False], ids=["a-byte-at-a-time", "never"])
def test_a_request_body_that_never_completes_is_a_408_and_the_connection_is_closed(service, trickle):
    """2026-11-28: the head of a request had HEAD_TIMEOUT_S but its body had no bound: headers with
    Content-Length: 1000000 and then a byte every few seconds (or nothing) held the connection and
    the request forever. Now the whole body has --body-timeout seconds: one-line 408, closed."""
    import threading

    svc = service("--nodes", "1", "--tick", "0.2", "--body-timeout", "1")
    head = (f"POST /api/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {svc.admin_token}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{").encode()
    with socket.create_connection(("127.0.0.1", svc.port), timeout=5) as sock:
        sock.sendall(head)
        done = threading.Event()

        def dribble():
            while not done.wait(0.2):
                try:
                    sock.sendall(b" ")
                except OSError:
                    return

        feeder = threading.Thread(target=dribble, daemon=True)
        if trickle:
            feeder.start()
        try:
            answer = _read_until_closed(sock, 60)
        finally:
            done.set()
            if trickle:
                feeder.join(10)
    status, _, rest = answer.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 408"), answer[:300]
    body = rest.split(b"\r\n\r\n", 1)[1]
    assert b"\n" not in body and "within 1s" in json.loads(body)["detail"], body
    assert svc.admin().whoami()["user"] == "admin"  # the service serves the next client as before
    assert "Traceback" not in svc.log.read_text(errors="replace")


def test_a_503_after_the_commit_is_retried_with_its_key_and_answers_the_job_it_made(in_process, monkeypatch):
    """The database fails after the submission's COMMIT (the connection lost before its answer): the
    service answers 503 although the job is made. The client retries with the submission's key and gets
    that job (200, repeated), never a second one. One that gives up first says the job may have been
    made and how to repeat it with its key, which then answers that job."""
    from luban.cluster import client as client_module
    from luban.cluster.client import ApiError
    from sqlalchemy import event
    from sqlalchemy.exc import OperationalError
    from sqlalchemy.orm import Session

    from luban.cluster import service as service_module
    from luban.cluster.executors.local import LocalExecutor
    from luban.cluster.models import Job

    api = in_process(executor=LocalExecutor())
    sessions, http = api.sessions, api.http
    token = api.user("alice", 1)
    record, lost = service_module.record, []

    def record_then_mark(s, kind, *args, **kwargs):
        record(s, kind, *args, **kwargs)
        s.info["submitted"] = kind == "submit"

    def after_commit(session):
        if session.info.pop("submitted", False) and not lost:
            lost.append(True)
            raise OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))

    monkeypatch.setattr(service_module, "record", record_then_mark)
    event.listen(Session, "after_commit", after_commit)
    client = Client("http://testserver", token)
    client.http = http  # the app in this process
    http.headers["Authorization"] = f"Bearer {token}"
    spec = {"name": "once", "command": "true"}
    try:
        job = client.submit(spec, key="commit-lost-1")
        assert lost and job.get("repeated"), job  # the first answer was the 503; the retry got the job
        monkeypatch.setattr(client_module, "SUBMIT_RETRY_S", 0.0)  # no retry: the 503 is the last word
        lost.clear()
        with pytest.raises(ApiError) as gave_up:
            client.submit(spec, key="commit-lost-2")
    finally:
        event.remove(Session, "after_commit", after_commit)
    assert lost and str(gave_up.value).endswith(
        "(HTTP 503); the job may have been submitted: to retry without making it twice (within 24 h), submit it "
        "again with key='commit-lost-2' (luban submit --key commit-lost-2)"), gave_up.value
    again = client.submit(spec, key="commit-lost-2")
    assert again.get("repeated"), again
    with sessions() as s:
        assert [(j.id, j.submit_key) for j in s.query(Job).order_by(Job.id)] == [
            (job["id"], "commit-lost-1"), (again["id"], "commit-lost-2")]
