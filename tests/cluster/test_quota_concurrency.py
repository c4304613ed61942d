"""Quota checks are transactional: racing submitters and schedulers on PostgreSQL never exceed one."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import func, select

from luban.cluster.executors.local import LocalExecutor
from luban.cluster.models import ACTIVE, Allocation, Job, User
from luban.cluster.scheduler import Scheduler
from tests.cluster.conftest import api_client, wait_for

BOUND = 120  # seconds any thread of these tests may block

QUOTA = {"user:alice": 3, "user:bob": 2}


@pytest.fixture
def cluster(pg_url, in_process):
    api = in_process(pg_url, LocalExecutor(nodes=8), tick=0.05, sample_every=1e9)
    schedulers = [api.scheduler] + [Scheduler(api.sessions, LocalExecutor(nodes=8), api.scheduler.settings)
                                    for _ in range(3)]  # on the settings of the first
    tokens = {owner.split(":")[1]: api.user(owner.split(":")[1], nodes) for owner, nodes in QUOTA.items()}
    return api.sessions, schedulers, api.http, tokens


def held(sessions) -> dict[str, int]:
    with sessions() as s:
        return dict(s.execute(select(Job.owner, func.sum(Job.nnodes)).where(Job.state.in_(ACTIVE))
                              .group_by(Job.owner)).all())


def join(thread: threading.Thread) -> None:
    thread.join(BOUND)
    assert not thread.is_alive(), f"{thread.name} still running after {BOUND} s"


def lock_waiters(sessions) -> int:
    """Backends of this database waiting for a lock (PostgreSQL's pg_stat_activity)."""
    from sqlalchemy import text

    with sessions() as s:
        return s.scalar(text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                             "AND wait_event_type = 'Lock'"))


def test_racing_claims_stop_exactly_at_the_quota(cluster):
    sessions, schedulers, http, tokens = cluster
    auth = {"Authorization": f"Bearer {tokens['alice']}"}
    ids = [http.post("/api/jobs", json={"spec": {"name": f"j{i}", "command": "true"}}, headers=auth).json()["id"]
           for i in range(6)]
    barrier, wins = threading.Barrier(6, timeout=BOUND), []

    def claim(i):
        barrier.wait()
        wins.append(schedulers[i % 4].claim(ids[i], (f"node{i + 1}",), "race") is not None)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        join(t)
    assert sum(wins) == 3 == held(sessions)["user:alice"]
    # the node primary key: two schedulers giving one node to two of bob's jobs, one wins
    bob = {"Authorization": f"Bearer {tokens['bob']}"}
    a, b = (http.post("/api/jobs", json={"spec": {"name": n, "command": "true"}}, headers=bob).json()["id"]
            for n in ("a", "b"))
    barrier, wins = threading.Barrier(2, timeout=BOUND), []
    threads = [threading.Thread(target=claim_one, args=(schedulers[k], job, barrier, wins))
               for k, job in ((0, a), (1, b))]
    for t in threads:
        t.start()
    for t in threads:
        join(t)
    assert sorted(wins) == [False, True]


def claim_one(scheduler, job_id, barrier, wins):
    barrier.wait()
    wins.append(scheduler.claim(job_id, ("node8",), "same node") is not None)


def test_concurrent_submissions_and_schedulers_never_exceed_quota(cluster):
    sessions, schedulers, http, tokens = cluster
    stop, peaks, errors = threading.Event(), {o: 0 for o in QUOTA}, []
    barrier = threading.Barrier(8, timeout=BOUND)

    def submit(user, k):
        barrier.wait()
        for i in range(5):
            spec = {"name": f"{user}{k}-{i}", "command": "sleep", "args": ["0.5"], "nodes": 1 + (i + k) % 2,
                    "priority": "AUTO"}
            r = http.post("/api/jobs", json={"spec": spec}, headers={"Authorization": f"Bearer {tokens[user]}"})
            if r.status_code != 201:
                errors.append(r.text)

    def schedule(scheduler):
        while not stop.is_set():
            try:
                scheduler.tick()
            except Exception as err:  # noqa: BLE001 - collected and reported below
                errors.append(repr(err))

    def monitor():
        while not stop.is_set():
            for owner, n in held(sessions).items():
                peaks[owner] = max(peaks[owner], n)
            with sessions() as s:
                per_node = s.execute(select(Allocation.node, func.count()).group_by(Allocation.node)).all()
            if any(c != 1 for _, c in per_node):  # an assert in a thread would only be printed
                errors.append(f"a node allocated twice: {per_node}")
            time.sleep(0.01)

    workers = [threading.Thread(target=submit, args=(u, k)) for u in ("alice", "bob") for k in range(4)]
    loops = [threading.Thread(target=schedule, args=(s,)) for s in schedulers] + [threading.Thread(target=monitor)]
    for t in workers + loops:
        t.start()
    for t in workers:
        join(t)
    deadline = time.time() + 120
    while time.time() < deadline:
        with sessions() as s:
            if not s.scalar(select(func.count()).select_from(Job).where(Job.state.in_(("queued",) + ACTIVE))):
                break
        time.sleep(0.2)
    stop.set()
    for t in loops:
        join(t)
    assert errors == []
    assert peaks == QUOTA, f"peaks {peaks} must reach but never pass the quotas {QUOTA}"
    with sessions() as s:
        states = dict(s.execute(select(Job.state, func.count()).group_by(Job.state)).all())
        others = s.execute(select(Job.id, Job.state, Job.reason).where(Job.state != "succeeded")).all()
    assert states == {"succeeded": 40}, others


def test_two_schedulers_sampling_the_same_instant_do_not_fail(cluster):
    """A sample is keyed by its millisecond: a scheduler whose merge finds no row and inserts
    while another's insert of the same instant is uncommitted loses the race quietly (CI saw
    the IntegrityError escape from a tick)."""
    from luban.cluster.models import Sample

    sessions, schedulers, _, _ = cluster
    now, flushed, done, errors = 1795574192.678, threading.Event(), threading.Event(), []

    def first_writer():
        with sessions.begin() as s:
            s.add(Sample(t=now, nodes=0, held=0, running=0, queued_jobs=0))
            s.flush()  # holds the key until commit
            flushed.set()
            done.wait(timeout=BOUND)  # until the other scheduler's insert is blocked on this key

    def racing_scheduler():
        try:
            schedulers[1].sample(now)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(repr(err))

    writer = threading.Thread(target=first_writer)
    writer.start()
    assert flushed.wait(timeout=BOUND)
    racer = threading.Thread(target=racing_scheduler)
    racer.start()
    try:  # not a sleep: the race is on once PostgreSQL shows the racer waiting for the writer's key
        wait_for(lambda: lock_waiters(sessions), BOUND, 0.02, "the racing insert to wait on the held key")
    finally:
        done.set()
    join(writer)
    join(racer)
    assert errors == []
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(Sample).where(Sample.t == now)) == 1


def test_racing_submissions_stop_at_the_queued_limit(cluster):
    """--max-queued was counted without a lock: 30 submissions at once on PostgreSQL queued 5 jobs
    against a limit of 2 (a hostile sweep, 2026-11-27). The user's row is locked now."""
    sessions, schedulers, _, tokens = cluster
    http, _ = api_client(schedulers[0], max_queued=2)
    barrier, codes = threading.Barrier(12, timeout=BOUND), []

    def submit(i):
        barrier.wait()
        codes.append(http.post("/api/jobs", json={"spec": {"name": f"q{i}", "command": "true"}},
                               headers={"Authorization": f"Bearer {tokens['bob']}"}).status_code)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        join(t)
    assert sorted(codes) == [201] * 2 + [429] * 10, codes


def test_two_admins_adding_one_user_at_once_is_no_500(cluster, tmp_path):
    """Both saw no user 'carol' and inserted it: the loser's IntegrityError was a 500 (PostgreSQL)."""
    _, _, http, _ = cluster
    admin = {"Authorization": "Bearer " + (tmp_path / "admin.token").read_text().strip()}
    barrier, codes = threading.Barrier(8, timeout=BOUND), []

    def add():
        barrier.wait()
        codes.append(http.post("/api/users", json={"name": "carol"}, headers=admin).status_code)

    threads = [threading.Thread(target=add) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        join(t)
    assert len(codes) == 8 and codes.count(201) == 1 and set(codes) <= {201, 409, 422}, codes


def test_admins_demoting_each_other_at_once_leave_one(cluster, tmp_path):
    """The last-admin rule counted the admins without a lock: on PostgreSQL, admins demoting each other at
    once each counted several and left none (no one could manage the cluster)."""
    sessions, _, http, _ = cluster
    admin = {"Authorization": "Bearer " + (tmp_path / "admin.token").read_text().strip()}
    names, tokens = [f"boss{i}" for i in range(6)], {"admin": admin}
    for name in names:
        answer = http.post("/api/users", json={"name": name, "admin": True}, headers=admin)
        assert answer.status_code == 201, answer.text
        tokens[name] = {"Authorization": f"Bearer {answer.json()['token']}"}
    barrier, codes = threading.Barrier(len(names) + 1, timeout=BOUND), []

    def demote(name):  # each admin steps down himself: every request is made by an admin
        barrier.wait()
        codes.append(http.patch(f"/api/users/{name}", json={"admin": False}, headers=tokens[name]).status_code)

    threads = [threading.Thread(target=demote, args=(name,)) for name in ["admin", *names]]
    for t in threads:
        t.start()
    for t in threads:
        join(t)
    with sessions() as s:
        admins = s.scalars(select(User.name).where(User.is_admin)).all()
    assert len(admins) == 1 and codes.count(200) == len(names) and codes.count(422) == 1, (admins, codes)
