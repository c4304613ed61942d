"""Job traces for the simulator: a synthetic generator and JSON-lines load/save.

A trace job arrives at ``submit`` (seconds), needs ``nodes`` whole nodes for ``duration``
seconds of work, at ``priority``; ``checkpointable`` jobs lose no work when suspended.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

from luban.cluster.priority import Priority
from luban.errors import bad_value

# (value, weight): most jobs are small and short, a few are wide or long (a heavy tail).
NODE_COUNTS = [(1, 50), (2, 18), (4, 14), (8, 10), (16, 5), (32, 2), (64, 1)]
PRIORITIES = [(Priority.LOW, 20), (Priority.BELOW_NORMAL, 8), (Priority.UNDER_NORMAL, 5), (Priority.NORMAL, 40),
              (Priority.ABOVE_NORMAL, 12), (Priority.HIGH, 10), (Priority.VERY_HIGH, 4), (Priority.EXTREME_HIGH, 1)]


@dataclasses.dataclass(slots=True)
class TraceJob:
    id: int
    submit: float
    user: str
    nodes: int
    duration: float
    priority: int
    checkpointable: bool = True
    node_group: str = "default"


@dataclasses.dataclass
class TraceConfig:
    jobs: int = 10_000
    days: float = 30.0
    nodes: int = 1000
    users: int = 50
    load: float = 0.9          # offered node-seconds / (nodes * days)
    checkpointable: float = 0.9
    seed: int = 0


def _pick(rng: random.Random, table):
    values, weights = zip(*table)
    return rng.choices(values, weights)[0]


def synthetic(cfg: TraceConfig) -> list[TraceJob]:
    """Poisson arrivals with a daily cycle, heavy-tailed sizes and durations, Zipf-like users;
    durations are scaled so the offered load is ``cfg.load`` of the cluster over ``cfg.days``."""
    for key in ("jobs", "nodes", "users"):
        if getattr(cfg, key) < 1:
            raise bad_value(key, getattr(cfg, key), "an integer >= 1")
    if cfg.days <= 0 or not 0 < cfg.load <= 10:
        raise bad_value("days/load", (cfg.days, cfg.load), "days > 0 and 0 < load <= 10")
    rng = random.Random(cfg.seed)
    horizon = cfg.days * 86400.0
    users = [f"user{i:03d}" for i in range(cfg.users)]
    user_weights = [1.0 / (i + 1) for i in range(cfg.users)]
    raw = []
    for i in range(cfg.jobs):
        while True:  # thinning: busier in the (virtual) day than at night
            t = rng.uniform(0, horizon)
            if rng.random() < 0.6 + 0.4 * math.sin(2 * math.pi * t / 86400.0) ** 2:
                break
        nodes = min(_pick(rng, NODE_COUNTS), cfg.nodes)
        raw.append((t, rng.choices(users, user_weights)[0], nodes, rng.lognormvariate(math.log(3600), 1.3),
                    int(_pick(rng, PRIORITIES)), rng.random() < cfg.checkpointable))
    scale = cfg.load * cfg.nodes * horizon / sum(r[2] * r[3] for r in raw)
    raw.sort()
    return [TraceJob(i, t, u, n, max(60.0, min(d * scale, 7 * 86400.0)), p, c)
            for i, (t, u, n, d, p, c) in enumerate(raw)]


def save(jobs: list[TraceJob], path: str | Path) -> None:
    with open(path, "w") as f:
        for job in jobs:
            f.write(json.dumps(dataclasses.asdict(job)) + "\n")


def load(path: str | Path) -> list[TraceJob]:
    jobs = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    jobs.append(TraceJob(**json.loads(line)))
                except (TypeError, ValueError) as err:
                    raise bad_value(f"{path}:{line_no}", line.strip()[:80], f"a trace job ({err})") from None
    return sorted(jobs, key=lambda j: (j.submit, j.id))
