"""The layout rules luban.parallel added to ``check_layout`` (what the PyTorch mechanisms need)."""

from __future__ import annotations

import pytest

from luban.errors import LubanError
from luban.model.presets import get_preset
from luban.parallel.layout import ParallelLayout, check_layout
from luban.parallel.pipeline import split_layers
from luban.parallel.schedules import get

CFG = get_preset("tiny").replace(seq_len=32)


def check(**layout):
    check_layout(ParallelLayout(**layout), CFG, global_batch=16)


def test_tensor_parallel_with_data_parallel_needs_fsdp():
    with pytest.raises(LubanError, match=r"needs zero >= 1.*nearest: zero = 1"):
        check(tp=2, dp=2)
    with pytest.raises(LubanError, match="needs zero >= 1"):
        check(tp=2, cp=2)
    check(tp=2, dp=2, zero=1)
    check(tp=2, pp=2)  # no data parallel: nothing to reduce


@pytest.mark.parametrize("schedule", ["zero-bubble", "dualpipev"])
def test_split_backward_schedules_allow_context_parallel(schedule):
    """The ring shift's backward always lies on the input-gradient path (numerics: test_layouts)."""
    check(pp=2, cp=2, zero=1, schedule=schedule, virtual_stages=2)
    check(pp=2, cp=2, zero=2, schedule=schedule, virtual_stages=2)
    with pytest.raises(LubanError, match="nearest: zero = 1"):  # DDP over the cp ranks
        check(pp=2, cp=2, schedule=schedule, virtual_stages=2)


@pytest.mark.parametrize("schedule", ["zero-bubble", "dualpipev"])
def test_split_backward_schedules_allow_zero3(schedule):
    """The stages unshard before the input and weight passes (numerics: test_layouts)."""
    for layout in ({"dp": 2}, {"cp": 2}, {}):
        check(pp=2, zero=3, schedule=schedule, virtual_stages=2, **layout)


@pytest.mark.parametrize("schedule", ["zero-bubble", "dualpipev"])
def test_split_backward_schedules_need_fsdp_for_data_parallel(schedule):
    with pytest.raises(LubanError, match="nearest: zero = 1"):
        check(pp=2, dp=2, schedule=schedule, virtual_stages=2)
    check(pp=2, dp=2, zero=1, schedule=schedule, virtual_stages=2)


def test_context_parallel_needs_no_attention_dropout():
    with pytest.raises(LubanError, match="model.dropout"):
        check_layout(ParallelLayout(cp=2), CFG.replace(dropout=0.1), global_batch=16)


def test_bucket_size_is_a_layout_key():
    assert ParallelLayout.from_dict({"bucket_mb": 50}).bucket_mb == 50


def test_integer_keys_are_bounded():
    """A hostile sweep, 2026-11-27: bucket_mb = 2**63 - 1 passed and crashed every rank in DDP (bytes
    overflow a C int64, a traceback per rank); dp = 10**12 with dp_replicate = 7 hung the launcher
    listing dp's divisors for its 'nearest' hint (a SIGTERM did not end it)."""
    for key, value in (("bucket_mb", 2**63 - 1), ("dp", 10**12), ("micro_batch", 10**12 + 7)):
        with pytest.raises(LubanError, match=rf"parallel.{key} = {value}: at most 16,777,216"):
            ParallelLayout.from_dict({key: value, "dp_replicate": 7})
    with pytest.raises(LubanError, match="nearest: \\[1, 16777213\\]"):  # a prime's divisors, at once
        ParallelLayout.from_dict({"dp": 16777213, "dp_replicate": 7})


def test_batch_hints_stay_within_the_allowed_global_batch():
    """The nearest-global_batch hint offered values above train.global_batch's maximum (2**20) and
    every divisor as a micro_batch (21 of them); now only allowed values, the three nearest."""
    from luban.parallel.layout import MAX_GLOBAL_BATCH

    def message(global_batch, **layout):
        with pytest.raises(LubanError) as err:
            check_layout(ParallelLayout(**layout), CFG, global_batch=global_batch)
        return str(err.value)

    assert message(MAX_GLOBAL_BATCH, micro_batch=3 << 19) == (
        "train.global_batch = 1048576: must be divisible by dp * micro_batch = 1572864; "
        "micro_batch in [262144, 524288, 1048576]")
    assert message(MAX_GLOBAL_BATCH, micro_batch=3).endswith(
        "nearest global_batch: [1048569, 1048572, 1048575], or micro_batch in [1, 2, 4]")
    assert message(MAX_GLOBAL_BATCH - 1, dp=2, zero=1, micro_batch=1 << 20).endswith(
        "dp * micro_batch = 2097152, at most 1,048,576: a smaller dp * micro_batch")
    assert message(10, micro_batch=4).endswith("nearest global_batch: [4, 8, 12], or micro_batch in [1, 2, 5]")


def test_auto_split_balances_cost_and_counts_the_head():
    big_head = CFG.replace(vocab=50000)  # LM head ~ several layers: the last stage gets fewer layers
    assert [len(r) for r in split_layers(big_head, 2)] == [3, 1]
    assert [len(r) for r in split_layers(CFG, 4)] == [1, 1, 1, 1]
    assert [list(r) for r in split_layers(CFG, 2, (1, 3))] == [[0], [1, 2, 3]]


def test_stage_placement():
    loop, v = get("zero-bubble"), get("dualpipev")  # torch's ScheduleInterleavedZeroBubble is loop-placed
    assert loop.stage_ids(0, 2, 2) == [0, 2] and loop.stage_ids(1, 2, 2) == [1, 3]
    assert v.stage_ids(0, 2, 2) == [0, 3] and v.stage_ids(1, 2, 2) == [1, 2]
    assert [v.rank_of(s, 2, 2) for s in range(4)] == [0, 1, 1, 0]
