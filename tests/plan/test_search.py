"""The search: counts, rejection reasons and the best layout of known cases."""

from luban.parallel.layout import check_layout
from luban.plan.search import search

from plan_helpers import make_problem


def test_single_gpu_small_model_prefers_big_microbatches_without_recompute():
    problem = make_problem("gpt2-124m", gpus=1, seq=1024, batch=8)
    result = search(problem, top=3)
    best = result.best[0].layout
    assert (best.tp, best.pp, best.cp, best.dp) == (1, 1, 1, 1)
    assert best.recompute == "none" and best.micro_batch == 8 and best.offload == "none"


def test_175b_on_64_a100_keeps_tp_in_node_and_splits_the_weights():
    """175B cannot sit replicated on a GPU: every layout the search keeps pipelines or shards the
    weights (ZeRO-3), and tensor parallel stays inside the NVLink domain."""
    problem = make_problem("gpt3-175b", gpus=64, batch=64)
    result = search(problem, top=5)
    assert result.valid > 0 and len(result.best) == 5
    assert sum(result.rejected.values()) + result.valid == result.evaluated
    speeds = [e.tokens_per_s for e in result.best]
    assert speeds == sorted(speeds, reverse=True)
    for est in result.best:
        assert est.fits and est.layout.tp <= 8 and (est.layout.pp > 1 or est.layout.zero == 3)
        check_layout(est.layout, problem.model, 64, 64, 2048)  # every reported layout is valid
    assert result.rejected["does not fit in GPU memory"] > 0


def test_no_layout_fits_reports_memory_rejections():
    problem = make_problem("llama-405b", gpus=8, seq=8192, batch=8)
    result = search(problem, top=1, offloads=(0,))
    assert result.best == [] and result.rejected["does not fit in GPU memory"] > 0


def test_a_long_search_reports_its_progress():
    """search calls progress after each chunk, up to every layout; the CLI's line appears only once a
    search has run PROGRESS_AFTER_S (a fake clock here), with how far it has come."""
    import io

    from luban.plan.cli import PROGRESS_AFTER_S, ProgressLine

    seen = []
    problem = make_problem("gpt2-124m", 64, 1024, 64, system="dgx-h100")
    result = search(problem, chunk=1 << 10, progress=lambda done, total: seen.append((done, total)))
    assert len(seen) > 3 and seen[-1] == (result.evaluated, result.evaluated)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    now, out = [0.0], io.StringIO()
    line = ProgressLine(clock=lambda: now[0], out=out)
    line(10, 100)
    assert out.getvalue() == ""
    now[0] = PROGRESS_AFTER_S
    line(25, 100)
    assert out.getvalue() == "searched 25 of 100 layouts (25%) in 5 s; about 15 s left\n"


def test_rows_a_rule_rejects_whatever_the_other_knobs_are_counted_not_estimated():
    """The search skips the estimate of axis-0 rows a layout rule rejects on their own (tp not
    dividing the heads, more stages than layers): the counts per reason and the best layouts are
    those of every layout estimated and checked at once."""
    import numpy as np

    from luban.plan.estimate import evaluate
    from luban.plan.rules import REASONS, first_violation
    from luban.plan.search import _rejected_rows, candidate_grid

    for problem in (make_problem("llama-8b", 96, 4096, 96, system="dgx-h100"),
                    make_problem("mixtral-8x7b", 48, 4096, 48, system="dgx-h100")):
        result = search(problem, top=4)
        g = candidate_grid(problem)
        assert 0 < _rejected_rows(g, problem).sum() < g.shape[0]  # some rows skipped, some estimated
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            results = evaluate(problem, g)
            mem = results["memory"]
            codes = np.broadcast_to(first_violation(g, problem.model, problem.global_batch, problem.gpus,
                                                    problem.seq, extra=(~mem["fits_hbm"], ~mem["fits_host"]),
                                                    rules=problem.runtime_model), g.shape).ravel()
        counts = np.bincount(codes, minlength=len(REASONS))
        assert result.evaluated == codes.size and result.valid == counts[0] > 0
        assert result.rejected == {REASONS[k]: int(c) for k, c in enumerate(counts) if k and c}
        speed = np.broadcast_to(results["tokens_per_s"], g.shape).ravel()
        valid = np.flatnonzero(codes == 0)
        order = valid[np.lexsort((valid, -speed[valid]))[:4]]
        assert [e.layout for e in result.best] == [g.layout(int(i)) for i in order]
