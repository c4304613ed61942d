"""Replay a job trace through ``policy.plan`` in virtual time and measure the outcome.

The simulated cluster behaves like the service: a tick runs the same policy on a snapshot,
started jobs run for their remaining work, a suspended job keeps its nodes for
``checkpoint_s`` while it saves (a job that cannot checkpoint loses the work of its current
run) and is requeued. Ticks happen on a ``tick`` grid, only when something changed.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections import defaultdict

from luban.cluster import policy, states
from luban.cluster.priority import Priority
from luban.cluster.trace import NODE_GROUP, TraceJob
from luban.errors import bad_value

# Bounds on one run's work, so that no flag combination or trace runs for hours (or forever):
# tick intervals from 0 to the trace's span (its latest submit + duration): 3650 days at the
# default 60 s tick is 5.3 M; a 1 us tick over a day (8.6e10) would be refused
MAX_GRID_TICKS = 10_000_000
# What the policy and the simulator look at over the whole run, summed over ticks (``tick_visits``):
# a tick's own work counts TICK_VISITS, each node 1, each job log2 of the jobs in the snapshot. So
# counted, one visit costs 0.1-0.3 us of CPU whatever the run's shape, and the bound is about 1.5
# minutes at most (a few on a loaded machine); the default run (10,000 jobs, 1000 nodes, 30 days)
# counts 5.8e7, ~8 s of CPU. Measured 2026-11-28, bench/results/cluster.md. (Until then a visit was
# a node or a job, "~0.4-0.9 us": a tick over 1 node and 2 jobs costs 16-20 us, 5-7 us a visit, and a
# queue of 1M jobs 3-7 us a visit, so the bound allowed 17-35 minutes.) It also ends a run that would
# not end: time-sharing can keep displacing long non-checkpointable jobs, which lose their work each time
MAX_PLAN_VISITS = 300_000_000
TICK_VISITS = 64  # a tick's fixed work, 16-20 us of CPU (the snapshot, plan's set-up, the simulator's events)
ADVICE = "fewer --jobs or --nodes, or a larger --tick or --quantum"


def tick_visits(nodes: int, jobs: int) -> int:
    """One tick's visits: ``TICK_VISITS``, a node 1, a job log2 of the snapshot's jobs (``bit_length``):
    ordering the queue is n log n, and a deep queue's job costs ~20 node visits (1M jobs: 3-7 us)."""
    return TICK_VISITS + nodes + jobs * max(1, jobs.bit_length())


@dataclasses.dataclass
class SimConfig:
    nodes: int = 1000
    zones: int = 10
    quantum: float = 4 * 3600.0
    tick: float = 60.0
    checkpoint_s: float = 120.0
    quota: int | None = None  # nodes per user and level; None: the whole cluster

    @property
    def user_quota(self) -> int:
        return self.quota if self.quota is not None else self.nodes


@dataclasses.dataclass(slots=True)
class SimJob:
    trace: TraceJob
    view: policy.JobView
    remaining: float
    run_start: float = 0.0
    first_start: float | None = None
    queued_time: float = 0.0
    done_at: float | None = None
    wakeup: float = 0.0  # completion or end of suspend, whichever applies to its state
    time_share: bool = False


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def run(trace: list[TraceJob], cfg: SimConfig) -> dict:
    """Simulate until every job has finished; returns the report as a dict. A job that could
    never run, or a run past the work bounds above, is a ``LubanError`` (one line) instead."""
    wall0 = time.perf_counter()
    _check_runnable(trace, cfg)
    _check_work(trace, cfg)
    nodes = [policy.NodeView(f"n{i:05d}", NODE_GROUP, f"z{i * cfg.zones // cfg.nodes:03d}") for i in range(cfg.nodes)]
    users = {j.user for j in trace}
    quota = {(f"user:{u}", NODE_GROUP, int(p)): cfg.user_quota for u in users for p in Priority}
    jobs = {j.id: SimJob(j, policy.JobView(j.id, j.user, f"user:{j.user}", j.priority, j.node_group,
                                           j.nodes, policy.QUEUED, j.submit, j.submit), j.duration)
            for j in trace}
    active: dict[int, SimJob] = {}
    events: list[tuple[float, int]] = [(j.submit, -1) for j in trace]  # (time, job id or -1 for "look")
    heapq.heapify(events)
    arrivals = iter(sorted(trace, key=lambda j: (j.submit, j.id)))
    upcoming = next(arrivals, None)
    stats = defaultdict(float)
    plan_times: list[float] = []
    busy_since, busy = 0.0, 0
    t = 0.0
    visits = 0
    looks: set[tuple[int, float]] = set()  # (job, since) whose quantum's end is already an event

    horizon = max(j.submit for j in trace)

    def account(now: float) -> None:
        nonlocal busy_since
        stats["held_node_s"] += busy * (now - busy_since)
        stats["held_node_s_arrivals"] += busy * max(0.0, min(now, horizon) - busy_since)
        busy_since = now

    while events:
        when, who, *since = heapq.heappop(events)
        if who <= LOOK and _stale_look(active.get(LOOK - who), since[0]):
            continue  # the job finished, moved or was suspended since: no tick for it
        t = max(t, math.ceil(when / cfg.tick) * cfg.tick)
        while events and events[0][0] <= t:
            heapq.heappop(events)
        account(t)
        while upcoming is not None and upcoming.submit <= t:
            active[upcoming.id] = jobs[upcoming.id]
            upcoming = next(arrivals, None)
        for sim in list(active.values()):
            view = sim.view
            if view.state == policy.RUNNING and sim.wakeup <= t:
                states.move(view, states.SUCCEEDED)
                sim.done_at, sim.remaining = sim.wakeup, 0.0
                stats["useful_node_s"] += view.nnodes * (sim.wakeup - sim.run_start)
                busy -= view.nnodes
                del active[view.id]
            elif view.state == policy.SUSPENDING and sim.wakeup <= t:
                busy -= view.nnodes
                states.move(view, states.SUSPENDED)  # the attempt ends; the chain goes on as the next one
                view.state, view.place = states.requeue(view.place, t, sim.time_share)
                view.nodes, view.since = (), t
        snap = policy.Snapshot(t, nodes, [s.view for s in active.values()], quota, cfg.quantum)
        visits += tick_visits(len(nodes), len(snap.jobs))
        if visits > MAX_PLAN_VISITS:
            unfinished = sum(s.done_at is None for s in jobs.values())
            raise _too_much(trace, cfg, f"reached after {len(plan_times):,} ticks, {t / 86400:.1f} simulated days, "
                                        f"with {unfinished} jobs unfinished (long non-checkpointable jobs that "
                                        "time-share may never finish)")
        t0 = time.perf_counter()
        result = policy.plan(snap)
        plan_times.append(time.perf_counter() - t0)
        for job_id, why, time_share in result.suspends:
            sim = active[job_id]
            view = sim.view
            ran = t - sim.run_start
            stats["preemptions"] += 1
            stats["time_share_suspends" if time_share else "priority_suspends"] += 1
            if sim.trace.checkpointable:
                sim.remaining -= ran
                stats["useful_node_s"] += view.nnodes * ran
                sim.wakeup = t + cfg.checkpoint_s
                stats["checkpoint_node_s"] += view.nnodes * cfg.checkpoint_s
            else:
                stats["lost_node_s"] += view.nnodes * ran
                sim.wakeup = t
            states.move(view, states.SUSPENDING)
            sim.time_share = time_share
            heapq.heappush(events, (sim.wakeup, job_id))
        for job_id, names, _ in result.starts:
            sim = active[job_id]
            view = sim.view
            sim.queued_time += t - view.since
            if sim.first_start is None:
                sim.first_start = t
            states.move(view, states.STARTING)  # starting takes no time here
            states.move(view, states.RUNNING)
            view.nodes, view.since = names, t
            sim.run_start, sim.wakeup = t, t + sim.remaining
            busy += view.nnodes
            heapq.heappush(events, (sim.wakeup, job_id))
        for sim in active.values():  # time-sharing needs a look once someone has waited/run a quantum:
            view = sim.view  # one wake-up per (job, since), however far away (no other event may come first)
            if view.state in (policy.QUEUED, policy.RUNNING) and cfg.quantum < 1e12 and (view.id, view.since) not in looks:
                looks.add((view.id, view.since))
                heapq.heappush(events, (view.since + cfg.quantum, LOOK - view.id, view.since))
        if upcoming is not None and not events:
            heapq.heappush(events, (upcoming.submit, -1))
    return report(trace, jobs, cfg, stats, plan_times, t, time.perf_counter() - wall0)


LOOK = -2  # events (time, LOOK - job id, since): the end of a job's quantum in the state it entered at since


def _stale_look(sim: "SimJob | None", since: float) -> bool:
    return sim is None or sim.view.since != since or sim.view.state not in (policy.QUEUED, policy.RUNNING)


def _check_runnable(trace: list[TraceJob], cfg: SimConfig) -> None:
    """Refuse a job that could never run: it would wait forever, and the run end with it unfinished
    and every figure meaningless. The simulated cluster is ``cfg.nodes`` nodes of one node group
    (``NODE_GROUP``), each user's quota ``cfg.quota`` nodes (default: all)."""
    if not trace:
        raise bad_value("trace", "0 jobs", "a trace with at least one job")
    room = min(cfg.nodes, cfg.user_quota)
    fits = f"an integer from 1 to {room}: the simulated cluster's --nodes" + (
        " and quota" if cfg.user_quota < cfg.nodes else "")
    for job in trace:
        where = f"--trace line {job.line}" if job.line is not None else f"trace job {job.id}"
        if job.node_group != NODE_GROUP:
            raise bad_value(f"{where}: node_group", job.node_group,
                            f"{NODE_GROUP!r}, the simulated cluster's only node group")
        if job.nodes > room:
            raise bad_value(f"{where}: nodes", job.nodes, fits)


def _check_work(trace: list[TraceJob], cfg: SimConfig) -> None:
    """Refuse a run the bounds above would stop, before it starts where that can be told: too fine
    a tick for the trace's span, or more policy visits than allowed counting only the ticks that
    must happen (each arrival's and each unhindered completion's, on the tick grid) times nodes."""
    span = max(j.submit + j.duration for j in trace)
    if not span <= MAX_GRID_TICKS * cfg.tick:  # not "span / tick": a zero or nan tick is refused too
        raise bad_value("--tick", cfg.tick, f"at least {span / MAX_GRID_TICKS:.3g} s for this trace: its jobs span "
                                            f"{span:.0f} s, and a run is at most {MAX_GRID_TICKS:,} ticks long")
    slots = {math.ceil(at / cfg.tick) for j in trace for at in (j.submit, j.submit + j.duration)}
    if len(slots) * cfg.nodes > MAX_PLAN_VISITS:
        raise _too_much(trace, cfg, f"this run needs at least {len(slots):,} ticks x {cfg.nodes} nodes")


def _too_much(trace: list[TraceJob], cfg: SimConfig, why: str):
    return _visits_error(len(trace), cfg.nodes, why)


def _visits_error(jobs: int, nodes: int, why: str):
    return bad_value("simulation", f"{jobs} jobs on {nodes} nodes",
                     f"at most {MAX_PLAN_VISITS:,} node and job visits of the policy in all (a job counts log2 "
                     f"of the queue, a tick {TICK_VISITS}); {why}: use {ADVICE}")


def check_synthetic(jobs: int, days: float, nodes: int, tick: float) -> None:
    """Before a synthetic trace is made (seconds for a million jobs): refuse a run ``_check_work``
    would refuse anyway. Its arrivals alone need about min(jobs, days / tick) ticks; half of that
    is a floor no trace of this size falls under (arrivals sharing a tick)."""
    floor = min(jobs, days * 86400.0 / tick) / 2
    if floor * nodes > MAX_PLAN_VISITS:
        raise _visits_error(jobs, nodes, f"its arrivals alone need about {floor:,.0f} ticks x {nodes} nodes")


def _share(part: float, whole: float) -> float | None:
    """``part / whole``; None when ``whole`` is 0 (every job submitted at time 0: no arrival period)."""
    return part / whole if whole else None


def report(trace, jobs, cfg, stats, plan_times, end, wall) -> dict:
    horizon = max(j.submit for j in trace)
    waits = defaultdict(list)
    for sim in jobs.values():
        waits[sim.trace.priority].append(sim.queued_time)
    hours = 3600.0
    return {
        "nodes": cfg.nodes, "jobs": len(trace), "finished": sum(s.done_at is not None for s in jobs.values()),
        "simulated_days": end / 86400.0, "makespan_s": end,
        "occupancy": _share(stats["held_node_s"], cfg.nodes * end),
        "occupancy_while_arriving": _share(stats["held_node_s_arrivals"], cfg.nodes * horizon),
        "useful_utilisation": _share(stats["useful_node_s"], cfg.nodes * end),
        "preemptions": int(stats["preemptions"]), "priority_suspends": int(stats["priority_suspends"]),
        "time_share_suspends": int(stats["time_share_suspends"]),
        "work_lost_node_hours": stats["lost_node_s"] / hours,
        "checkpoint_node_hours": stats["checkpoint_node_s"] / hours,
        "offered_node_hours": sum(j.nodes * j.duration for j in trace) / hours,
        "wait_s": {Priority(p).name: {"jobs": len(w), "p50": percentile(w, 50), "p90": percentile(w, 90),
                                      "p99": percentile(w, 99)}
                   for p, w in sorted(waits.items(), reverse=True)},
        "ticks": len(plan_times), "tick_ms_mean": 1e3 * sum(plan_times) / max(1, len(plan_times)),
        "tick_ms_max": 1e3 * max(plan_times, default=0.0), "wall_s": wall, "arrivals_end_s": horizon,
    }


def _percent(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.1%}"


def format_report(r: dict) -> str:
    lines = [f"{r['jobs']} jobs on {r['nodes']} nodes: {r['finished']} finished in {r['simulated_days']:.1f} "
             f"simulated days ({r['wall_s']:.1f} s wall, {r['ticks']} ticks, policy {r['tick_ms_mean']:.2f} ms "
             f"mean / {r['tick_ms_max']:.1f} ms max)",
             f"occupancy {_percent(r['occupancy'])} overall, {_percent(r['occupancy_while_arriving'])} while jobs "
             f"arrive; useful utilisation {_percent(r['useful_utilisation'])}",
             f"preemptions {r['preemptions']} ({r['priority_suspends']} for priority, "
             f"{r['time_share_suspends']} time-share); work lost {r['work_lost_node_hours']:.0f} node-hours, "
             f"checkpointing {r['checkpoint_node_hours']:.0f} node-hours of {r['offered_node_hours']:.0f} offered",
             "wait (queued time per job, s)  jobs      p50       p90       p99"]
    for name, w in r["wait_s"].items():
        lines.append(f"  {name:<28} {w['jobs']:>5} {w['p50']:>9.0f} {w['p90']:>9.0f} {w['p99']:>9.0f}")
    return "\n".join(lines)
