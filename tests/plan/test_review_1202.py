"""Review 2026-12-02 of ``luban plan``: each test is one defect, and fails without its fix."""

import numpy as np

from luban.parallel import schedules
from luban.parallel.layout import ParallelLayout
from luban.plan.grid import Grid
from luban.plan.memory import rank_layers, torchtitan_rank_layers

from plan_helpers import make_problem


def torchtitan_counts(layers: int, stages: int) -> list[int] | None:
    """Layers per stage as torchtitan's ``generate_llm_fqn_per_model_part`` deals them, stage by stage
    (the embedding and norm + output weigh one layer each); None where it refuses the layout."""
    effective = layers + 2
    per, extra = divmod(effective, stages)
    if stages == 1:
        return [layers]
    if per < 1:
        return None
    counts, left = [], layers
    for stage in range(stages):
        share = per + (stage < extra) - (stage == 0) - (stage == stages - 1)
        take = min(share, left)
        counts.append(take)
        left -= take
    assert left == 0
    return counts


def test_fsdp2_plans_torchtitans_pipeline_split():
    """The fsdp2 (torchtitan) runtime was planned on luban's split, which lightens only the last stage by
    the head's cost; torchtitan deals (layers + 2) / stages with the embedding and the output one layer
    each (Llama 3 405B, 126 layers, on pp 8 x 2 loop chunks: 7 on the first and the last stage, 8 on the 14
    others, so rank 0 holds 15 layers where luban's split puts 16 there); checked against dealing the
    counts stage by stage and placing them as ``pipeline_module_split`` does, for every schedule."""
    checked = 0
    for layers in (12, 16, 30, 32, 46, 62, 80, 94, 126, 7, 5):
        for name in ("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "dualpipev"):
            sched = schedules.get(name)
            for pp in (2, 3, 4, 8, 16):
                for v in ((2,) if sched.placement == schedules.V else (1, 2, 3, 4) if name != "1f1b" and name != "gpipe" else (1,)):
                    counts = torchtitan_counts(layers, pp * v)
                    fallback = (np.array(-1),) * 3
                    got = tuple(int(x) for x in torchtitan_rank_layers(layers, np.array(pp), np.array(v),
                                                                       np.array(sched.code), fallback))
                    if counts is None:
                        assert got == (-1, -1, -1), (layers, pp, v, name)
                        continue
                    assert got == tuple(schedules.split_rank_layers(sched, pp, v, counts)), (layers, pp, v, name, counts)
                    checked += 1
    assert checked > 300


def test_runtime_splits_follow_their_runtime():
    """fsdp2 follows torchtitan (ranks 0 / 7 / busiest: 15, 15, 16), luban keeps its own (16, 15, 16)."""
    layout = ParallelLayout(tp=8, pp=8, dp=2, sp=True, zero=1, schedule="interleaved-1f1b", virtual_stages=2,
                            micro_batch=1, precision="bf16")
    g = Grid.from_layout(layout)
    counts = torchtitan_counts(126, 16)
    sched = schedules.get("interleaved-1f1b")
    want = {"fsdp2": schedules.split_rank_layers(sched, 8, 2, counts)}
    problem = make_problem("llama-405b", gpus=128, seq=8192, batch=128, system="dgx-h100", runtime="luban")
    want["luban"] = tuple(int(x) for x in schedules.rank_layers(126, 8, 2, problem.derived["head_layers"], sched.code))
    for runtime, expected in want.items():
        problem = make_problem("llama-405b", gpus=128, seq=8192, batch=128, system="dgx-h100", runtime=runtime)
        assert tuple(int(x) for x in rank_layers(problem, g)) == tuple(expected), runtime
    assert want["fsdp2"] != want["luban"]
