"""The vectorised validity mask agrees with ``check_layout`` on many random layouts."""

import dataclasses

import numpy as np
import pytest

from luban.errors import LubanError
from luban.model.presets import get_preset
from luban.parallel.layout import LUBAN_RULES, OFFLOADS, PRECISIONS, SCHEDULES, ParallelLayout, check_layout
from luban.plan import runtimes
from luban.plan.grid import Grid
from luban.plan.rules import first_violation

MODELS = [get_preset("tiny-llama"), get_preset("megatron-22b"), get_preset("turing-530b").replace(dropout=0.1),
          get_preset("tiny-moe"), get_preset("qwen3-30b-a3b"),
          get_preset("tiny-moe").replace(capacity_factor=1.25),  # refused with cp > 1
          get_preset("tiny-llama").replace(kv_heads=4, vocab=9)]  # tp = 4 or 8 would leave a rank no vocabulary rows
CHOICES = dict(dp=[1, 2, 3, 4, 8, 16], dp_replicate=[1, 2, 4], zero=[0, 1, 2, 3], tp=[1, 2, 3, 4, 8, 16],
               sp=[False, True], pp=[1, 2, 4, 5, 8, 35], schedule=list(SCHEDULES), virtual_stages=[1, 2, 3, 4],
               cp=[1, 2, 4, 3], micro_batch=[1, 2, 3, 4, 8], recompute=["none", "selective", "full", "full:2"],
               offload=list(OFFLOADS), precision=list(PRECISIONS), loss_scale=["dynamic", "none"], ep=[1, 2, 3, 4, 8])
V_FOR = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 3, "zero-bubble": 2, "dualpipev": 2}


def random_layout(rng, gpus: int) -> ParallelLayout:
    """Uniform knobs; in half the draws repaired towards validity so both outcomes are common."""
    raw = {k: v[rng.integers(len(v))] for k, v in CHOICES.items()}
    if rng.random() < 0.5:
        raw.update(dp_replicate=1, loss_scale="dynamic", offload="none", virtual_stages=V_FOR[raw["schedule"]],
                   zero=max(raw["zero"], 1), tp=int(rng.choice([1, 2, 4])), pp=int(rng.choice([1, 2, 4])),
                   cp=int(rng.choice([1, 2])), micro_batch=int(rng.choice([1, 2])), ep=int(rng.choice([1, 1, 2])))
        raw["sp"] = raw["sp"] and raw["tp"] > 1
        inner = raw["tp"] * raw["pp"] * raw["cp"]
        if gpus % inner == 0:
            raw["dp"] = gpus // inner
    return ParallelLayout(**raw)


@pytest.mark.parametrize("rules", [LUBAN_RULES, runtimes.get("megatron")], ids=["luban", "megatron"])
def test_mask_agrees_with_check_layout_on_random_layouts(rules):
    """Under luban's rules and under a runtime model's (Megatron: DDP with tp and zero-bubble)."""
    rng = np.random.default_rng(0)
    outcomes = []
    for _ in range(16):
        model = MODELS[rng.integers(len(MODELS))]
        gpus, batch, seq = (int(rng.choice(c)) for c in ([8, 16, 70, 128], [8, 64, 280, 512], [128, 2048, 96]))
        layouts = [random_layout(rng, gpus) for _ in range(250)]
        grids = [Grid.from_layout(lay) for lay in layouts]
        columns = {f.name: np.array([getattr(g, f.name) for g in grids])
                   for f in dataclasses.fields(Grid) if f.name != "stage_layers"}
        mask = first_violation(Grid(**columns), model, batch, gpus, seq, rules=rules) == 0
        for layout, got in zip(layouts, mask):
            try:
                check_layout(layout, model, batch, gpus, seq, rules=rules)
                expected = True
            except LubanError:
                expected = False
            assert got == expected, (layout, model.name, batch, gpus, seq)
            outcomes.append(expected)
    assert 100 < sum(outcomes) < len(outcomes) - 100  # both outcomes exercised


def test_the_mask_has_the_rules_the_layout_review_added():
    """2026-11-27: check_layout refused a MoE capacity with cp > 1 and a tp that leaves a rank no
    vocabulary rows; the search proposed such layouts (its mask lacked the two rules)."""
    from luban.plan.rules import REASONS
    grid = Grid.from_layout(ParallelLayout(dp=2, cp=2))
    code = first_violation(grid, get_preset("tiny-moe").replace(capacity_factor=1.25), 8, 4, 128)
    assert REASONS[int(code)] == "cp > 1 with a MoE expert capacity (capacity_factor > 0)"
    code = first_violation(Grid.from_layout(ParallelLayout(tp=4, zero=1)), get_preset("tiny-llama").replace(kv_heads=4, vocab=9),
                           8, 4, 128)
    assert REASONS[int(code)] == "tp leaves a rank no vocabulary rows"
