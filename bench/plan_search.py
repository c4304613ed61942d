"""Search throughput of ``luban plan search``: layouts estimated per second, in one run each.

    .venv/bin/python bench/plan_search.py

Prints Markdown tables for bench/results/plan.md: layouts per wall-clock second, and per CPU
second of the process (the machine is shared: the load average is printed too). The search is
single-threaded numpy, so layouts per CPU second is the rate per core. Calculon's published
figure for comparison: ~32 configurations/s/core.

Every search runs over all axes the planner has: the grid axes (dp/tp/pp/cp, schedule and
virtual stages, zero, sp, micro-batch, recompute, offload kind), once per precision the
system has a peak for (fp8 included where the planner and profile have it) and per runtime
model (``luban.plan.problem.RUNTIMES``). The second table is seed 003's largest search: every
layout of its 1T model on 16,384 GPUs (seq 8192, ffn 4h, heads = blocks, batch 3072), with an
offload tier, on every runtime model.
"""

import os
import time

from luban.model.presets import get_preset
from luban.parallel.layout import PRECISIONS
from luban.plan.problem import RUNTIMES, Problem
from luban.plan.search import search
from luban.plan.study import BATCH, SEQ, seed_model, system_for
from luban.plan.system import load_system

CASES = [("gpt3-175b", 64, 64, 2048), ("llama-70b", 1024, 1024, 8192), ("megatron-1t", 3072, 3072, 2048)]
SYSTEM = "dgx-h100"


def precisions(system) -> list[str]:
    return [p for p in PRECISIONS if p in system.peak_flops]


def row(label: str, problem: Problem, precision: str) -> tuple:
    r = search(problem, top=5, precision=precision)
    print(f"| {label} | {problem.runtime} | {precision} | {r.evaluated:,} | {r.valid:,} | {r.seconds:.2f} | "
          f"{r.rate:,.0f} | {r.cpu_seconds:.2f} | {r.cpu_rate:,.0f} |", flush=True)
    return r.evaluated, r.seconds, r.cpu_seconds


def main() -> None:
    print("load average before: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()) + "\n")
    header = ("| case | runtime | precision | layouts | valid+fit | wall s | layouts/s (wall) | CPU s | layouts/CPU-s |\n"
              "|---|---|---|---|---|---|---|---|---|")
    print(header)
    system = load_system(SYSTEM)
    total = [0, 0.0, 0.0]
    for name, gpus, batch, seq in CASES:
        for runtime in RUNTIMES:
            for precision in precisions(system):
                n, s, c = row(f"{name} on {gpus}", Problem(get_preset(name), system, gpus, seq, batch, runtime), precision)
                total = [total[0] + n, total[1] + s, total[2] + c]
    print(f"| **all** | | | {total[0]:,} | | {total[1]:.2f} | {total[0] / total[1]:,.0f} | {total[2]:.2f} | "
          f"{total[0] / total[2]:,.0f} |")

    print("\nseed 003, largest search (1T model, 16,384 GPUs, offload tier 512 GiB @ 100 GB/s):\n")
    print(header)
    cfg = seed_model(1)
    tier = system_for(80, (512, 100))
    start = time.perf_counter()
    for runtime in RUNTIMES:
        for precision in precisions(tier):
            row(f"{cfg.name} ({cfg.layers} blocks, h {cfg.hidden}) on 16384", Problem(cfg, tier, 16384, SEQ, BATCH, runtime),
                precision)
    print(f"\nall of them: {time.perf_counter() - start:.2f} s wall")
    print("\nload average after: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
