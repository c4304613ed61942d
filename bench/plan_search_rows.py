"""What skipping rule-rejected rows saves in ``luban plan search``, in one run.

    .venv/bin/python bench/plan_search_rows.py

``search`` counts, without estimating them, the rows of axis 0 (dp, tp, pp, cp, schedule, virtual
stages, ep) that a layout rule rejects whatever the other knobs are (``_rejected_rows``). Here each
case is searched twice, alternately: as it is, and with no row skipped (every layout estimated, as
before 2026-11-27). Both give the same counts and best layouts (asserted here, and in
tests/plan/test_search.py). CPU seconds of this process: the machine may be shared.
"""

import time
from unittest import mock

from luban.model.presets import get_preset
from luban.plan import search as searching
from luban.plan.problem import Problem
from luban.plan.system import load_system

# (model, GPUs = global batch, seq): the search benchmark's cases, then GPU counts with many divisors
CASES = [("gpt3-175b", 64, 2048), ("llama-70b", 1024, 8192), ("megatron-1t", 3072, 2048), ("llama-8b", 5040, 8192),
         ("llama-8b", 55440, 8192)]


def timed(problem: Problem, skip: bool):
    start = time.process_time()
    if skip:
        result = searching.search(problem, top=5)
    else:
        with mock.patch.object(searching, "_rejected_rows", lambda g, p: searching.np.zeros(g.shape[0], bool)):
            result = searching.search(problem, top=5)
    return result, time.process_time() - start


def main() -> None:
    system = load_system("dgx-h100")
    print("| case | layouts | rows skipped | CPU s, every layout estimated | CPU s, rejected rows skipped | speed-up |\n"
          "|---|---|---|---|---|---|")
    for name, gpus, seq in CASES:
        problem = Problem(get_preset(name), system, gpus, seq, gpus, "luban")
        grid = searching.candidate_grid(problem)
        skipped = searching._rejected_rows(grid, problem).mean()
        before, t_before = timed(problem, skip=False)
        after, t_after = timed(problem, skip=True)
        assert (before.evaluated, before.valid, before.rejected) == (after.evaluated, after.valid, after.rejected)
        assert [e.layout for e in before.best] == [e.layout for e in after.best]
        print(f"| {name} on {gpus} | {after.evaluated:,} | {skipped:.0%} | {t_before:.2f} | {t_after:.2f} | "
              f"{t_before / t_after:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
