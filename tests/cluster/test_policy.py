"""The policy as a pure function: unit cases for each rule and hypothesis properties."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luban.cluster import priority as prio
from luban.cluster.policy import JobView, NodeView, Snapshot, plan


def nodes(n, zones=1, group="default"):
    return [NodeView(f"n{i:02d}", group, f"z{i * zones // n}") for i in range(n)]


def job(id, user="u", prio=10, n=1, state="queued", place=None, since=0.0, held=(), owner=None, group="default"):
    return JobView(id, user, owner or f"user:{user}", prio, group, n, state,
                   float(id) if place is None else place, since, tuple(held))


def quota(**per_user):
    return {(f"user:{u}", "default", p): n for u, levels in per_user.items() for p, n in levels.items()}


def test_priority_levels_and_auto():
    assert [int(p) for p in prio.LEVELS] == [50, 40, 30, 20, 10, 8, 5, 0]
    assert prio.parse("high") == prio.Priority.HIGH and prio.parse(8) == prio.Priority.UNDER_NORMAL
    assert prio.parse("auto") == prio.AUTO
    assert prio.resolve_auto({30: 2, 10: 8}, {30: 2}, 2) == prio.Priority.NORMAL
    assert prio.resolve_auto({30: 2, 10: 8}, {30: 2, 10: 8}, 2) == prio.Priority.HIGH  # queue at the top
    assert prio.resolve_auto({30: 2}, {}, 3) is None


def test_higher_priority_preempts_and_lower_waits():
    snap = Snapshot(100.0, nodes(4), [job(1, "lo", 0, 4, "running", held=[f"n0{i}" for i in range(4)]),
                                      job(2, "hi", 30, 2)], quota(lo={0: 4}, hi={30: 4}))
    out = plan(snap)
    assert [s[0] for s in out.suspends] == [1] and out.suspends[0][1].startswith("preempted: capacity")
    assert out.starts == [] and out.waits[2].startswith("admitted; waiting for 2")


def test_resumed_job_keeps_its_place_and_quota_is_enforced():
    snap = Snapshot(100.0, nodes(2), [job(5, "a", 10, 1, place=1.0), job(6, "b", 10, 1, place=2.0),
                                      job(7, "b", 10, 1, place=0.5)], quota(a={10: 1}, b={10: 1}))
    out = plan(snap)
    assert sorted(s[0] for s in out.starts) == [5, 7]  # 7 resumed with the oldest place
    assert out.waits[6].startswith("quota: user:b holds 1 of 1")


def test_whole_nodes_in_one_zone_preferred():
    snap = Snapshot(0.0, nodes(8, zones=2), [job(1, n=3, state="running", held=["n00", "n01", "n02"]),
                                            job(2, n=3)], quota(u={10: 8}))
    (start,) = plan(snap).starts
    assert set(start[1]) == {"n04", "n05", "n06"} and "zone z1" in start[2]
    spread = Snapshot(0.0, nodes(8, zones=2), [job(1, n=3, state="running", held=["n00", "n01", "n02"]),
                                              job(3, n=5)], quota(u={10: 8}))
    (start,) = plan(spread).starts
    assert len(set(start[1])) == 5 and "spans zones" in start[2]


def test_no_preemption_between_jobs_of_one_user_and_priority():
    # b's new job has an older place than its running job: it must not displace it
    snap = Snapshot(10.0, nodes(1), [job(1, "b", 10, 1, "running", place=5.0, held=["n00"]),
                                     job(2, "b", 10, 1, place=1.0)], quota(b={10: 2}), quantum=1.0)
    out = plan(snap)
    assert out.suspends == [] and out.starts == []


def test_time_sharing_longest_running_other_user_yields():
    running = [job(1, "a", 10, 1, "running", since=0.0, held=["n00"]),
               job(2, "c", 10, 1, "running", since=50.0, held=["n01"])]
    snap = Snapshot(100.0, nodes(2), running + [job(3, "b", 10, 1, since=10.0)], quota(a={10: 1}, b={10: 1}, c={10: 1}),
                    quantum=30.0)
    out = plan(snap)
    assert [(s[0], s[2]) for s in out.suspends] == [(1, True)]
    short = Snapshot(100.0, nodes(2), running + [job(3, "b", 10, 1, since=90.0)],
                     quota(a={10: 1}, b={10: 1}, c={10: 1}), quantum=30.0)
    assert plan(short).suspends == []  # b has not waited a quantum yet


# -- properties ----------------------------------------------------------------------------------
LEVELS = [0, 5, 10, 30, 50]


@st.composite
def snapshots(draw):
    groups = draw(st.lists(st.sampled_from(["g1", "g2"]), min_size=1, max_size=2, unique=True))
    all_nodes = []
    for g in groups:
        count = draw(st.integers(1, 8))
        zones = draw(st.integers(1, 3))
        all_nodes += [NodeView(f"{g}-{i}", g, f"z{i % zones}", draw(st.booleans()) or i % 3 != 0)
                      for i in range(count)]
    users = ["u0", "u1", "u2"]
    owners = users + ["team"]
    quota = {(f"user:{o}" if o != "team" else "group:team", g, p): draw(st.integers(0, 6))
             for o in owners for g in groups for p in LEVELS if draw(st.booleans())}
    free = {n.name for n in all_nodes}
    jobs = []
    for i in range(draw(st.integers(0, 14))):
        g = draw(st.sampled_from(groups))
        user = draw(st.sampled_from(users))
        owner = "group:team" if draw(st.booleans()) and user != "u2" else f"user:{user}"
        n = draw(st.integers(1, 4))
        state = draw(st.sampled_from(["queued", "queued", "running", "starting", "suspending"]))
        held = ()
        if state != "queued":
            pool = sorted(x.name for x in all_nodes if x.node_group == g and x.name in free)
            if len(pool) < n:
                state = "queued"
            else:
                held = tuple(draw(st.permutations(pool))[:n])
                free -= set(held)
        jobs.append(JobView(i, user, owner, draw(st.sampled_from(LEVELS)), g, n, state,
                            draw(st.floats(0, 100)), draw(st.floats(0, 100)), held))
    return Snapshot(draw(st.floats(100, 300)), all_nodes, jobs, quota, draw(st.sampled_from([10.0, 50.0, 1e9])))


def outcome(snap, out):
    """After the plan: which jobs hold or will hold nodes (suspending ones still hold theirs)."""
    suspended = {s[0] for s in out.suspends}
    started = {s[0]: s[1] for s in out.starts}
    keeps = [j for j in snap.jobs if j.state in ("running", "starting") and j.id not in suspended]
    return suspended, started, keeps


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots())
def test_allocations_never_exceed_nodes_or_quota(snap):
    out = plan(snap)
    suspended, started, keeps = outcome(snap, out)
    by_id = {j.id: j for j in snap.jobs}
    node = {n.name: n for n in snap.nodes}
    held_now = {x for j in snap.jobs if j.state != "queued" for x in j.nodes}
    given_out = [x for nodes in started.values() for x in nodes]
    assert len(given_out) == len(set(given_out)), "a node was given twice"
    assert not set(given_out) & held_now, "a node still held was given out"
    for job_id, names in started.items():
        j = by_id[job_id]
        assert j.state == "queued" and len(names) == j.nnodes
        assert all(node[x].node_group == j.node_group and node[x].schedulable for x in names)
    use = defaultdict(int)
    for j in keeps + [by_id[i] for i in started]:
        use[(j.owner, j.node_group, j.priority)] += j.nnodes
    for key, n in use.items():
        assert n <= snap.quota.get(key, 0), f"{key} holds {n} > quota"
    admitted = defaultdict(int)
    for job_id in out.admitted:
        admitted[by_id[job_id].node_group] += by_id[job_id].nnodes
    for g, n in admitted.items():
        assert n <= sum(1 for x in snap.nodes if x.node_group == g and (x.schedulable or x.name in held_now))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots())
def test_higher_priority_never_waits_for_lower(snap):
    out = plan(snap)
    by_id = {j.id: j for j in snap.jobs}
    capacity = defaultdict(int)  # the nodes a job can be given
    for x in snap.nodes:
        capacity[x.node_group] += x.schedulable
    unschedulable = {x.name for x in snap.nodes if not x.schedulable}

    def need(job):  # a node no longer schedulable counts for the job on it alone (test_review_1202)
        return job.nnodes - (len(unschedulable & set(job.nodes)) if job.state != "queued" else 0)

    for j in snap.jobs:
        if j.state not in ("queued", "running", "starting") or j.id in out.admitted:
            continue
        if not out.waits.get(j.id, "").startswith("capacity") and j.state == "queued":
            continue  # waits for its own quota or for a same-user job: not for lower priorities
        above = sum(need(by_id[i]) for i in out.admitted
                    if by_id[i].node_group == j.node_group and by_id[i].priority >= j.priority)
        lower = sum(need(by_id[i]) for i in out.admitted
                    if by_id[i].node_group == j.node_group and by_id[i].priority < j.priority)
        if out.waits.get(j.id, "").startswith("capacity") or any(
                s[0] == j.id and "capacity" in s[1] for s in out.suspends):
            assert above + need(j) > capacity[j.node_group], (
                f"job {j.id} (priority {j.priority}) left out while {lower} nodes went to lower priorities")


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots())
def test_no_preemption_within_one_user_and_priority(snap):
    out = plan(snap)
    by_id = {j.id: j for j in snap.jobs}
    victims = {(by_id[i].node_group, by_id[i].user, by_id[i].priority) for i, _, _ in out.suspends}
    winners = {(by_id[i].node_group, by_id[i].user, by_id[i].priority) for i in out.admitted
               if by_id[i].state == "queued"}
    assert not victims & winners
    for i, why, time_share in out.suspends:
        assert by_id[i].state in ("running", "starting")
        if time_share:
            assert snap.now - by_id[i].since >= snap.quantum


def test_a_preemption_names_the_job_it_yields_to():
    snap = Snapshot(100.0, nodes(4), [job(1, "lo", 0, 4, "running", held=[f"n0{i}" for i in range(4)]),
                                      job(2, "hi", 30, 2)], quota(lo={0: 4}, hi={30: 4}))
    assert "(for job 2)" in plan(snap).suspends[0][1]


def test_wait_reasons_name_drained_nodes():
    drained = [NodeView(n.name, n.node_group, n.zone, schedulable=n.name != "n03") for n in nodes(4)]
    out = plan(Snapshot(100.0, drained, [job(1, "a", 10, 4)], quota(a={10: 4})))
    assert out.waits[1].endswith("1 node(s) of default are drained: it cannot run until they return")
    busy = [job(1, "a", 10, 3, "running", held=["n00", "n01", "n02"]), job(2, "b", 10, 1)]
    out = plan(Snapshot(100.0, drained, busy, quota(a={10: 3}, b={10: 1})))
    assert "1 node(s) of default are drained" in out.waits[2] and "until they return" not in out.waits[2]


def test_jobs_on_a_node_taken_down_are_suspended_and_requeued_elsewhere():
    ns = [NodeView(n.name, n.node_group, n.zone, schedulable=n.name != "n00", down=n.name == "n00") for n in nodes(3)]
    out = plan(Snapshot(100.0, ns, [job(1, "a", 10, 2, "running", held=["n00", "n01"]), job(2, "b", 10, 1, "running",
                                                                                          held=["n02"])],
                        quota(a={10: 2}, b={10: 1})))
    assert out.suspends == [(1, "node n00 taken down by an admin", False)] and out.starts == []
    assert out.off_down_nodes == {1}  # not for a start: done even while starts meet an outage
