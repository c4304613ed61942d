"""Fit the planner's calibrated knobs across independent sources, and score each source held out.

The knobs and the leave-one-source-out procedure are ``luban.plan.loso`` (docs/planner.md
"Validation by source"). This script prints, on the full grid:

* the leave-one-source-out table (each source scored at the knobs refitted without it) and the
  headline, the mean of those held-out errors over the dense sources;
* the same table for the planner *before* the per-runtime kernel model (``--before``: every runtime
  plans fused elementwise kernels, FSDP gathers the stored fp32 weights, "selective" is
  Korthikanti's for every runtime, luban's attention never skips the causal half and
  Megatron-DeepSpeed computes at Megatron-LM's speed — the mechanisms of main 3457f4b), so a change shows as before -> after on the same rows and grid;
* the objective over all sources along ``EAGER_TRAFFIC`` at the shipped GEMM/attention/fp8
  values (how ``luban.plan.runtimes.EAGER_TRAFFIC`` was chosen: the lowest mean of the sources'
  mean |error|), and the same along Megatron-DeepSpeed's ``compute_speed`` over ``loso.DS_GRID``
  (how ``runtimes.MegatronDeepSpeed.compute_speed`` was chosen; only BLOOM and MT-NLG move).

    .venv/bin/python bench/plan_calibrate_sources.py [--before] [--small]
"""

import argparse
import contextlib
import time

import numpy as np

from luban.plan import loso, runtimes


@contextlib.contextmanager
def before():
    """The per-runtime kernel model switched off (main 3457f4b's mechanisms)."""
    saved = {}
    patches = [(runtimes.Runtime, "traffic_scale", lambda self, problem, head=False: 1.0),
               (runtimes.Runtime, "gather_bytes", lambda self, wb, precision, problem=None: wb),
               (runtimes.FSDP2, "selective_redo", runtimes.Runtime.selective_redo),
               (runtimes.Luban, "skips_causal", lambda self, problem: False)]
    for cls, name, value in patches:
        saved[cls, name] = cls.__dict__.get(name)
        setattr(cls, name, value)
    try:
        yield
    finally:
        for (cls, name), value in saved.items():
            if value is None:
                delattr(cls, name)
            else:
                setattr(cls, name, value)


def report(result: dict, title: str) -> None:
    print(f"{title}: headline (mean held-out |error| over {len(result['sources'])} dense sources) "
          f"{result['headline']:.2%}; at the shipped knobs {result['fitted_mean']:.2%}; best over all {result['best_all']}")
    for name, s in result["sources"].items():
        print(f"  {name:32s} {s['rows']:3d} rows  held out {s['held_out']:7.2%}  shipped {s['fitted']:7.2%}  "
              f"refit without it: {s['knobs']}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", action="store_true", help="also score main 3457f4b's mechanisms")
    parser.add_argument("--small", action="store_true", help="the tests' small grid")
    args = parser.parse_args()
    grid = loso.SMALL_GRID if args.small else loso.FULL_GRID
    t = time.time()
    report(loso.fit(grid), "after")
    if args.before:
        with before(), loso.eager_traffic(1.0), loso.deepspeed_speed(1.0):
            report(loso.fit({**grid, "eager": (1.0,), "ds": (1.0,)}), "before")
    sweep = {"mm": (1.0,), "attn": (1.0,), "fp8": (1.0,), "eager": (1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0)}
    candidates, errors = loso.score_grid(sweep)
    for i, cand in enumerate(candidates):
        per = [np.mean(v[i]) for v in errors.values()]
        print(f"EAGER_TRAFFIC {cand['eager']:.1f}: mean over sources {np.mean(per):.2%}")
    candidates, errors = loso.score_grid({**sweep, "eager": (runtimes.EAGER_TRAFFIC,), "ds": loso.DS_GRID})
    for i, cand in enumerate(candidates):
        per = {s: np.mean(v[i]) for s, v in errors.items()}
        print(f"MegatronDeepSpeed.compute_speed {cand['ds']:.2f}: mean over sources {np.mean(list(per.values())):.2%}"
              f" (BLOOM {per['bigscience-megatron-deepspeed']:.2%}, MT-NLG {per['msft-nvidia-megatron-deepspeed']:.2%})")
    print(f"({time.time() - t:.0f} s)")


if __name__ == "__main__":
    main()
