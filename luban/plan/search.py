"""``search``: every layout for a model, system and GPU count, estimated at once with numpy.

The candidates form a broadcast ``Grid``: axis 0 holds the (dp, tp, pp, cp, schedule,
virtual_stages) combinations whose product is the GPU count (pp = 1 only with 1f1b); the
other axes are zero stage, sequence parallel, micro-batch, recompute and offload. Quantities
that depend on few knobs are computed once per combination of those knobs, so the cost per
layout is a handful of array operations. Each layout is then checked with ``rules`` (the
vectorised ``check_layout``) and the memory limits; the rejections are counted per reason.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from luban.errors import LubanError
from luban.parallel import schedules
from luban.parallel.layout import OFFLOADS, PRECISIONS, SCHEDULES, _divisors
from luban.plan.estimate import Estimate, evaluate
from luban.plan.grid import Grid
from luban.plan.problem import Problem
from luban.plan.rules import NO_GPU_MEMORY, NO_HOST_MEMORY, REASONS, first_violation, rule_counts, violations

ALL_OFFLOADS = tuple(range(len(OFFLOADS)))  # indices into OFFLOADS; check_layout drops what a runtime does not run
VIRTUAL_STAGES = (2, 3, 4, 6, 8)  # searched for schedules without an upper bound on stages per rank
# layouts one search may enumerate: up to a minute at the measured 4-14 M layouts/s (bench/results/plan.md;
# DeepSeek-V3 on 2**24 GPUs is 231 M, 17 s); a GPU count of many divisors can make 1e10 and more
MAX_LAYOUTS = 250_000_000


@dataclass
class SearchResult:
    problem: Problem
    evaluated: int
    seconds: float  # wall clock
    cpu_seconds: float  # this process's CPU time (the machine may be shared)
    rejected: dict  # reason -> count
    valid: int
    best: list  # Estimates, fastest first

    @property
    def rate(self) -> float:
        """Layouts per wall-clock second."""
        return self.evaluated / self.seconds if self.seconds > 0 else float("inf")

    @property
    def cpu_rate(self) -> float:
        """Layouts per CPU second of this process."""
        return self.evaluated / self.cpu_seconds if self.cpu_seconds > 0 else float("inf")


def candidate_grid(problem: Problem, precision: str = "bf16", micro_batches=None, schedules=SCHEDULES,
                   recomputes=(0, 1, 2), offloads=ALL_OFFLOADS, zeros=(0, 1, 2, 3), cps=None, pps=None, eps=None) -> Grid:
    """All knob combinations for ``problem.gpus`` GPUs as a broadcast grid (see module doc);
    ``cps``, ``pps`` and ``eps`` restrict the context-, pipeline- and expert-parallel sizes
    (default: every divisor; ep only for a MoE model, dividing dp·cp and the experts)."""
    n = problem.gpus
    divs = _divisors(n)
    if micro_batches is None:
        micro_batches = [b for b in _divisors(problem.global_batch) if b <= 64]
    per_row = len(zeros) * 2 * len(micro_batches) * len(recomputes) * len(offloads)  # the other axes (sp: 2)
    rows = []
    for tp in divs:
        for pp in divs if pps is None else [d for d in divs if d in pps]:
            if n % (tp * pp):  # no cp completes it (skipped here: a count of many divisors made this loop minutes)
                continue
            for cp in divs:
                if n % (tp * pp * cp) or (cps is not None and cp not in cps):
                    continue
                dp = n // (tp * pp * cp)
                for sched, v in _schedules(pp, schedules):
                    for ep in _expert_parallel(problem, dp * cp, eps):
                        rows.append((dp, tp, pp, cp, sched, v, ep))
                _check_size(problem, len(rows) * per_row, len(divs))
    if not rows:  # only a restriction can empty it (tp = pp = cp = 1, ep = 1 always exist otherwise)
        fixed = {"--pp": pps, "--cp": cps, "--ep": eps}
        named = ", ".join(f"{k} = {' '.join(map(str, v))}" for k, v in fixed.items() if v is not None)
        raise LubanError(f"{named}: no layout of {n} GPUs has it (pp and cp must divide the GPUs; ep must divide "
                         f"dp*cp and the model's {problem.model.experts} experts)")
    a = np.array(rows, dtype=np.int64).T

    def axis(values, k):
        shape = [1] * 6
        shape[k] = len(values)
        return np.asarray(values).reshape(shape)

    col = [x.reshape(-1, 1, 1, 1, 1, 1) for x in a]
    return Grid(dp=col[0], tp=col[1], pp=col[2], cp=col[3], schedule=col[4], virtual_stages=col[5], ep=col[6],
                zero=axis(zeros, 1), sp=axis([False, True], 2), micro_batch=axis(micro_batches, 3),
                recompute=axis(recomputes, 4), offload=axis(offloads, 5),
                precision=np.array(PRECISIONS.index(precision)))


class TooManyLayouts(LubanError):
    """A search of more than ``MAX_LAYOUTS`` layouts, refused while its grid is built (``--gpus 14414400``, 504
    divisors: 3.4e10 layouts, half an hour, and a MemoryError traceback under a 6 GB limit)."""


def _check_size(problem: Problem, layouts: int, divisors: int) -> None:
    if layouts > MAX_LAYOUTS:
        raise TooManyLayouts(f"--gpus = {problem.gpus}: at most {MAX_LAYOUTS:,} layouts to search; this count's "
                             f"{divisors} divisors (with global batch {problem.global_batch}'s micro-batch sizes) make "
                             f"more: a GPU count with fewer divisors (a power of two) or fewer GPUs")


def _expert_parallel(problem: Problem, dp_cp: int, allowed) -> list:
    """Expert-parallel sizes of one (dp, cp): divisors of dp·cp that divide the experts."""
    if not problem.model.moe:
        return [1]
    return [e for e in _divisors(dp_cp) if problem.model.experts % e == 0 and (allowed is None or e in allowed)]


def _schedules(pp: int, allowed) -> list:
    if pp == 1:
        return [(schedules.get("1f1b").code, 1)]
    return [(s.code, v) for s in schedules.REGISTRY if s.name in allowed
            for v in (range(s.min_virtual, s.max_virtual + 1) if s.max_virtual else VIRTUAL_STAGES)]


def search(problem: Problem, top: int = 5, chunk: int = 1 << 16, score=None, progress=None,
           **grid_options) -> SearchResult:
    """Estimate every candidate layout; keep the ``top`` valid ones that fit, fastest first
    (or highest ``score(grid, results)`` first when given).

    Axis 0 of the grid is processed ``chunk`` layouts at a time to stay within the CPU caches;
    ``progress(done, total)`` (layouts) is called after each chunk. Rows of axis 0 that a layout
    rule rejects whatever the other knobs (``_row_rules``: tp not dividing the heads, too many
    stages) are only counted: their first violation is a layout rule, never a memory check, so the
    estimate (nine times the cost of the rules) is not computed for them, and only the rules up to
    their own are looked at, over the axes those rules read (``rules.rule_counts``)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    g = candidate_grid(problem, **grid_options)
    per_row = int(np.prod(g.shape[1:]))
    step = max(1, chunk // max(1, per_row))
    row_rules = _row_rules(g, problem)
    counts = np.zeros(len(REASONS), dtype=np.int64)
    best: list = []
    done, total = 0, g.shape[0] * per_row
    rejected_rows = np.flatnonzero(row_rules)
    for lo in range(0, len(rejected_rows), step):  # counted: the first violation is at or before the row's own rule
        rows = rejected_rows[lo:lo + step]
        found = rule_counts(_rows(g, rows), problem.model, problem.global_batch, problem.gpus, problem.seq,
                            problem.runtime_model, upto=int(row_rules[rows].max()))
        counts += found
        done += int(found.sum())
        if progress is not None:
            progress(done, total)
    rows = np.flatnonzero(row_rules == 0)
    for lo in range(0, len(rows), step):  # estimated, checked against the rules and the memory limits
        part = _rows(g, rows[lo:lo + step])
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            results = evaluate(problem, part)
            codes = first_violation(part, problem.model, problem.global_batch, problem.gpus, problem.seq,
                                    extra=(~results["memory"]["fits_hbm"], ~results["memory"]["fits_host"]),
                                    rules=problem.runtime_model)
        codes = np.broadcast_to(codes, part.shape).ravel()
        counts += np.bincount(codes, minlength=len(REASONS))
        value = results["tokens_per_s"] if score is None else score(part, results)
        value = np.broadcast_to(value, part.shape).ravel()
        valid = np.flatnonzero(codes == 0)
        keep = valid[np.lexsort((valid, -value[valid]))[:top]]  # ties: the simpler layout (lower knobs) first
        best += [(-value[i], rows[lo], i, part.layout(np.unravel_index(i, part.shape))) for i in keep]
        done += codes.size
        if progress is not None:
            progress(done, total)
    best = [_estimate_one(problem, layout) for *_, layout in sorted(best, key=lambda item: item[:3])[:top]]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    rejected = {REASONS[k]: int(c) for k, c in enumerate(counts) if k and c}
    return SearchResult(problem, int(counts.sum()), seconds, cpu_seconds, rejected, int(counts[0]), best)


def _row_rules(g: Grid, problem: Problem) -> np.ndarray:
    """Per row of axis 0: the first layout rule (index into ``REASONS``; 0: none) that depends on that
    row's knobs alone (dp, tp, pp, cp, schedule, virtual stages, ep; broadcast over the other axes) and
    rejects it."""
    found = np.zeros(g.shape[0], dtype=np.int64)
    conditions = violations(g, problem.model, problem.global_batch, problem.gpus, problem.seq, problem.runtime_model)
    for k, violated in reversed(list(enumerate(conditions, 1))):
        if all(n == 1 for n in np.shape(violated)[1:]):
            row = np.broadcast_to(violated, (g.shape[0],) + (1,) * (len(g.shape) - 1)).reshape(-1)
            found = np.where(row, k, found)
    return found


def _rejected_rows(g: Grid, problem: Problem) -> np.ndarray:
    """Per row of axis 0: whether a layout rule of that row's knobs alone rejects it (``_row_rules``)."""
    return _row_rules(g, problem) > 0


def _estimate_one(problem: Problem, layout) -> Estimate:
    """The estimate of one layout of the grid (the 0-d case of the same formulas)."""
    g = Grid.from_layout(layout)
    return Estimate.from_results(problem, g, evaluate(problem, g))


def _rows(g: Grid, rows: slice) -> Grid:
    """The grid restricted to some entries of axis 0."""
    n = g.shape[0]
    return Grid(**{f.name: (v[rows] if v is not None and np.ndim(v) and np.shape(v)[0] == n else v)
                   for f in dataclasses.fields(g) for v in [getattr(g, f.name)]})


def memory_rejections(result: SearchResult) -> int:
    return result.rejected.get(REASONS[NO_GPU_MEMORY], 0) + result.rejected.get(REASONS[NO_HOST_MEMORY], 0)
