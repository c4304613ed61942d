"""Job traces for the simulator: a synthetic generator and JSON-lines load/save.

A trace job arrives at ``submit`` (seconds), needs ``nodes`` whole nodes for ``duration``
seconds of work, at ``priority``; ``checkpointable`` jobs lose no work when suspended.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from pathlib import Path

from luban import schema
from luban.cluster.priority import Priority
from luban.errors import bad_value, shown

TRACE_SHOWN = 60  # a trace line's bad value or key is shown up to this many characters: one short line

# (value, weight): most jobs are small and short, a few are wide or long (a heavy tail).
NODE_COUNTS = [(1, 50), (2, 18), (4, 14), (8, 10), (16, 5), (32, 2), (64, 1)]
PRIORITIES = [(Priority.LOW, 20), (Priority.BELOW_NORMAL, 8), (Priority.UNDER_NORMAL, 5), (Priority.NORMAL, 40),
              (Priority.ABOVE_NORMAL, 12), (Priority.HIGH, 10), (Priority.VERY_HIGH, 4), (Priority.EXTREME_HIGH, 1)]
NODE_GROUP = "default"  # a trace job's node group unless it names one; the simulated cluster's only group
# a trace's submit and duration (seconds): 100 years, far past any real trace, keeps every sum and
# tick count of the simulator finite and exact (1e308 overflowed; 1e300 printed 150-digit figures)
MAX_TRACE_YEARS = 100
MAX_TRACE_S = MAX_TRACE_YEARS * 365 * 86400.0
TRACE_SPAN = f"{MAX_TRACE_S:.0f} s ({MAX_TRACE_YEARS} years)"


@dataclasses.dataclass(slots=True)
class TraceJob:
    id: int
    submit: float
    user: str
    nodes: int
    duration: float
    priority: int
    checkpointable: bool = True
    node_group: str = NODE_GROUP
    line: int | None = dataclasses.field(default=None, compare=False)  # load()'s line: errors name it; not saved


FIELDS = tuple(f.name for f in dataclasses.fields(TraceJob) if f.name != "line")  # a trace line's keys
REQUIRED = tuple(f.name for f in dataclasses.fields(TraceJob) if f.default is dataclasses.MISSING)


LIMITS = {  # TraceConfig's fields, declared once: `luban cluster trace|simulate` take them as flags
    "jobs": schema.integer(1, 1_000_000),
    "days": schema.number(0, 3650, open_lo=True),
    "nodes": schema.integer(*schema.CLUSTER_NODES),
    "users": schema.integer(1, 100_000),
    "load": schema.number(0, 10, open_lo=True),  # offered node-seconds / (nodes * days)
    "checkpointable": schema.number(0, 1),
    "seed": schema.integer(*schema.SEED),
}


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
    for key, parse in LIMITS.items():  # nan days would be an endless loop, 10**11 jobs a very long one
        schema.check(key, getattr(cfg, key), parse)
    rng = random.Random(cfg.seed)
    horizon = cfg.days * 86400.0
    users = [f"user{i:03d}" for i in range(cfg.users)]
    # cumulative, once: choices(users, weights) summed all of them at every job (1M jobs of 100,000 users
    # took hours before the simulation began); the same picks, as choices accumulates weights so itself
    user_cum = list(itertools.accumulate(1.0 / (i + 1) for i in range(cfg.users)))
    raw = []
    for i in range(cfg.jobs):
        while True:  # thinning: busier in the (virtual) day than at night
            t = rng.uniform(0, horizon)
            if rng.random() < 0.6 + 0.4 * math.sin(2 * math.pi * t / 86400.0) ** 2:
                break
        nodes = min(_pick(rng, NODE_COUNTS), cfg.nodes)
        raw.append((t, rng.choices(users, cum_weights=user_cum)[0], nodes, rng.lognormvariate(math.log(3600), 1.3),
                    int(_pick(rng, PRIORITIES)), rng.random() < cfg.checkpointable))
    scale = cfg.load * cfg.nodes * horizon / sum(r[2] * r[3] for r in raw)
    raw.sort()
    return [TraceJob(i, t, u, n, max(60.0, min(d * scale, 7 * 86400.0)), p, c)
            for i, (t, u, n, d, p, c) in enumerate(raw)]


def save(jobs: list[TraceJob], path: str | Path) -> None:
    from luban.data.atomic import create_bytes

    text = "".join(json.dumps({name: getattr(job, name) for name in FIELDS}) + "\n" for job in jobs)
    try:  # whole or not at all (an interrupted trace leaves no half file), never over an existing file
        create_bytes(path, text.encode())
    except FileExistsError:
        raise bad_value("--output", str(path), "a new file's path (luban never overwrites a file)") from None
    except OSError as err:
        raise bad_value("--output", str(path), f"cannot be written ({err.strerror or err})") from None


def _trace_job(raw, line: int | None = None) -> TraceJob:
    """One line's job, every field type- and range-checked (a ValueError says which)."""
    if not isinstance(raw, dict):
        raise ValueError(f"a JSON object, not {type(raw).__name__}")
    for key in raw:
        if key not in FIELDS:
            raise ValueError(f"unknown key {shown(key, TRACE_SHOWN)}; allowed: {', '.join(FIELDS)}")
    missing = [name for name in REQUIRED if name not in raw]
    if missing:
        raise ValueError(f"missing key{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    job = TraceJob(**raw, line=line)
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    real = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    checks = [("id", whole(job.id) and job.id >= 0, "an integer >= 0"),
              ("submit", real(job.submit) and 0 <= job.submit <= MAX_TRACE_S,
               f"a finite number from 0 to {TRACE_SPAN}"),
              ("user", isinstance(job.user, str) and job.user != "", "a non-empty string"),
              ("nodes", whole(job.nodes) and schema.CLUSTER_NODES[0] <= job.nodes <= schema.CLUSTER_NODES[1],
               f"an integer from {schema.CLUSTER_NODES[0]} to {schema.CLUSTER_NODES[1]}"),
              ("duration", real(job.duration) and 0 < job.duration <= MAX_TRACE_S,
               f"a finite number > 0, at most {TRACE_SPAN}"),
              ("priority", whole(job.priority) and job.priority in {int(p) for p in Priority},
               f"one of {sorted(int(p) for p in Priority)}"),
              ("checkpointable", isinstance(job.checkpointable, bool), "true or false"),
              ("node_group", isinstance(job.node_group, str) and job.node_group != "", "a non-empty string")]
    for name, ok, allowed in checks:
        if not ok:
            raise ValueError(f"{name} = {shown(getattr(job, name), TRACE_SHOWN)}: {allowed}")
    return job


def load(path: str | Path) -> list[TraceJob]:
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise bad_value("--trace", str(path), f"a readable JSON-lines trace file ({why})") from None
    jobs = []
    first_line: dict[int, int] = {}  # job id -> the line that has it: the simulator keys jobs by id
    for line_no, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                job = _trace_job(json.loads(line), line_no)
                if first_line.setdefault(job.id, line_no) != line_no:
                    raise ValueError(f"id = {job.id}: unique (line {first_line[job.id]} has it too)")
            except (TypeError, ValueError, RecursionError) as err:
                raise bad_value(f"{path}:{line_no}", line.strip()[:80], f"a trace job ({err})") from None
            jobs.append(job)
    if not jobs:
        raise bad_value("--trace", str(path), "a trace with at least one job (one JSON object per line)")
    return sorted(jobs, key=lambda j: (j.submit, j.id))
