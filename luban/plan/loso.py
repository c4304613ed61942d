"""Validation by source: leave-one-source-out (LOSO) over the calibrated knobs.

A *source* is a team + the runtime it measured with (NeMo/Megatron-Bridge is one source whatever
the release; docs/planner.md "Validation by source" lists them). The planner has five calibrated
knobs, each applied unchanged to every row (every other constant is a datasheet figure or a
cited property of a runtime):

``mm``
    scales every profile's GEMM-efficiency curve (``efficiency.matmul``; x1 = as shipped);
``attn``
    scales every profile's ``efficiency.attention_matmul`` (the share of that curve a fused causal
    attention kernel reaches), capped at 1;
``fp8``
    scales every profile's ``efficiency.fp8_matmul`` (the share fp8 GEMMs reach at the fp8 peak);
``eager``
    ``luban.plan.runtimes.EAGER_TRAFFIC``, the elementwise HBM traffic of an eager PyTorch runtime
    over a fused one;
``ds``
    ``runtimes.MegatronDeepSpeed.compute_speed``, the share of Megatron-LM's compute speed
    Megatron-DeepSpeed's 2021-22 runs reached (only the BLOOM and MT-NLG rows depend on it, so each of
    the two is scored at the value the other alone implies).

The MoE rows have one knob of their own, ``moe_host`` (``runtimes.MegatronCore.moe_layer_host_s``,
the host time of a MoE layer's forward after its token-count wait: ``luban.plan.time.moe_host_stall``),
fitted the same way over the two MoE sources (``fit_moe``).

``fit`` scores every knob combination of a small grid once per table (a table is evaluated only
over the knobs it depends on: ``TABLE_KNOBS``), then for each source picks the combination with
the lowest mean over the *other* sources of their mean |error| and scores the left-out source
there. The headline is the mean of those left-out scores over the dense sources. Knobs that no
other source informs are flat in that objective: the tie goes to the shipped value (x1, the
shipped ``EAGER_TRAFFIC`` and ``compute_speed``), which was itself chosen by this fit over all sources
(``bench/plan_calibrate_sources.py``), so a source that alone informs a knob is not fully held
out of it; docs/planner.md names where that happens.
"""

from __future__ import annotations

import contextlib
import itertools

import numpy as np

from luban.plan import runtimes
from luban.plan.system import System, load_system

# Megatron-DeepSpeed's compute speed (absolute, ``runtimes.MegatronDeepSpeed.compute_speed``): 0.60 to 1.00
# (Megatron-LM's) by 0.05, set before any fit from the evidence (MT-NLG reached 0.69-0.77 of Megatron-LM's
# TFLOP/s on the same model, layout and machine: runtimes.MegatronDeepSpeed) with room on both sides
DS_GRID = tuple(round(0.60 + 0.05 * i, 2) for i in range(9))
# the grids (x shipped value, except eager: absolute, the shipped EAGER_TRAFFIC and +-1 around it, and ds:
# DS_GRID); FULL for `luban plan validate`, SMALL for tests
FULL_GRID = {"mm": (0.96, 1.0, 1.04), "attn": (0.8, 1.0, 1.25), "fp8": (0.9, 1.0, 1.1),
             "eager": (runtimes.EAGER_TRAFFIC - 1, runtimes.EAGER_TRAFFIC, runtimes.EAGER_TRAFFIC + 1), "ds": DS_GRID}
SMALL_GRID = {"mm": (0.96, 1.0), "attn": (1.0,), "fp8": (1.0,), "eager": (runtimes.EAGER_TRAFFIC - 1, runtimes.EAGER_TRAFFIC),
              "ds": (0.75, 0.80, 0.85)}
# a finer grid (1,050 x 9 combinations, minutes): how much the headline depends on the grid (docs/planner.md)
FINE_GRID = {"mm": (0.94, 0.96, 0.98, 1.0, 1.02, 1.04, 1.06), "attn": (0.8, 0.9, 1.0, 1.1, 1.25),
             "fp8": (0.85, 0.9, 0.95, 1.0, 1.05, 1.1), "eager": (1.0, 1.5, 2.0, 2.5, 3.0), "ds": DS_GRID}
KNOBS = ("mm", "attn", "fp8", "eager", "ds")
GRIDS = {"full": FULL_GRID, "small": SMALL_GRID, "fine": FINE_GRID}
PROFILES = ("dgx-a100-80g", "dgx-a100-40g", "dgx-h100", "hgx-h200")


def candidate_systems(mm: float = 1.0, attn: float = 1.0, fp8: float = 1.0) -> dict:
    """Every built-in GPU profile with the knobs applied."""
    out = {}
    for name in PROFILES:
        raw = load_system(name).to_dict()
        eff = dict(raw["efficiency"])
        eff["matmul"] = [min(1.0, x * mm) for x in eff["matmul"]]
        eff["attention_matmul"] = min(1.0, eff["attention_matmul"] * attn)
        eff["fp8_matmul"] = min(1.0, eff["fp8_matmul"] * fp8)
        raw["efficiency"] = eff
        out[name] = System.from_dict(raw, source=name)
    return out


@contextlib.contextmanager
def _knob(owner, name: str, value: float):
    """``owner.name`` (a calibrated knob) set to ``value`` for the duration (restored after)."""
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def eager_traffic(value: float):
    """``runtimes.EAGER_TRAFFIC`` set to ``value`` for the duration (restored after)."""
    return _knob(runtimes, "EAGER_TRAFFIC", value)


def deepspeed_speed(value: float):
    """``runtimes.MegatronDeepSpeed.compute_speed`` set to ``value`` for the duration (restored after)."""
    return _knob(runtimes.MegatronDeepSpeed, "compute_speed", value)


def _shipped(knob: str) -> float:
    """The shipped value of a knob on its grid's scale (x1 for the profile scales)."""
    return {"eager": runtimes.EAGER_TRAFFIC, "ds": runtimes.MegatronDeepSpeed.compute_speed}.get(knob, 1.0)


def _distance(candidate: dict) -> float:
    """How far a candidate is from the shipped values (a knob a candidate lacks: at its shipped value)."""
    return sum(abs(candidate.get(k, _shipped(k)) - _shipped(k)) for k in KNOBS)


def _tables():
    """(table name, source, knobs it depends on, rows(systems) -> list of rows) for every dense
    table, and the MoE one."""
    from luban.plan import validate as v

    def a100(fn, **kw):
        return lambda systems: fn(systems["dgx-a100-80g"], **kw)

    def h100(fn):
        return lambda systems: fn(systems["dgx-h100"])

    def csv(name, table):
        return lambda systems: v.source_rows(name, table, systems)

    return [
        ("korthikanti2022-t5", "nvidia-megatron-lm", ("mm",), a100(v.korthikanti_table5)),
        ("narayanan2021-t1", "nvidia-megatron-lm", ("mm",), a100(v.narayanan_table1)),
        ("megatron-bridge-h100-dense", "nvidia-nemo-megatron-core", ("mm", "attn", "fp8"), h100(v.megatron_bridge_dense)),
        ("nemo-h100-long-sequence-cp", "nvidia-nemo-megatron-core", ("mm", "attn", "fp8"), h100(v.nemo_long_sequence)),
        ("llama3-2024-t4-h100", "meta-llama3", ("mm", "attn"), h100(v.llama3_table4)),
        ("mosaicml-llm-foundry", "mosaicml-composer", ("mm", "attn", "eager"),
         csv("mosaicml_llm_foundry_throughput.csv", "mosaicml-llm-foundry")),
        ("torchtitan-h100", "torchtitan", ("mm", "attn", "eager"), csv("torchtitan_llama3_h100.csv", "torchtitan-h100")),
        ("trainy-torchtitan-h200", "trainy-torchtitan", ("mm", "attn", "fp8", "eager"),
         csv("trainy_torchtitan_h200.csv", "trainy-torchtitan-h200")),
        ("megatron-deepspeed-a100", None, ("mm", "ds"), csv("megatron_deepspeed_a100.csv", "megatron-deepspeed-a100")),
        ("h100-single-gpu", "luban-h100-single-gpu", ("mm", "attn", "eager"), lambda systems: v.h100_single_gpu(systems)),
    ]


def _row_source(row: dict, default: str | None) -> str:
    return row.get("source") or default


def score_grid(grid: dict | None = None) -> tuple[list, dict]:
    """(candidates, errors): ``errors[source][candidate index]`` is the list of |error| of that
    source's rows at that knob combination."""
    grid = grid or FULL_GRID
    grid = {k: grid.get(k, (_shipped(k),)) for k in KNOBS}  # a grid without a knob keeps it shipped
    names = KNOBS
    candidates = [dict(zip(names, c)) for c in itertools.product(*(grid[k] for k in names))]
    cache: dict = {}
    for table, source, knobs, rows_of in _tables():
        for combo in itertools.product(*(grid[k] if k in knobs else (None,) for k in names)):
            key = dict(zip(names, combo))
            systems = candidate_systems(key["mm"] or 1.0, key["attn"] or 1.0, key["fp8"] or 1.0)
            with eager_traffic(key["eager"] if key["eager"] is not None else runtimes.EAGER_TRAFFIC), \
                    deepspeed_speed(key["ds"] if key["ds"] is not None else runtimes.MegatronDeepSpeed.compute_speed):
                rows = rows_of(systems)
            cache[(table, combo)] = [(_row_source(r, source), abs(r["error"])) for r in rows]
    errors: dict = {}
    for i, cand in enumerate(candidates):
        for table, source, knobs, _ in _tables():
            combo = tuple(cand[k] if k in knobs else None for k in names)
            for src, err in cache[(table, combo)]:
                if src not in errors:  # not setdefault: its default, a list per candidate, was built for every row
                    errors[src] = [[] for _ in candidates]
                errors[src][i].append(err)
    return candidates, errors


def _shipped_index(candidates: list) -> int:
    """The candidate nearest the shipped values (x1, shipped EAGER_TRAFFIC and compute_speed): the tie-break."""
    return int(np.argmin([_distance(c) for c in candidates]))


def fit(grid: dict | None = None) -> dict:
    """Leave-one-source-out: per source, the knobs refitted without it and its mean |error| there;
    also its error at the shipped knobs (``fitted``: the shipped values were fitted on every
    source) and the best combination over all sources."""
    candidates, errors = score_grid(grid)
    means = {s: np.array([np.mean(e) if e else np.nan for e in per]) for s, per in errors.items()}
    shipped = _shipped_index(candidates)
    dist = np.array([_distance(c) for c in candidates])

    def best(sources):
        objective = np.mean([means[s] for s in sources], axis=0)
        objective = np.round(objective, 6) + 1e-9 * dist  # ties (a knob no source informs) go to the shipped value
        return int(np.argmin(objective))

    sources = sorted(means)
    out = {"candidates": len(candidates), "sources": {}}
    for s in sources:
        i = best([o for o in sources if o != s])
        out["sources"][s] = {"rows": len(errors[s][0]), "held_out": float(means[s][i]), "knobs": candidates[i],
                             "fitted": float(means[s][shipped]), "max_held_out": float(np.max(errors[s][i]))}
    all_i = best(sources)
    out["best_all"] = candidates[all_i]
    out["headline"] = float(np.mean([out["sources"][s]["held_out"] for s in sources]))
    out["fitted_mean"] = float(np.mean([out["sources"][s]["fitted"] for s in sources]))
    return out


# the MoE knob's grid: runtimes.MegatronCore.moe_layer_host_s from 0 to 10 ms in 0.25 ms steps
MOE_HOST_GRID = tuple(round(0.25e-3 * i, 7) for i in range(41))


def moe_layer_host(value: float):
    """``runtimes.MegatronCore.moe_layer_host_s`` set to ``value`` for the duration (restored after)."""
    return _knob(runtimes.MegatronCore, "moe_layer_host_s", value)


def _moe_tables():
    """(source, rows()) of the MoE sources: a team + runtime each (docs/planner.md, MoE)."""
    from luban.plan import validate as v

    return [("nvidia-megatron-bridge-moe", v.megatron_bridge_moe), ("nvidia-megatron-core-moe-modelzoo", v.megatron_moe_modelzoo)]


def fit_moe(grid: tuple = MOE_HOST_GRID) -> dict:
    """Leave-one-source-out over the MoE sources for ``moe_host``: per source, the value that minimises
    the other sources' mean |error| and this source's mean |error| there; also its error at the shipped
    value and the value fitted on all sources (the mean of the sources' means: how the shipped value was
    chosen)."""
    shipped = runtimes.MegatronCore.moe_layer_host_s
    errors = {}
    for value in grid:
        with moe_layer_host(value):
            for source, rows_of in _moe_tables():
                errors.setdefault(source, []).append([abs(r["error"]) for r in rows_of()])
    means = {s: np.array([np.mean(e) for e in per]) for s, per in errors.items()}
    with moe_layer_host(shipped):
        at_shipped = {s: float(np.mean([abs(r["error"]) for r in rows_of()])) for s, rows_of in _moe_tables()}
    dist = np.abs(np.array(grid) - shipped)

    def best(sources):
        return int(np.argmin(np.round(np.mean([means[s] for s in sources], axis=0), 6) + 1e-9 * dist))

    sources = sorted(means)
    out = {"grid": len(grid), "shipped": shipped, "sources": {}}
    for s in sources:
        i = best([o for o in sources if o != s])
        out["sources"][s] = {"rows": len(errors[s][0]), "held_out": float(means[s][i]), "moe_host": grid[i],
                             "fitted": at_shipped[s], "max_held_out": float(np.max(errors[s][i]))}
    out["best_all"] = grid[best(sources)]
    out["headline"] = float(np.mean([out["sources"][s]["held_out"] for s in sources]))
    return out
