"""Restarting the service (even killed with SIGKILL) loses no job and no state: SQLite and PostgreSQL."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from luban.cluster.client import Client
from tests.cluster.conftest import PYTHON, Service, kill_jobs, wait_for

TRAINER = str(Path(__file__).with_name("fake_trainer.py"))


def scenario(tmp_path, extra):
    state = tmp_path / "state"
    svc = Service(state, ["--nodes", "2", "--tick", "0.2", *extra]).start()
    try:
        admin = svc.admin()
        admin.add_group("vision")
        token = admin.add_user("alice", group="vision")["token"]
        admin.set_quota("user:alice", "NORMAL", 2)
        alice = Client(svc.url, token)
        long = alice.submit({"name": "long", "command": PYTHON, "nodes": 1, "workdir": str(tmp_path),
                             "args": [TRAINER, str(tmp_path / "s"), "30", "--sleep", "0.1"]})["id"]
        wide = alice.submit({"name": "wide", "command": "true", "nodes": 2})["id"]
        wait_for(lambda: alice.job(long)["state"] == "running", 60, what="long running")
        alice.call("PUT", f"/jobs/{long}/whole_life_state", json={"value": 42})
        before = {j["id"]: (j["state"], j["chain_id"], j["nodes"]) for j in alice.jobs(all_attempts=True)}
        assert before[wide][0] == "queued"
        events_before = len(alice.events(long))
        svc.stop(signal.SIGKILL)  # a crash: nothing is flushed on the way out

        svc.start()  # same state directory and database, new process
        again = {j["id"]: (j["state"], j["chain_id"], j["nodes"]) for j in alice.jobs(all_attempts=True)}
        assert again.keys() == before.keys()  # no job lost, no attempt added
        assert again[long][1:] == before[long][1:] and again[long][0] in ("running", "succeeded")
        assert again[wide][1] == before[wide][1]
        assert alice.whoami()["group"] == "vision"  # the user's token still works
        assert [q["nodes"] for q in alice.quota()] == [2]
        assert alice.job(long)["whole_life_state"] == 42
        assert len(alice.events(long)) >= events_before
        assert alice.wait(long, timeout=120)["state"] == "succeeded"  # the job outlived the crash
        assert "done at step 30" in alice.logs(long)["text"]
        assert alice.wait(wide, timeout=60)["state"] == "succeeded"
    finally:
        svc.stop()
        kill_jobs(state)


def test_restart_keeps_jobs_and_state_sqlite(tmp_path):
    scenario(tmp_path, [])
    assert (tmp_path / "state" / "luban.db").exists()


@pytest.mark.usefixtures("pg_url")
def test_restart_keeps_jobs_and_state_postgresql(tmp_path, pg_url):
    scenario(tmp_path, ["--db", pg_url])
    assert not (tmp_path / "state" / "luban.db").exists()


def test_a_start_killed_between_the_admin_and_its_token_is_not_locked_out(tmp_path):
    """The admin user was committed before admin.token was written: a kill between the two left a
    database whose admin no one could act as (every later start saw a user and wrote no token).
    Here the token file cannot be written: nothing is committed, and the next start makes both."""
    from luban.cluster import db
    from luban.cluster.models import User
    from luban.cluster.scheduler import token_hash
    from luban.cluster.service import ensure_admin

    sessions = db.sessions(db.open_checked(str(tmp_path / "luban.db")))
    with pytest.raises(OSError):
        ensure_admin(sessions, tmp_path / "absent")  # the write fails as a kill there would stop it
    path = ensure_admin(sessions, tmp_path)
    assert path == tmp_path / "admin.token" and path.stat().st_mode & 0o777 == 0o600
    with sessions() as s:
        assert s.get(User, "admin").token_hash == token_hash(path.read_text().strip())
    assert ensure_admin(sessions, tmp_path) is None and sorted(p.name for p in tmp_path.iterdir()) == [
        "admin.token", "luban.db", *(["luban.db-shm", "luban.db-wal"] if (tmp_path / "luban.db-wal").exists() else [])]


def test_services_starting_at_once_on_one_postgresql_database_both_come_up(pg_url, tmp_path):
    """Two services on one new database: both migrated at once and one failed with 'duplicate key
    value violates unique constraint' named as an unusable --db; now one migrates, the other waits,
    and exactly one makes the admin (the other's IntegrityError is not a crash)."""
    import threading

    from luban.cluster import db
    from luban.cluster.service import ensure_admin

    barrier, results, errors = threading.Barrier(2), {}, []

    def start(i):
        try:
            barrier.wait(30)
            sessions = db.sessions(db.open_checked(pg_url))
            (tmp_path / str(i)).mkdir()
            barrier.wait(30)
            results[i] = ensure_admin(sessions, tmp_path / str(i))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert not errors, errors
    made = [path for path in results.values() if path is not None]
    assert len(results) == 2 and len(made) == 1 and made[0].is_file(), results
