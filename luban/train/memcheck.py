"""Does the run fit this machine? Checked from the config, before anything is allocated.

The bytes per rank are the planner's (``luban.plan.memory`` with ``runtime="luban"``: luban's
own accounting of weights, gradients, optimizer state, saved activations and buffers for the
layout), the same formula ``luban plan estimate`` and ``--parallel auto`` use; no model is built.
On a GPU each rank needs them in its device's memory; on a CPU every rank of this node needs
them in host memory at once (Linux's ``MemAvailable``). Offloaded state (``parallel.offload``)
counts against host memory. A run that cannot fit is refused with one line naming the bytes
needed and available, instead of being killed by the kernel minutes later.
"""

from __future__ import annotations

import os
from pathlib import Path

from luban.errors import LubanError

GIB = 2**30


def mem_available() -> int | None:
    """Linux's MemAvailable in bytes (None where /proc/meminfo is absent)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def planner_optimizer(train) -> str:
    """The planner's name for the run's optimizer state (``luban.plan.problem.OPTIMIZERS``)."""
    if train.optimizer == "adamw":
        return "adamw"
    return "sgd-momentum" if train.momentum else "sgd"


def rank_bytes(cfg, world: int) -> tuple[float, float]:
    """(device bytes, host bytes) of the fullest rank, from the config alone (no allocation)."""
    from luban.plan.grid import Grid
    from luban.plan.memory import at_rank, memory
    from luban.plan.problem import Problem
    from luban.plan.system import System, load_system

    # a neutral profile: only framework_overhead_bytes enters the memory formula, and it is left out
    # here (it is a GPU figure); capacities are compared below, not by the planner
    base = load_system("dgx-a100-80g").to_dict()
    system = System.from_dict({**base, "name": "this machine", "gpus_per_node": world, "nvlink_domain": world,
                               "framework_overhead_bytes": 1.0}, source="memory check")
    problem = Problem(cfg.model, system, world, cfg.seq_len, cfg.train.global_batch, runtime="luban",
                      optimizer=planner_optimizer(cfg.train))
    g = Grid.from_layout(cfg.parallel)
    mem = memory(problem, g)
    shape = getattr(g, "shape", ())
    return at_rank(mem, "total", shape, ()), at_rank(mem, "host", shape, ())


def check_fits(cfg, world: int, local_ranks: int, device_type: str) -> None:
    """Raise ``LubanError`` (one line) when the run cannot fit this machine's memory.

    ``local_ranks``: ranks of this run on this node (they share its host memory)."""
    if os.environ.get("LUBAN_SKIP_MEMORY_CHECK"):
        return
    device, host = rank_bytes(cfg, world)
    what = (f"{cfg.model.name} ({cfg.model.layers} layers, hidden {cfg.model.hidden}) with "
            f"{cfg.parallel.precision} {cfg.train.optimizer}, global_batch {cfg.train.global_batch}, "
            f"seq_len {cfg.seq_len} on {world} rank(s)")
    advice = ("use a smaller model, more ranks with zero/tp/pp, a smaller micro_batch or recompute "
              "(`luban plan estimate` shows where the bytes go)")
    if device_type == "cuda":
        import torch

        index = int(os.environ.get("LOCAL_RANK", 0)) if torch.cuda.device_count() else 0
        capacity = torch.cuda.get_device_properties(index).total_memory
        if device > capacity:
            raise LubanError(f"memory: {what} needs {device / GIB:.1f} GiB per GPU (the planner's estimate: "
                             f"weights, gradients, optimizer state, activations) but a GPU here has "
                             f"{capacity / GIB:.1f} GiB; {advice}")
        need, kind = host * local_ranks, "host memory for offloaded state"
    else:
        need, kind = (device + host) * local_ranks, "host memory"
    available = mem_available()
    if available is not None and need > available:
        per = f"{(need / local_ranks) / GIB:.1f} GiB per rank x {local_ranks} rank(s) on this node = " \
            if local_ranks > 1 else ""
        raise LubanError(f"memory: {what} needs {per}{need / GIB:.1f} GiB of {kind} (the planner's estimate: "
                         f"weights, gradients, optimizer state, activations) but {available / GIB:.1f} GiB is "
                         f"available; {advice}")
