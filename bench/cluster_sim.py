"""Benchmark the cluster policy and simulator at production size.

1. One scheduling tick: ``policy.plan`` on a snapshot of 1,000 nodes and 10,000 jobs (a full
   cluster of running jobs plus a deep queue), timed over repeats. Target: <= 50 ms.
2. The simulator: 10,000 synthetic jobs, 1,000 nodes, 30 days, through the same policy.
   Target: <= 60 s wall.

3. ``--visit-cost SHAPE...``: what one visit of the simulator's work bound (``simulate.tick_visits``,
   ``MAX_PLAN_VISITS``) costs in CPU, over runs of very different shapes, each run to its end or to
   the bound: the bound means "about 1.5 minutes at most" only if no shape costs much more a visit.

Run: .venv/bin/python bench/cluster_sim.py [--repeats 20] [--load 0.9 1.1]
     .venv/bin/python bench/cluster_sim.py --visit-cost default tiny deep1M ...
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time

from luban.cluster import policy, simulate, trace
from luban.cluster.priority import Priority


def tick_snapshot(nodes: int = 1000, jobs: int = 10_000, users: int = 50, seed: int = 0) -> policy.Snapshot:
    rng = random.Random(seed)
    views = [policy.NodeView(f"n{i:05d}", "default", f"z{i // 100:03d}") for i in range(nodes)]
    free = [v.name for v in views]
    rng.shuffle(free)
    levels = [int(p) for p in Priority]
    out = []
    for i in range(jobs):
        n = rng.choice([1, 1, 1, 2, 2, 4, 8, 16])
        user = f"user{rng.randrange(users):03d}"
        state = policy.RUNNING if len(free) >= n and rng.random() < 0.5 else policy.QUEUED
        held = tuple(free.pop() for _ in range(n)) if state == policy.RUNNING else ()
        out.append(policy.JobView(i, user, f"user:{user}", rng.choice(levels), "default", n, state,
                                  rng.uniform(0, 1e6), rng.uniform(0, 1e6), held))
    quota = {(f"user:user{u:03d}", "default", p): nodes // 10 for u in range(users) for p in levels}
    return policy.Snapshot(1e6 + 3600, views, out, quota, 4 * 3600.0)


def _synthetic(jobs: int = 10_000, nodes: int = 1000, users: int = 50, load: float = 0.9, days: float = 30.0):
    jobs_ = trace.synthetic(trace.TraceConfig(jobs=jobs, days=days, nodes=nodes, users=users, load=load))
    return jobs_, simulate.SimConfig(nodes=nodes, zones=min(10, nodes))


# runs of very different shapes for --visit-cost: (trace, config) makers
SHAPES = {
    "default": lambda: _synthetic(),  # `luban cluster simulate` with its defaults
    "load1.1": lambda: _synthetic(load=1.1),
    # two long jobs that cannot checkpoint time-share one node for ever: tiny ticks, run to the bound
    "tiny": lambda: ([trace.TraceJob(i, float(i), f"u{i}", 1, 5e8, 0, checkpointable=False) for i in range(2)],
                     simulate.SimConfig(nodes=1, zones=1, quantum=60.0, tick=60.0)),
    "deep1M": lambda: _synthetic(jobs=1_000_000, load=10.0),  # a queue of up to a million jobs
    "deep1M_100k_users": lambda: _synthetic(jobs=1_000_000, users=100_000, load=10.0),
    "deep100k_10_nodes": lambda: _synthetic(jobs=100_000, nodes=10, load=10.0),
    "nodes100k": lambda: _synthetic(jobs=1000, nodes=100_000, days=0.2, load=0.5),  # the largest cluster
}


def visit_cost(name: str) -> None:
    """One shape's run, to its end or to the bound: its visits and CPU per visit."""
    from luban.errors import LubanError

    jobs, cfg = SHAPES[name]()
    counted = {"visits": 0, "ticks": 0}
    plan = policy.plan

    def counting(snap):
        counted["visits"] += simulate.tick_visits(len(snap.nodes), len(snap.jobs))
        counted["ticks"] += 1
        return plan(snap)

    simulate.policy.plan = counting
    c0, w0 = time.process_time(), time.perf_counter()
    try:
        simulate.run(jobs, cfg)
        end = "finished"
    except LubanError as err:
        if not counted["ticks"]:  # refused before its first tick (simulate._check_work): nothing measured
            print(f"{name}: {err}", flush=True)
            return
        end = "reached the bound"
    finally:
        simulate.policy.plan = plan
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    print(f"{name}: {end} after {counted['ticks']:,} ticks, {counted['visits']:.3g} visits; CPU {cpu:.1f} s "
          f"(wall {wall:.1f} s), {1e6 * cpu / max(1, counted['visits']):.3f} us/visit", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--load", type=float, nargs="+", default=[0.9, 1.1])
    parser.add_argument("--visit-cost", nargs="+", choices=sorted(SHAPES), metavar="SHAPE",
                        help=f"instead: CPU per visit of the work bound, for runs of these shapes ({', '.join(SHAPES)})")
    args = parser.parse_args()
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, load average {os.getloadavg()[0]:.1f} (a shared machine)")
    if args.visit_cost:
        for name in args.visit_cost:
            visit_cost(name)
        return
    snap = tick_snapshot()
    running = sum(j.state == policy.RUNNING for j in snap.jobs)
    times, cpu = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        result = policy.plan(snap)
        times.append(1e3 * (time.perf_counter() - t0))
        cpu.append(1e3 * (time.process_time() - c0))
    print(f"tick: 1000 nodes, 10000 jobs ({running} running): wall median {statistics.median(times):.1f} ms, "
          f"min {min(times):.1f}, max {max(times):.1f}; CPU median {statistics.median(cpu):.1f} ms; "
          f"{args.repeats} repeats; {len(result.starts)} starts, {len(result.suspends)} suspends, "
          f"{len(result.waits)} waits")
    for load in args.load:
        jobs = trace.synthetic(trace.TraceConfig(jobs=10_000, days=30, nodes=1000, load=load))
        c0 = time.process_time()
        r = simulate.run(jobs, simulate.SimConfig(nodes=1000))
        print(f"\n-- simulate: load {load} (CPU {time.process_time() - c0:.1f} s)\n" + simulate.format_report(r))


if __name__ == "__main__":
    main()
