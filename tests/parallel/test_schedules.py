"""The schedule registry is the one statement of pipeline layout arithmetic: the planner's
per-rank parameter and layer counts equal what the runtime builds, for every schedule."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from luban.model.presets import get_preset
from luban.parallel import schedules
from luban.parallel.layout import ParallelLayout, check_layout, min_microbatches
from luban.parallel.pipeline import TransformerPipeline, split_layers
from luban.plan.grid import Grid
from luban.plan.memory import rank_layers, rank_params
from luban.plan.problem import Problem
from luban.plan.system import load_system
from luban.plan.time import pipeline_bubble

TINY_LLAMA = get_preset("tiny-llama")
# deeper models whose LM head weighs several layers, so the split is uneven; one tied, one GPT
DEEP = TINY_LLAMA.replace(name="deep-llama", layers=13, vocab=4001)
DEEP_TIED_GPT = get_preset("tiny").replace(name="deep-gpt", layers=11, vocab=3001, tie_embeddings=True)


def layouts():
    for s in schedules.REGISTRY:
        vs = [2] if s.placement == schedules.V else [1] if s.single_stage else [2, 3]
        for pp, v in itertools.product([2, 3, 4], vs):
            yield s.name, pp, v


def built_rank_params(cfg, schedule: str, pp: int, v: int) -> tuple[list[int], list[int]]:
    """Parameters and layers each pipeline rank builds (tied copies on one rank counted once)."""
    sched = schedules.get(schedule)
    n_stages = sched.stages(pp, v)
    model = TransformerPipeline(cfg, seed=0, device=torch.device("cpu"))
    stages = [model.build_stage(sid, n_stages) for sid in range(n_stages)]
    params, layers = [], []
    for r in range(pp):
        held = [stages[sid] for sid in sched.stage_ids(r, pp, v)]
        unique = {id(p): p.numel() for m in held for p in m.parameters()}
        params.append(sum(unique.values()))
        layers.append(sum(len(m.layers) for m in held))
    return params, layers


@pytest.mark.parametrize("cfg", [TINY_LLAMA, DEEP, DEEP_TIED_GPT], ids=lambda c: c.name)
def test_planner_rank_params_equal_the_built_stages(cfg):
    system = load_system("dgx-a100-80g")
    checked = 0
    for schedule, pp, v in layouts():
        if schedules.get(schedule).stages(pp, v) > cfg.layers:
            continue
        layout = ParallelLayout(pp=pp, schedule=schedule, virtual_stages=v, zero=1)
        problem = Problem(cfg, system, pp, cfg.seq_len, 64, runtime="luban")  # the split luban builds
        g = Grid.from_layout(layout)
        first, last = (int(x) for x in rank_params(problem, g))
        l_first, l_last, l_most = (int(x) for x in rank_layers(problem, g))
        params, layers = built_rank_params(cfg, schedule, pp, v)
        last_rank = schedules.get(schedule).rank_of(schedules.get(schedule).stages(pp, v) - 1, pp, v)
        where = (schedule, pp, v)
        assert (first, last) == (params[0], params[last_rank]), where
        assert (l_first, l_last, l_most) == (layers[0], layers[last_rank], max(layers)), where
        checked += 1
    assert checked >= 9


def test_issue_example_tiny_llama_pp2_v2():
    """Issue #11: the runtime builds 402,048 and 402,176 parameters; the planner said 435,072 on each."""
    params, _ = built_rank_params(TINY_LLAMA, "zero-bubble", 2, 2)
    assert params == [402_048, 402_176]
    problem = Problem(TINY_LLAMA, load_system("dgx-a100-80g"), 2, 128, 64, runtime="luban")
    g = Grid.from_layout(ParallelLayout(pp=2, schedule="zero-bubble", virtual_stages=2, zero=1))
    assert [int(x) for x in rank_params(problem, g)] == params


def test_explicit_split_is_placed_by_the_schedule():
    """dualpipev puts chunk 0 and chunk 2pp−1 on rank 0 (not chunk j on rank j mod pp)."""
    split = (1, 3, 1, 1)
    layout = ParallelLayout(pp=2, schedule="dualpipev", virtual_stages=2, pp_split=split, zero=1)
    problem = Problem(TINY_LLAMA.replace(layers=6), load_system("dgx-a100-80g"), 2, 128, 64)
    assert [int(x) for x in rank_layers(problem, Grid.from_layout(layout))] == [2, 2, 4]
    assert [len(r) for r in split_layers(problem.model, 4, split)] == list(split)


def _best_max_cost(layers: int, stages: int, head: float) -> float:
    """Brute force: the least possible cost of the most expensive stage."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        sizes = np.diff((0, *cuts, layers))
        best = min(best, max(sizes[:-1].max(initial=0), sizes[-1] + head))
    return best


def test_closed_form_split_is_optimal_and_its_arrays_match_the_placement():
    heads = [0.0, 0.4, 1.0, 2.5, 7.0]
    pps, vs, codes, hs, Ls, expect = [], [], [], [], [], []
    for L in range(1, 15):
        for s in schedules.REGISTRY:
            for pp, v in itertools.product([1, 2, 3, 4], [2] if s.placement == schedules.V else [1, 2, 3]):
                if pp * v > L:
                    continue
                for h in heads:
                    counts = schedules.stage_layer_counts(L, pp * v, h)
                    assert sum(counts) == L and min(counts) >= 1
                    cost = max(max(counts[:-1], default=0), counts[-1] + h)
                    assert cost == pytest.approx(_best_max_cost(L, pp * v, h)), (L, pp, v, h, counts)
                    expect.append(schedules.split_rank_layers(s, pp, v, counts) if pp > 1 else (L, L, L))
                    pps.append(pp), vs.append(v), codes.append(s.code), hs.append(h), Ls.append(L)
    # one vectorised call over all cases (the planner's path), per layer count
    got = np.stack([np.asarray(x) for x in schedules.rank_layers(
        np.array(Ls), np.array(pps), np.array(vs), np.array(hs), np.array(codes))], axis=1)
    assert got.tolist() == [list(e) for e in expect]


def test_check_layout_uses_the_registry_minimum():
    cfg = TINY_LLAMA
    for s in schedules.REGISTRY:
        v = 2 if s.min_virtual > 1 else 1
        layout = ParallelLayout(pp=2, schedule=s.name, virtual_stages=v)
        need = min_microbatches(layout)
        assert need == {"gpipe": 1, "dualpipev": 4}.get(s.name, 2)
        check_layout(layout, cfg, global_batch=need)
        if need > 1:
            with pytest.raises(Exception, match="needs >= "):
                check_layout(layout, cfg, global_batch=need - 1)


def test_bubble_vanishes_without_a_pipeline_and_follows_each_entry():
    g = Grid.from_layout(ParallelLayout(pp=4, schedule="interleaved-1f1b", virtual_stages=2))
    assert float(pipeline_bubble(g, 1.0, 2.0, 1.0)) == pytest.approx(3 * 3.0 / 2)
    g1 = Grid.from_layout(ParallelLayout())
    assert float(pipeline_bubble(g1, 1.0, 2.0, 1.0)) == 0.0


@pytest.mark.parametrize("name,factor", [("interleaved-1f1b", 2), ("zero-bubble", 1)])
def test_in_flight_equals_torch_warmup_counts(name, factor):
    """The planner's peak in-flight micro-batches of the interleaved schedules are torch's own
    warm-up counts (chunk forwards before the first backward, + the one in flight), over v."""
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    sched = schedules.get(name)
    for pp, v in itertools.product([2, 3, 4, 8], [2, 3, 4]):
        m = 8 * pp
        first, last = sched.in_flight(pp, v, m)
        for rank, expected in ((0, first), (pp - 1, last)):
            warmup = _get_warmup_ops(rank, v, pp, pp, m, multiply_factor=factor)
            assert (warmup + 1) / v == pytest.approx(expected), (name, pp, v, rank)
