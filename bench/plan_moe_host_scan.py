"""The MoE host time (``runtimes.MegatronCore.moe_layer_host_s``) against the two MoE sources.

For each value of the knob, the mean |error| of the Megatron-Core MoE ModelZoo rows and of the
Megatron-Bridge MoE rows (``luban.plan.validate``), first in the planner's form (a MoE layer's
forward takes max(device, host) after its token-count wait: ``luban.plan.time.moe_host_stall``),
then, for comparison, as a fixed cost per MoE layer added to the device time (no max). Then the
leave-one-source-out fit of the knob (``luban.plan.loso.fit_moe``). docs/planner.md (MoE,
"Session 15") and bench/results/plan.md quote its output.

    .venv/bin/python bench/plan_moe_host_scan.py
"""

import time

import numpy as np

from luban.plan import loso
from luban.plan import time as plan_time
from luban.plan import validate

VALUES_MS = (0, 1, 2, 3, 4, 5, 5.5, 5.75, 6, 6.5, 7, 8, 10)


def scores() -> str:
    zoo, bridge = validate.megatron_moe_modelzoo(), validate.megatron_bridge_moe()
    rows = " ".join(f"{r['error']:+.0%}" for r in zoo)
    return (f"ModelZoo {np.mean([abs(r['error']) for r in zoo]):6.1%} [{rows}]  "
            f"Megatron-Bridge {np.mean([abs(r['error']) for r in bridge]):6.1%}")


def main() -> None:
    start = time.time()
    print("max(device, host) per MoE layer forward (the planner's form):")
    for ms in VALUES_MS:
        with loso.moe_layer_host(ms * 1e-3):
            print(f"  host {ms:5.2f} ms  {scores()}")
    print("a fixed cost per MoE layer forward added to the device time (for comparison):")
    stall = plan_time.moe_host_stall
    try:
        for ms in VALUES_MS[:8]:
            plan_time.moe_host_stall = lambda problem, device, c=ms * 1e-3: (
                problem.derived["moe_share"] * c if problem.model.moe else 0.0)
            print(f"  cost {ms:5.2f} ms  {scores()}")
    finally:
        plan_time.moe_host_stall = stall
    out = loso.fit_moe()
    print(f"leave-one-source-out (shipped {out['shipped'] * 1e3:g} ms, fitted on both {out['best_all'] * 1e3:g} ms):")
    for name, s in out["sources"].items():
        print(f"  {name:34s} held out {s['held_out']:6.2%} (knob refitted without it: {s['moe_host'] * 1e3:g} ms)"
              f"  at the shipped value {s['fitted']:6.2%}")
    print(f"({time.time() - start:.1f} s)")


if __name__ == "__main__":
    main()
