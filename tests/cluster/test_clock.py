"""Steps of the wall clock (an NTP step, an admin's ``date -s``) change no duration the platform
measures: time limits, suspend deadlines, the time-sharing quantum, node-hours charged, samples,
client waits. The clock is injected (``luban.cluster.clock.Clock``), the system clock untouched.

2026-11-28: the scheduler subtracted ``time.time()`` readings. A step forward of a day killed
every job with a time limit and every job being suspended (before it could checkpoint) at once,
time-shared every job, and charged a day of node-hours; a step back left time limits and suspend
deadlines unreached, samples unwritten and ``Client.wait`` waiting for as long as the step."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from luban.cluster import clock as clocks
from luban.cluster.executors import NodeInfo, Status
from luban.cluster.models import Job, Sample
from luban.cluster.service import node_hours

DAY = 86400.0


class FakeTime:
    """A wall clock an admin can step and a monotonic clock that only moves forward."""

    def __init__(self):
        self.wall, self.mono = 1.8e9, 1000.0

    def elapse(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds

    def clock(self) -> clocks.Clock:
        return clocks.Clock(wall=lambda: self.wall, mono=lambda: self.mono)


class FakeExecutor:
    """Two nodes; jobs run until ``end(handle, code)``; kills and suspends are recorded."""

    def __init__(self, t: FakeTime):
        self.t, self.ended, self.kills, self.suspends = t, {}, [], []

    def discover(self):
        return [NodeInfo(f"node{i}") for i in (1, 2, 3)]

    def start(self, launch):
        return json.dumps({"id": launch.job_id})

    def poll(self, handle):
        if handle in self.ended:
            code, at = self.ended[handle]
            return Status(done=True, exit_code=code, ended_at=at)
        return Status(done=False)

    def end(self, job_id: int, code: int) -> None:  # an exit file written now: its mtime is the wall clock's
        self.ended[json.dumps({"id": job_id})] = (code, self.t.wall)

    def suspend(self, handle):
        self.suspends.append(json.loads(handle)["id"])

    def kill(self, handle):
        self.kills.append(json.loads(handle)["id"])

    def find(self, launch):
        return None


@pytest.fixture
def cluster(in_process):
    t = FakeTime()  # the API's clock (submissions, node-hours, events) too
    executor = FakeExecutor(t)
    api = in_process(executor=executor, time=t, quantum=3600.0, suspend_timeout=600.0, sample_every=10.0)
    users = {name: {"Authorization": "Bearer " + api.user(name, 3)} for name in ("alice", "bob")}
    return t, api.scheduler, executor, api.http, users, api.sessions


def submit(http, who, **spec) -> int:
    r = http.post("/api/jobs", json={"spec": {"name": "j", "command": "true", **spec}}, headers=who)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def job(sessions, job_id: int) -> Job:
    with sessions() as s:
        return s.get(Job, job_id)


def test_the_clock_moves_with_elapsed_time_not_with_steps_of_the_wall_clock():
    t = FakeTime()
    c = t.clock()
    start = c.now()
    assert start == t.wall and c.step() == 0.0
    t.elapse(5)
    t.wall += DAY  # stepped forward
    assert c.now() == start + 5 and c.step() == DAY
    assert c.from_wall(t.wall) == c.now()  # a file written now, read on this clock's scale
    t.wall -= 3 * DAY
    assert c.now() == start + 5 and c.from_wall(t.wall - 2) == c.now() - 2
    t.wall = c.now() + 0.3  # less than a second apart: no step (NTP slews both clocks alike)
    assert c.step() == 0.0


def test_a_step_forward_kills_no_job_and_charges_no_time(cluster):
    t, scheduler, executor, http, users, sessions = cluster
    limited = submit(http, users["alice"], time_limit=7200)
    suspending = submit(http, users["alice"])
    other = submit(http, users["bob"])  # the quantum: a step must not make bob's job yield to anyone
    scheduler.tick()
    t.elapse(1)
    scheduler.tick()
    assert all(job(sessions, j).state == "running" for j in (limited, suspending, other))
    assert http.post(f"/api/jobs/{suspending}/suspend", headers=users["alice"]).status_code == 200
    scheduler.tick()
    assert job(sessions, suspending).state == "suspending" and executor.suspends == [suspending]
    samples = len(_samples(sessions))

    t.wall += 30 * DAY  # an admin's `date -s` a month ahead
    t.elapse(2)
    bob_waits = submit(http, users["bob"], nodes=3)  # waiting: the quantum would time-share if it were reached
    for _ in range(3):
        scheduler.tick()
        t.elapse(1)
    assert executor.kills == [], "a step of the wall clock killed a job (time limit or suspend deadline)"
    assert [job(sessions, j).state for j in (limited, suspending, other)] == ["running", "suspending", "running"]
    assert job(sessions, bob_waits).state == "queued"
    hours = http.get(f"/api/jobs/{limited}", headers=users["alice"]).json()["node_hours"]
    assert 0 <= hours < 0.01, hours
    assert len(_samples(sessions)) <= samples + 1

    executor.end(limited, 0)  # its exit file's mtime is the stepped wall clock's
    executor.end(suspending, 75)
    scheduler.tick()
    for j in (limited, suspending):
        ended = job(sessions, j)
        assert ended.state in ("succeeded", "suspended")
        assert 0 <= ended.ended_at - ended.started_at < 60, (ended.started_at, ended.ended_at)
        assert 0 <= node_hours(ended) < 0.02
    requeued = http.get(f"/api/jobs/{suspending}?latest=true", headers=users["alice"]).json()
    assert requeued["id"] != suspending and abs(requeued["queued_at"] - scheduler.clock.now()) < 60


def test_a_step_back_ends_no_wait_late(cluster):
    t, scheduler, executor, http, users, sessions = cluster
    limited = submit(http, users["alice"], time_limit=60)
    suspending = submit(http, users["alice"])
    scheduler.tick()
    t.elapse(1)
    scheduler.tick()
    assert http.post(f"/api/jobs/{suspending}/suspend", headers=users["alice"]).status_code == 200
    scheduler.tick()
    samples = len(_samples(sessions))

    t.wall -= 30 * DAY  # set back a month
    for _ in range(7):  # 700 s: past the time limit (60 s) and the suspend deadline (600 s)
        t.elapse(100)
        scheduler.tick()
    assert sorted(executor.kills) == sorted([limited, suspending]), executor.kills
    assert len(_samples(sessions)) >= samples + 5, "samples stopped while the wall clock was behind"
    executor.end(limited, 137)
    executor.end(suspending, 137)
    scheduler.tick()
    limited_job = job(sessions, limited)
    assert limited_job.state == "failed" and "time limit" in limited_job.reason
    for j in (limited, suspending):
        ended = job(sessions, j)
        assert 600 <= ended.ended_at - ended.started_at < 800, (ended.started_at, ended.ended_at)


def _samples(sessions) -> list:
    with sessions() as s:
        return s.scalars(select(Sample)).all()


def test_client_wait_ends_on_time_when_the_wall_clock_goes_back(monkeypatch):
    """``Client.wait``'s timeout held while the wall clock was set back (it compared time.time())."""
    import time

    from luban.cluster import client as client_module

    wall = [2e9]

    def stepping_back():
        wall[0] -= 3600  # every read an hour earlier
        return wall[0]

    monkeypatch.setattr(client_module.time, "time", stepping_back)
    polls = []

    def latest(_self, job_id):
        polls.append(job_id)
        if len(polls) > 200:  # bounded: the wait must have ended long before
            raise AssertionError("Client.wait did not time out while the wall clock went back")
        return {"state": "running"}

    monkeypatch.setattr(client_module.Client, "latest", latest)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        client_module.Client("http://127.0.0.1:9", "t").wait(1, timeout=0.3, poll=0.01)
    assert time.monotonic() - started < 60
