"""Outages around the service: its database gone for a while, the service itself down while jobs
end, clients that hold connections open. Nothing is lost, nothing is charged twice, no traceback
reaches a user, and the jobs' SDK rides the outage out."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket

import httpx
import pytest

from luban.cluster.client import Client
from tests.cluster.conftest import wait_for


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


def test_a_database_outage_is_a_503_on_every_call_and_the_sdk_rides_it_out(service, pg_url):
    """2026-11-27: a POST while PostgreSQL was down failed in the token check, outside the app's
    handlers: a bare 500 'Internal Server Error' with a traceback in the service log, and `luban
    submit` said the URL might not be a luban service; the SDK gave up at once on the 503s."""
    svc = service("--nodes", "1", "--tick", "0.2", "--db", pg_url)
    token, alice = svc.user("alice", {"NORMAL": 1})
    _database_open(pg_url, False)
    try:
        for method in ("GET", "POST"):
            r = httpx.request(method, svc.url + "/api/jobs", headers={"Authorization": f"Bearer {token}"},
                              json={"spec": {"name": "j", "command": "true"}}, timeout=30)
            assert r.status_code == 503, (method, r.status_code, r.text[:300])
            assert "database is unavailable" in r.json()["detail"]
        result = svc.cli("submit", "--", "true", token=token, check=False)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert "database is unavailable" in result.stderr and "Traceback" not in result.stderr
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
