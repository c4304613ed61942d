"""Benchmark the cluster policy and simulator at production size.

1. One scheduling tick: ``policy.plan`` on a snapshot of 1,000 nodes and 10,000 jobs (a full
   cluster of running jobs plus a deep queue), timed over repeats. Target: <= 50 ms.
2. The simulator: 10,000 synthetic jobs, 1,000 nodes, 30 days, through the same policy.
   Target: <= 60 s wall.

Run: .venv/bin/python bench/cluster_sim.py [--repeats 20] [--load 0.9 1.1]
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--load", type=float, nargs="+", default=[0.9, 1.1])
    args = parser.parse_args()
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, load average {os.getloadavg()[0]:.1f} (a shared machine)")
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
