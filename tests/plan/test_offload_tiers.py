"""The offload tier (seed 003 §3, seed 002): what moves to it, what the device keeps, and when
the link shows in the step time. Hand-derived from the no-offload estimate of the same layout."""

import pytest

from luban.model.presets import get_preset
from luban.parallel.layout import ParallelLayout
from luban.plan.estimate import estimate
from luban.plan.search import search
from luban.plan.problem import Problem
from luban.plan.system import GIB, load_system

MODEL = get_preset("gpt3-175b")
LAYOUT = dict(dp=16, zero=1, tp=8, sp=True, pp=8, micro_batch=1, precision="bf16")


def est(offload="none", sets=(), **layout):
    system = load_system("dgx-h100", list(sets))
    return estimate(MODEL, system, ParallelLayout(**{**LAYOUT, **layout, "offload": offload}), global_batch=1536,
                    runtime="megatron-core")


def layer_activation(e):
    return e.stages["first" if e.rank == 0 else "last"]["layer_activation"]


def test_activations_tier_keeps_two_layers_on_the_device_and_every_micro_batch_in_the_tier():
    plain, off = est(), est("activations", ["offload_gbps=inf"])
    assert plain.rank == off.rank
    per_mb = plain.activation_bytes_per_microbatch
    assert off.activation_bytes_per_microbatch == per_mb  # what autograd saves does not change
    assert off.memory_bytes["activations"] == pytest.approx(2 * layer_activation(off))
    assert off.host_bytes - plain.host_bytes == pytest.approx(plain.in_flight * per_mb)
    for kind in ("weights", "gradients", "optimizer"):
        assert off.memory_bytes[kind] == plain.memory_bytes[kind]
    # an unlimited link hides every transfer: the step is the no-offload step
    assert off.step_time_s == pytest.approx(plain.step_time_s)
    assert off.time_breakdown_s["offload"] == 0


def test_a_slow_link_is_exposed_and_a_faster_one_hides_more():
    times = [est("activations", [f"offload_gbps={gbps}"]).time_breakdown_s["offload"] for gbps in (5, 25, 100, 1000)]
    assert times[0] > times[1] > 0
    assert times == sorted(times, reverse=True) and times[-1] == 0


def test_blocks_tier_moves_all_model_state_and_streams_the_optimizer():
    plain, blocks = est(), est("blocks", ["offload_gbps=inf"])
    state = plain.memory_bytes["weights"] + plain.memory_bytes["gradients"] + plain.memory_bytes["optimizer"]
    assert blocks.memory_bytes["optimizer"] == 0
    assert blocks.memory_bytes["weights"] < plain.memory_bytes["weights"] / 4  # two layers of the rank's 12
    problem = Problem(MODEL, load_system("dgx-h100"), 1024, 2048, 1536, "megatron-core")
    wb, gb, _ = problem.runtime_model.param_bytes(problem.optimizer_states, 1)  # bf16 weights, fp32 main grads
    assert blocks.memory_bytes["gradients"] == pytest.approx(blocks.memory_bytes["weights"] * gb / wb)
    assert blocks.host_bytes == pytest.approx(plain.host_bytes + state + plain.in_flight
                                              * plain.activation_bytes_per_microbatch)
    slow = est("blocks", ["offload_gbps=50"])
    assert slow.time_breakdown_s["offload"] > 0  # the optimizer step streams every state through the link


def test_the_tier_is_what_lets_a_model_fit_when_hbm_is_small():
    """Seed 003 Fig. 8's mechanism: with HBM too small for any layout's states, offloading blocks
    to a large tier still finds one; without a tier, none fits."""
    model = get_preset("gpt3-175b")
    tiny_hbm = load_system("dgx-h100", ["hbm_gib=12", "offload_gib=2048", "offload_gbps=100"])
    problem = Problem(model, tiny_hbm, 64, 2048, 64, "megatron-core")
    without = search(problem, top=1, precision="bf16", offloads=(0,))
    with_tier = search(problem, top=1, precision="bf16")
    assert not without.best
    assert with_tier.best and with_tier.best[0].layout.offload in ("activations", "blocks")
    assert with_tier.best[0].memory_bytes["total"] <= 12 * GIB


def test_luban_runtime_never_plans_blocks():
    problem = Problem(get_preset("gpt2-124m"), load_system("dgx-h100"), 8, 1024, 64, "luban")
    result = search(problem, top=50, precision="bf16")
    assert result.best and all(e.layout.offload != "blocks" for e in result.best)
