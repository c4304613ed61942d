"""Search throughput of ``luban plan search``: layouts estimated per second, in one run each.

    .venv/bin/python bench/plan_search.py

Prints a Markdown table for bench/results/plan.md: layouts per wall-clock second, and per CPU
second of the process (the machine is shared: the load average is printed too). The search is
single-threaded numpy, so layouts per CPU second is the rate per core. Calculon's published
figure for comparison: ~32 configurations/s/core.
"""

import os

from luban.model.presets import get_preset
from luban.plan.problem import Problem
from luban.plan.search import search
from luban.plan.system import load_system

CASES = [("gpt3-175b", 64, 64, 2048), ("llama-70b", 1024, 1024, 8192), ("megatron-1t", 3072, 3072, 2048)]


def main() -> None:
    print("load average before: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()) + "\n")
    print("| model | GPUs | layouts | valid+fit | wall s | layouts/s (wall) | CPU s | layouts/CPU-s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, gpus, batch, seq in CASES:
        problem = Problem(get_preset(name), load_system("dgx-a100-80g"), gpus, seq, batch)
        r = search(problem, top=5)
        print(f"| {name} | {gpus} | {r.evaluated:,} | {r.valid:,} | {r.seconds:.2f} | {r.rate:,.0f} | "
              f"{r.cpu_seconds:.2f} | {r.cpu_rate:,.0f} |")
    print("\nload average after: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
