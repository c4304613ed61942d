"""`GET /api/jobs` and `luban jobs` are bounded: the newest `limit` rows (by id), oldest first, and
`X-Total-Count` saying how many matched. They loaded every visible row into Python (and, for the
latest-attempt view, every attempt of every chain, deduplicated in Python): one user submitting
short jobs all day made every admin's `luban jobs` and the dashboard slower and bigger forever."""

from __future__ import annotations

import json
import secrets

import pytest
from sqlalchemy import event, select

from luban.cluster import client as client_module
from luban.cluster.client import TOTAL_HEADER, Client
from luban.cluster.spec import JOBS_LIMIT, JOBS_LIMIT_MAX
from luban.cluster.models import Job, User

ENDED = ("succeeded", "failed", "stopped")
MULTI = 9  # every MULTI-th chain of alice has three attempts: suspended, suspended, then its latest


@pytest.fixture
def listing(db_url, in_process):
    """An in-process API (no scheduler thread) over a database holding a few hundred jobs, written
    straight into it: alice's chains (some of three attempts, their later attempts interleaved with
    newer chains), carol's (half in alice's group), bob's (no group)."""
    api = in_process(db_url, sample_every=1e9)
    http, sessions, admin = api.http, api.sessions, api.admin
    tokens = {"admin": (api.state / "admin.token").read_text().strip()}
    assert http.post("/api/groups", json={"name": "vision"}, headers=admin).status_code == 201
    for name, group in (("alice", "vision"), ("carol", "vision"), ("bob", None)):
        tokens[name] = api.user(name, group=group)
    with sessions.begin() as s:
        pending = []  # (chain, first id, attempt) of multi-attempt chains still to be requeued
        for i in range(230):
            user, group = [("alice", None), ("alice", "vision"), ("bob", None), ("carol", "vision"),
                           ("alice", None), ("carol", None)][i % 6]
            first = add(s, "c" + secrets.token_hex(6), user, group, 0, i, "suspended" if i % MULTI == 0 else
                        ENDED[i % 3])
            if i % MULTI == 0:
                pending.append(first)
            if i % 7 == 3 and pending:  # a requeued attempt of an older chain: a newer id than this chain's
                prev = pending.pop(0)
                again = add(s, prev.chain_id, prev.user, prev.group, prev.restart_count + 1, prev.first_id,
                            "suspended" if prev.restart_count == 0 else ["queued", "running", "succeeded"][i % 3])
                if prev.restart_count == 0:
                    pending.append(again)
    return sessions, http, tokens


def add(s, chain: str, user: str, group: str | None, restart: int, first_id: int | None, state: str) -> Job:
    job = Job(chain_id=chain, first_id=first_id, restart_count=restart, whole_life_state=0, user=user, group=group,
              owner=f"group:{group}" if group else f"user:{user}", name=f"j{restart}", spec={"command": "true"},
              priority=10, node_group="default", nnodes=1, state=state, chain_submitted_at=1.0, place=1.0,
              queued_at=1.0, nodes=[], requested=0, stop_reason=0, reason=state)
    s.add(job)
    s.flush()
    if restart == 0:
        job.first_id = job.id
    return job


def reference(sessions, viewer: str, all_attempts: bool, state: str | None) -> list[int]:
    """What the listing meant before it was bounded (every visible row; the last of each chain)."""
    with sessions() as s:
        me = s.get(User, viewer)
        rows = s.scalars(select(Job).order_by(Job.id)).all()
    rows = [j for j in rows if (me.is_admin or j.user == viewer or (me.group and j.group == me.group))
            and (state is None or j.state in state.split(","))]
    if not all_attempts:
        rows = sorted({j.chain_id: j for j in rows}.values(), key=lambda j: j.id)
    return [j.id for j in rows]


def get(http, token: str, **params):
    return http.get("/api/jobs", params=params, headers={"Authorization": f"Bearer {token}"})


def test_the_newest_limit_rows_oldest_first_and_the_total_in_a_header(listing):
    sessions, http, tokens = listing
    for viewer in ("admin", "alice", "bob"):
        for all_attempts in (False, True):
            for state in (None, "suspended", "queued,running,succeeded"):
                want = reference(sessions, viewer, all_attempts, state)
                for limit in (None, 1, 7, JOBS_LIMIT_MAX):
                    params = {"all": all_attempts} | ({"state": state} if state else {}) | (
                        {"limit": limit} if limit else {})
                    r = get(http, tokens[viewer], **params)
                    assert r.status_code == 200, r.text
                    ids = [j["id"] for j in r.json()]
                    assert (viewer, params, ids) == (viewer, params, want[-(limit or JOBS_LIMIT):]), want
                    assert int(r.headers[TOTAL_HEADER]) == len(want), (viewer, params)
    assert len(reference(sessions, "admin", False, None)) > JOBS_LIMIT  # the default limit did cut


def test_the_latest_attempt_of_each_chain_even_when_it_was_requeued_late(listing):
    sessions, http, tokens = listing
    with sessions() as s:
        chains = {}
        for job in s.scalars(select(Job).where(Job.user == "alice").order_by(Job.id)):
            chains.setdefault(job.chain_id, []).append(job)
    three = [attempts for attempts in chains.values() if len(attempts) == 3]
    assert len(three) >= 3
    shown = {j["chain_id"]: j for j in get(http, tokens["alice"], limit=JOBS_LIMIT_MAX).json()}
    assert len(shown) == len(chains) + sum(1 for j in shown.values() if j["user"] == "carol")
    for attempts in three:
        latest = shown[attempts[0].chain_id]
        assert (latest["id"], latest["restart_count"], latest["state"]) == (
            attempts[-1].id, 2, attempts[-1].state)
        assert latest["first_id"] == attempts[0].id
    # the SDK's latest() of a chain far behind the newest JOBS_LIMIT rows: its newest attempt
    alice = Client("http://testserver", tokens["alice"])
    alice.http = http
    http.headers["Authorization"] = f"Bearer {tokens['alice']}"
    oldest = three[0]
    assert alice.latest(oldest[0].id)["id"] == oldest[-1].id
    assert alice.job(oldest[1].id)["id"] == oldest[1].id


def test_only_the_rows_answered_are_loaded(listing):
    """The old listing built a Job for every visible attempt on each call; now SQL picks the rows."""
    sessions, http, tokens = listing
    loaded = []
    listener = lambda target, _context: loaded.append(target.id)  # noqa: E731
    event.listen(Job, "load", listener)
    try:
        for params in ({}, {"all": True}, {"limit": 5, "state": "suspended"}):
            loaded.clear()
            rows = get(http, tokens["admin"], **params).json()
            assert len(loaded) <= len(rows) == (params.get("limit") or JOBS_LIMIT), (params, len(loaded))
    finally:
        event.remove(Job, "load", listener)


def test_the_sdk_pages_through_everything_only_when_asked(listing, monkeypatch):
    sessions, http, tokens = listing
    admin = Client("http://testserver", tokens["admin"])
    admin.http = http
    http.headers["Authorization"] = f"Bearer {tokens['admin']}"
    for all_attempts in (False, True):
        want = reference(sessions, "admin", all_attempts, None)
        rows = admin.jobs(all_attempts=all_attempts)
        assert ([j["id"] for j in rows], rows.total) == (want[-JOBS_LIMIT:], len(want))
        rows = admin.jobs(all_attempts=all_attempts, limit=3)
        assert ([j["id"] for j in rows], rows.total) == (want[-3:], len(want))
        monkeypatch.setattr(client_module, "JOBS_LIMIT_MAX", 7)  # pages of 7: many of them
        rows = admin.jobs(all_attempts=all_attempts, limit=0)
        monkeypatch.undo()
        assert ([j["id"] for j in rows], rows.total) == (want, len(want))
    assert admin.jobs(state="queued", limit=0) == [
        j for j in admin.jobs(state="queued", limit=JOBS_LIMIT_MAX)]


BAD = [("limit=0", "limit = 0: an integer from 1 to 10000"),
       ("limit=-1", "limit = -1: an integer from 1 to 10000"),
       ("limit=10001", "limit = 10001: an integer from 1 to 10000"),
       ("limit=99999999999999999999999", "limit = 99999999999999999999999: an integer from 1 to 10000"),
       ("limit=x", "limit = 'x': "),
       ("limit=1.5", "limit = '1.5': "),
       ("limit=", "limit = '': "),
       ("before=0", "before = 0: a job id from 1 to 2147483647"),
       ("before=2147483648", "before = 2147483648: a job id"),
       ("before=x", "before = 'x': ")]


def test_bad_limits_are_one_line(listing):
    _, http, tokens = listing
    for query, words in BAD:
        r = http.get("/api/jobs?" + query, headers={"Authorization": f"Bearer {tokens['alice']}"})
        assert (query, r.status_code) == (query, 422), r.text[:300]
        detail = r.json()["detail"]
        assert detail.startswith(words) and "\n" not in detail, detail


def test_luban_jobs_says_on_stderr_how_many_it_left_out(service):
    svc = service("--nodes", "1", "--tick", "0.2")
    token, alice = svc.user("alice", {"NORMAL": 1})
    ids = [alice.submit({"name": f"t{i}", "command": "true"})["id"] for i in range(5)]

    out = svc.cli("jobs", "--limit", "2", token=token)
    assert out.stderr == "(showing the newest 2 of 5 jobs; --limit N for more, --limit 0 for all)\n"
    assert [line.split()[0] for line in out.stdout.splitlines()[1:]] == [str(i) for i in ids[-2:]]
    out = svc.cli("jobs", "--limit", "2", "--all", "--json", token=token)
    assert [j["id"] for j in json.loads(out.stdout)] == ids[-2:]  # a list, as before
    assert out.stderr == "(showing the newest 2 of 5 attempts; --limit N for more, --limit 0 for all)\n"
    for limit in ("0", "5"):
        out = svc.cli("jobs", "--limit", limit, "--json", token=token)
        assert ([j["id"] for j in json.loads(out.stdout)], out.stderr) == (ids, "")
    out = svc.cli("jobs", token=token)
    assert (len(out.stdout.splitlines()), out.stderr) == (6, "")  # the default: 100
    for bad in ("-1", "10001", "x"):
        out = svc.cli("jobs", "--limit", bad, token=token, check=False)
        assert out.returncode == 2 and "--limit" in out.stderr and len(out.stderr.strip().splitlines()) == 1, (
            bad, out.stderr)
