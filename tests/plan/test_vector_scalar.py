"""The search's arrays and the one-layout estimate are the same formulas: they agree."""

import numpy as np
import pytest

from luban.plan.estimate import estimate
from luban.plan.grid import Grid
from luban.plan.search import _rows, candidate_grid
from luban.plan.estimate import evaluate

from plan_helpers import make_problem


@pytest.mark.parametrize("model,gpus,batch,seq", [("gpt3-175b", 64, 64, 2048), ("llama-8b", 16, 32, 4096)])
def test_grid_entries_equal_scalar_estimates(model, gpus, batch, seq):
    problem = make_problem(model, gpus=gpus, batch=batch, seq=seq)
    g = candidate_grid(problem)
    with np.errstate(all="ignore"):
        results = evaluate(problem, g)
    step = np.broadcast_to(results["time"]["step"], g.shape)
    total = np.broadcast_to(results["memory"]["total"], g.shape)
    rng = np.random.default_rng(1)
    for flat in rng.choice(int(np.prod(g.shape)), size=60, replace=False):
        index = np.unravel_index(flat, g.shape)
        layout = g.layout(index)
        if layout.world_size != gpus:
            continue
        est = estimate(problem.model, problem.system, layout, global_batch=batch, seq=seq, check=False)
        assert est.step_time_s == pytest.approx(step[index], rel=1e-12)
        assert est.memory_bytes["total"] == pytest.approx(total[index], rel=1e-12)
        assert Grid.from_layout(layout).layout() == layout


def test_row_chunks_cover_the_grid():
    problem = make_problem("gpt3-175b", gpus=16, batch=32)
    g = candidate_grid(problem)
    rows = g.shape[0]
    assert sum(_rows(g, slice(lo, lo + 7)).shape[0] for lo in range(0, rows, 7)) == rows
