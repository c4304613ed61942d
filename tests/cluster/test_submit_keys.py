"""A submission's Idempotency-Key lives ``spec.SUBMIT_KEY_TTL_S`` (24 h, as Stripe's): a repeat within
it answers the job the key made, one after it makes a new job (SQLite and PostgreSQL; the service's
clock is moved, nothing sleeps).

2026-12-02: ``jobs.submit_key`` was unique per user for ever: a user (or a script) reusing a key
months later got the old job back, "submitted" but never run again."""

from __future__ import annotations

import threading

import pytest

from luban.cluster.client import SUBMIT_KEY_HEADER
from luban.cluster.models import Job
from luban.cluster.spec import SUBMIT_KEY_TTL_S
from tests.cluster.test_clock import FakeTime

RACERS = 6  # submissions of one expired key at once


@pytest.fixture
def api(db_url, in_process):
    """(post(spec, key), the service's FakeTime, sessions) over the API in this process."""
    t = FakeTime()
    service = in_process(db_url, time=t)
    token = service.user("alice", 1)

    def post(spec: dict, key: str):
        return service.http.post("/api/jobs", json={"spec": spec},
                                 headers={"Authorization": f"Bearer {token}", SUBMIT_KEY_HEADER: key})

    return post, t, service.sessions


def keys(sessions) -> list[tuple[int, str | None]]:
    with sessions() as s:
        return [(j.id, j.submit_key) for j in s.query(Job).order_by(Job.id)]


def test_a_key_answers_its_job_for_its_lifetime_and_makes_a_new_one_after(api):
    post, t, sessions = api
    spec, other = {"name": "a", "command": "true"}, {"name": "b", "command": "true"}
    first = post(spec, "nightly-1")
    assert first.status_code == 201, first.text
    t.elapse(SUBMIT_KEY_TTL_S - 1)
    again = post(spec, "nightly-1")
    assert again.status_code == 200 and again.json()["repeated"] and again.json()["id"] == first.json()["id"]
    refused = post(other, "nightly-1")
    assert refused.status_code == 409 and "free again 24 h after" in refused.json()["detail"], refused.text
    t.elapse(1)  # the key is SUBMIT_KEY_TTL_S old: free again, for any spec
    later = post(other, "nightly-1")
    assert later.status_code == 201 and later.json()["id"] != first.json()["id"], later.text
    assert keys(sessions) == [(first.json()["id"], None), (later.json()["id"], "nightly-1")]
    repeat = post(other, "nightly-1")  # the new job's own lifetime starts now
    assert repeat.status_code == 200 and repeat.json()["id"] == later.json()["id"], repeat.text


def test_racing_repeats_of_an_expired_key_make_one_new_job(api):
    """The key's old job cleared and its new one made in one transaction, under the user's row lock and
    the (user, submit_key) unique index: submissions racing with the expired key make one job."""
    post, t, sessions = api
    spec = {"name": "r", "command": "true"}
    old = post(spec, "race-ttl").json()["id"]
    t.elapse(SUBMIT_KEY_TTL_S)
    barrier, answers = threading.Barrier(RACERS, timeout=60), []

    def racer() -> None:
        barrier.wait()
        answers.append(post(spec, "race-ttl"))

    threads = [threading.Thread(target=racer) for _ in range(RACERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive()
    assert sorted(a.status_code for a in answers) == [200] * (RACERS - 1) + [201], [a.text for a in answers]
    new = {a.json()["id"] for a in answers}
    assert len(new) == 1 and old not in new
    assert keys(sessions) == [(old, None), (new.pop(), "race-ttl")]
