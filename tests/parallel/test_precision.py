"""Mixed precision across ranks: bf16 and fp16 (dynamic loss scaling) under every parallel
dimension train like the single process at the same precision.

The single process uses autocast; DDP does too, so it matches to fp32 rounding (1e-5). Under bf16 FSDP2
casts the parameters itself (``MixedPrecisionPolicy``; fp16 FSDP2 uses autocast since 2026-11-28,
``precision.FSDP_PARAM_DTYPE``) and tp/pp/cp split the reductions differently, so
low-precision rounding differs: the bounds are a few bf16/fp16 roundings of a 2-step SGD update
(lr 0.1), measured at 6e-5 (bf16) and 8e-6 (fp16) on 2026-11-21, and each layout must also be
closer to its own precision's single-process run than a bf16 run is to fp32 (4e-5 and up).
A loss scale that overflows must skip the step on every rank and halve the scale everywhere.
All jobs run in one 2-rank spawn.
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel.harness import max_diff, merged_params, results, run_job, spawn

TOL = {"bf16": 2e-4, "fp16": 3e-5}
LAYOUTS = {"dp2": {"dp": 2}, "zero1-dp2": {"dp": 2, "zero": 1}, "zero3-dp2": {"dp": 2, "zero": 3},
           "tp2-sp": {"tp": 2, "sp": True}, "pp2": {"pp": 2, "micro_batch": 2}, "cp2": {"cp": 2}}
CASES = [(f"{name}-{precision}", {**layout, "precision": precision}) for precision in TOL
         for name, layout in LAYOUTS.items()]
OVERFLOW = {"name": "overflow-zero2-fp16", "preset": "tiny", "layout": {"dp": 2, "zero": 2, "precision": "fp16"},
            "init_scale": 2.0**40, "steps": 1}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("precision")
    spawn([*({"name": name, "preset": "tiny", "layout": layout} for name, layout in CASES), OVERFLOW], 2, out)
    refs = {p: run_job({"name": "ref", "preset": "tiny", "layout": {"precision": p}}) for p in ("fp32", *TOL)}
    return out, refs


@pytest.mark.multirank
@pytest.mark.parametrize("name,layout", CASES, ids=[c[0] for c in CASES])
def test_low_precision_matches_the_single_process(runs, name, layout):
    out, refs = runs
    per_rank = results(name, 2, out)
    params, ref = merged_params(per_rank), refs[layout["precision"]]
    assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank)
    bound = 1e-5 if set(layout) == {"dp", "precision"} else TOL[layout["precision"]]  # DDP: same autocast math
    assert max_diff(params, ref["params"]) < bound
    assert per_rank[0]["losses"] == pytest.approx(ref["losses"], abs=1e-3)
    assert max_diff(ref["params"], refs["fp32"]["params"]) > 0  # the precision really changed the numbers


@pytest.mark.multirank
def test_fp16_overflow_skips_the_step_on_every_rank(runs):
    out, _ = runs
    per_rank = results(OVERFLOW["name"], 2, out)
    single = run_job({**OVERFLOW, "layout": {"precision": "fp16"}})
    initial = run_job({**OVERFLOW, "layout": {"precision": "fp16"}, "steps": 0})
    assert [r["scale"] for r in per_rank] == [2.0**39, 2.0**39] and single["scale"] == 2.0**39
    assert all(not torch.isfinite(torch.tensor(r["norms"])).any() for r in per_rank)
    assert max_diff(merged_params(per_rank), initial["params"]) == 0  # nothing was applied
