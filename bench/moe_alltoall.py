"""Issue 12 bench: MoE expert-parallel all-to-all time, measured vs the planner's prediction.

Four gloo CPU ranks (``torch.set_num_threads(1)`` each, as ``luban train --nproc 4`` gives
them on this machine) form one ep = 4 group. For each (tokens per rank, hidden) they run:

* ``luban``: luban's own dispatch, ``EPDispatch`` of ``luban.parallel.expert_parallel``
  (counts all-to-all, rows all-to-all, regroup by local expert, reverse permutation and rows
  all-to-all back), with the expert GEMMs replaced by the identity so only the dispatch and
  the combine are timed; balanced routing (every rank sends tokens·k/E rows to each expert);
* ``raw``: two ``dist.all_to_all_single`` of the same bytes (dispatch + combine, no counts
  exchange, no permutations).

Each repetition starts after a barrier; its time is the slowest rank's; medians.
``predicted``: the planner's own formula for one MoE layer's forward dispatch + combine,
``2 × luban.plan.time.all_to_all(problem, tokens × all_to_all_bytes(...), ep=4, stride=1)``
(as in ``luban.plan.time.step_time``, ``expert_imbalance`` = 1), on this machine's probed
system profile (``luban.plan.probe.cached_profile()``: the cached ``luban plan probe``, measured
now if none is cached), ``runtime="luban"``, 4 "GPUs".

    .venv/bin/python bench/moe_alltoall.py [--reps 7] [--sizes 512x256,2048x256,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

WORLD = 4
EXPERTS, TOP_K = 8, 2
SIZES = "256x256,2048x256,1024x1024,4096x1024,8192x1024"


def _worker(rank: int, port: int, sizes: list, reps: int, out: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from luban.parallel.expert_parallel import EPDispatch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    dispatch = EPDispatch(mesh, EXPERTS)
    results = []
    for tokens, hidden in sizes:
        rows = torch.randn(tokens * TOP_K, hidden)
        counts = torch.full((EXPERTS,), tokens * TOP_K // EXPERTS, dtype=torch.long)
        recv = torch.empty_like(rows)

        def luban():
            dispatch(lambda x, per_expert: x, rows, counts)

        def raw():
            dist.all_to_all_single(recv, rows)
            dist.all_to_all_single(rows, recv)

        timed = {}
        for name, fn in (("luban", luban), ("raw", raw)):
            times = []
            for i in range(reps + 2):  # 2 warm-up repetitions
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            slowest = torch.tensor(times[2:], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            timed[name] = statistics.median(slowest.tolist())
        results.append({"tokens": tokens, "hidden": hidden, "bytes": rows.numel() * rows.element_size(), **timed})
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def predicted(tokens: int, hidden: int, system) -> float:
    """One MoE layer's forward dispatch + combine by the planner (``luban.plan.time.step_time``'s ``ep_one``)."""
    import numpy as np

    from luban.model import get_preset
    from luban.plan import time as plan_time
    from luban.plan.memory import all_to_all_bytes
    from luban.plan.problem import Problem

    model = dataclasses.replace(get_preset("tiny"), hidden=hidden, experts=EXPERTS, experts_per_token=TOP_K)
    problem = Problem(model, system, WORLD, tokens, WORLD, runtime="luban")
    grid = SimpleNamespace(ep=np.array(WORLD))  # all_to_all_bytes reads only the ep degree
    nbytes = tokens * all_to_all_bytes(problem, grid, 4)  # fp32 activations
    one = plan_time.all_to_all(problem, nbytes, np.array(WORLD), np.array(1))
    return float(problem.expert_imbalance * 2 * one)


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sizes", default=SIZES, help="tokens-per-rank x hidden, comma separated")
    args = ap.parse_args()
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]

    from luban.plan.probe import cache_path, cached_profile
    from luban.plan.system import System

    cached = cache_path().is_file()
    system = System.from_dict(cached_profile(), source="probe")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(port, sizes, args.reps, out), nprocs=WORLD, join=True)
        results = json.loads(Path(out).read_text())
    print(f"{WORLD} gloo ranks x 1 thread, ep = {WORLD}, E = {EXPERTS}, k = {TOP_K}, fp32, balanced routing; "
          f"{args.reps} reps (median of the slowest rank); {time.perf_counter() - t0:.0f} s")
    print(f"profile: {cache_path()} ({'cached' if cached else 'probed now'}): inter-rank bandwidth "
          f"{system.internode_bandwidth / 1e9:.2f} GB/s, latency {system.internode_latency * 1e6:.0f} us")
    print("| tokens/rank | hidden | bytes/rank each way | luban dispatch+combine | raw 2x all_to_all_single "
          "| predicted | luban / predicted | raw / predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        p = predicted(r["tokens"], r["hidden"], system)
        print(f"| {r['tokens']} | {r['hidden']} | {r['bytes'] / 2**20:.2f} MiB | {r['luban'] * 1e3:.2f} ms "
              f"| {r['raw'] * 1e3:.2f} ms | {p * 1e3:.2f} ms | {r['luban'] / p:.2f} | {r['raw'] / p:.2f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
