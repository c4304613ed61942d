"""Fit the dgx-a100-80g calibration once: a coarse grid over three global knobs.

The knobs scale the profile's whole matmul-efficiency curve and collective-efficiency curve (so
x1.0 means "keep the current values") and
set the HBM traffic of memory-bound kernels. Each candidate profile is applied unchanged to
every row of Korthikanti 2022 Table 5 and Narayanan 2021 Table 1; the objective is the sum
of (mean error / 3%, max error / 8%) on Table 5 and (mean error / 5%) on Table 1 read twice:
at the fastest micro-batch of 1-8 per row and at micro-batch 1 on every row (the paper does not
publish it; #11 sets its goal on the second reading). Prints the best candidates; the chosen
values are written into luban/plan/systems/*.toml by hand.

History: 2026-11 (session 2) chose matmul x1.02, collective x0.9, traffic 2.0 on the first
reading alone; 2026-11-25 (session 6) added the micro-batch-1 reading and chose collective x0.8
of those values and traffic 1.5 (T5 2.41%, T1 2.24%, T1 at mb 1 4.50%; was 2.54/3.11/5.49%).
Rerun on the chosen profile, the grid's best (matmul x1.02, collective x0.9: score 2.831, T1 at
mb 1 4.98%) ties with it (x1.0, x1.0: 2.834); the chosen one keeps a margin on #11's 5% goal.
2026-11-26 (session 14): rings across nodes share the node's NICs (luban/plan/time.py ``collective``);
the data-parallel all-reduces of the Narayanan rows (dp 32 over 4 nodes, 8/tp ranks per node) got up to 8x
faster and the grid chose matmul x1.02, collective x1.1, traffic 2.0 of the 2026-11-25 values (score 2.586:
T5 2.38%, T1 2.52%, T1 at mb 1 4.17%; the 2026-11-25 values scored 3.183 under the new collectives).

    .venv/bin/python bench/plan_calibrate.py
"""

import itertools

from luban.plan.system import System, load_system
from luban.plan.validate import korthikanti_table5, narayanan_table1, summary


def candidate(base: System, mm: float, coll: float, traffic: float) -> System:
    raw = base.to_dict()
    eff = dict(raw["efficiency"])
    eff["matmul"] = [min(1.0, x * mm) for x in eff["matmul"]]
    eff["collective"] = [min(1.0, x * coll) for x in eff["collective"]]
    eff["elementwise_traffic"] = traffic
    raw["efficiency"] = eff
    return System.from_dict(raw)


def main() -> None:
    base = load_system("dgx-a100-80g")
    scored = []
    for mm, coll, traffic in itertools.product((0.96, 0.98, 1.0, 1.02, 1.04), (0.8, 0.9, 1.0, 1.1, 1.25),
                                               (1.25, 1.5, 2.0, 2.5)):
        system = candidate(base, mm, coll, traffic)
        k, n = summary(korthikanti_table5(system)), summary(narayanan_table1(system))
        n1 = summary(narayanan_table1(system, micro_batch=1))
        score = (k["mean_abs_error"] / 0.03 + k["max_abs_error"] / 0.08 + n["mean_abs_error"] / 0.05
                 + n1["mean_abs_error"] / 0.05)
        scored.append((score, mm, coll, traffic, k, n, n1))
    scored.sort(key=lambda row: row[0])
    for score, mm, coll, traffic, k, n, n1 in scored[:8]:
        print(f"score {score:.3f}  matmul x{mm}  collective x{coll}  traffic {traffic}  "
              f"T5 mean {k['mean_abs_error']:.2%} max {k['max_abs_error']:.2%}  T1 mean {n['mean_abs_error']:.2%}  "
              f"T1 mb1 mean {n1['mean_abs_error']:.2%} max {n1['max_abs_error']:.2%}")


if __name__ == "__main__":
    main()
