"""Property tests: monotonicity the model must respect whatever the layout."""

import dataclasses

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from luban.errors import LubanError
from luban.model.presets import get_preset
from luban.parallel.layout import ParallelLayout, check_layout
from luban.plan.estimate import estimate

MODEL = get_preset("megatron-22b")
SEQ = 2048

layouts = st.builds(
    ParallelLayout, dp=st.sampled_from([1, 2, 4]), zero=st.sampled_from([1, 2, 3]), tp=st.sampled_from([1, 2, 4, 8]),
    sp=st.booleans(), pp=st.sampled_from([1, 2, 4]), schedule=st.sampled_from(["1f1b", "gpipe"]),
    cp=st.sampled_from([1, 2]), micro_batch=st.sampled_from([1, 2]), recompute=st.sampled_from(["none", "selective", "full"]),
    precision=st.sampled_from(["bf16", "fp32"]))


def valid(layout: ParallelLayout, batch: int = 64) -> bool:
    try:
        check_layout(layout, MODEL, batch, layout.world_size, SEQ)
        return True
    except LubanError:
        return False


def est(layout, batch=64, **kw):
    return estimate(MODEL, "dgx-a100-80g", layout, global_batch=batch, seq=SEQ, **kw)


@settings(max_examples=40, deadline=None)
@given(layouts)
def test_more_zero_sharding_never_raises_model_state_memory(layout):
    assume(valid(layout) and layout.zero < 3)
    def states(e):
        return e.memory_bytes["weights"] + e.memory_bytes["gradients"] + e.memory_bytes["optimizer"]
    assert states(est(layout.replace(zero=layout.zero + 1))) <= states(est(layout))


@settings(max_examples=40, deadline=None)
@given(layouts)
def test_recompute_never_raises_activation_memory(layout):
    assume(valid(layout))
    per_mb = [est(layout.replace(recompute=r)).activation_bytes_per_microbatch for r in ("none", "selective", "full")]
    assert per_mb[0] >= per_mb[1] >= per_mb[2]
    peaks = [est(layout.replace(recompute=r)).memory_bytes["activations"] for r in ("none", "selective", "full")]
    assert peaks[0] >= peaks[1] >= peaks[2]


@settings(max_examples=30, deadline=None)
@given(layouts)
def test_more_gpus_at_fixed_shape_never_slows_per_gpu_compute(layout):
    assume(valid(layout) and valid(layout.replace(dp=layout.dp * 2)))
    def compute(e):
        return sum(e.time_breakdown_s[k] for k in ("forward", "backward", "recompute"))
    assert compute(est(layout.replace(dp=layout.dp * 2))) <= compute(est(layout))


@settings(max_examples=30, deadline=None)
@given(layouts)
def test_larger_batch_never_lowers_throughput_and_mfu_le_hfu_le_1(layout):
    assume(valid(layout) and valid(layout, 128))
    small, big = est(layout), est(layout, batch=128)
    assert big.tokens_per_s >= small.tokens_per_s * (1 - 1e-9)
    assert small.mfu <= small.hfu <= 1.0


@settings(max_examples=30, deadline=None)
@given(layouts, st.sampled_from(["megatron", "luban"]))
def test_memory_parts_add_up_and_are_positive(layout, runtime):
    assume(valid(layout))
    e = est(layout, runtime=runtime)
    parts = {k: v for k, v in e.memory_bytes.items() if k != "total"}
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == e.memory_bytes["total"] or abs(sum(parts.values()) - e.memory_bytes["total"]) < 1
    assert dataclasses.asdict(e)["fits"] == (e.memory_bytes["total"] <= e.hbm_bytes and e.extra["fits_host"])
