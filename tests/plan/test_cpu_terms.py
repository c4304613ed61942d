"""The CPU terms of the time model (docs/planner.md, "CPU runs"): present, and scaling as
they should. No timings are asserted; the measured comparison is bench/plan_cpu_steptime.py."""

import json

import numpy as np
import pytest

from luban.errors import LubanError
from luban.model.presets import get_preset
from luban.parallel.layout import ParallelLayout
from luban.plan.grid import Grid
from luban.plan.memory import memory
from luban.plan import probe
from luban.plan.overhead import count_ops, model_overhead_counts, shrink
from luban.plan.problem import Problem
from luban.plan.system import System, load_system
from luban.plan.time import cpu_terms, dp_collective_counts, step_time, thread_slowdown

CPU = {"cores": 2, "threads": 1, "oversubscription_exponent": 1.0, "oversubscribed_stall_s": 1e-9, "op_overhead_s": 1e-5, "tensor_overhead_s": 2e-5,
       "reference_s": 0.1, "reference_one_thread_s": 0.2,
       "tp_op_overhead_s": 1e-4, "fsdp_group_overhead_s": 1e-3, "dtensor_tensor_overhead_s": 5e-5}


def cpu_system(**cpu) -> System:
    raw = json.loads(json.dumps(load_system("dgx-a100-80g").to_dict()))
    raw.update(name="probe-test", cpu={**CPU, **cpu})
    return System.from_dict(raw)


def step(model="tiny", gpus=1, layout=None, runtime="luban", **cpu):
    problem = Problem(get_preset(model), cpu_system(**cpu), gpus, 128, 16, runtime=runtime)
    g = Grid.from_layout(layout or ParallelLayout())
    return step_time(problem, g, memory(problem, g))


def test_op_counts_are_linear_in_layers_and_follow_the_architecture():
    cfg = get_preset("tiny")
    counts = model_overhead_counts(cfg)
    assert count_ops(shrink(cfg, 3)) == 3 * counts["layer_ops"] + counts["rest_ops"]
    llama = model_overhead_counts(get_preset("tiny-llama"))
    assert llama["layer_ops"] > counts["layer_ops"]  # RoPE, SwiGLU, GQA repeat
    assert (counts["layer_tensors"], llama["layer_tensors"]) == (16, 9)  # biases and LayerNorm vs none and RMSNorm


def test_moe_models_with_dense_layers_plan_on_a_cpu_profile():
    """The shrunk copies keep a MoE model's structure but not its leading dense layers (a 1-layer
    copy of tiny-moe's dense_layers = 1 was refused, so no MoE model with dense layers could be
    planned on a probed CPU profile); the per-layer count averages the MoE and dense layers."""
    moe = get_preset("tiny-moe")
    assert moe.dense_layers >= 1 and shrink(moe, 1).dense_layers == 0
    only_moe = model_overhead_counts(moe.replace(dense_layers=0))
    dense = model_overhead_counts(moe.replace(experts=0, dense_layers=0, shared_experts=0))
    assert only_moe["layer_ops"] > dense["layer_ops"]  # router, sort, per-expert loop
    mixed = model_overhead_counts(moe)
    assert mixed["layer_ops"] == pytest.approx((moe.moe_layers * only_moe["layer_ops"] + moe.dense_layers * dense["layer_ops"])
                                               / moe.layers)
    assert mixed["rest_ops"] == only_moe["rest_ops"]
    for name in ("tiny-moe", "deepseek-v3"):
        problem = Problem(get_preset(name), cpu_system(), 2, 128, 2, runtime="luban")
        g = Grid.from_layout(ParallelLayout(dp=2))
        assert np.isfinite(step_time(problem, g, memory(problem, g))["step"]).all()


@pytest.mark.parametrize("micro_batch", [1, 4])
def test_framework_overhead_is_ops_times_layers_times_microbatches(micro_batch):
    layout = ParallelLayout(micro_batch=micro_batch)
    base, more = step(layout=layout), step(layout=layout, op_overhead_s=3e-5)
    counts = model_overhead_counts(get_preset("tiny"))
    m = 16 // micro_batch
    extra = m * (4 * counts["layer_ops"] + counts["rest_ops"]) * 2e-5  # forward + backward
    assert float(more["step"] - base["step"]) == pytest.approx(extra)


def test_tensor_overhead_is_per_parameter_tensor_per_step():
    base, more = step(), step(tensor_overhead_s=1e-4)
    counts = model_overhead_counts(get_preset("tiny"))
    tensors = 4 * counts["layer_tensors"] + counts["rest_tensors"]
    assert float(more["parts"]["optimizer"] - base["parts"]["optimizer"]) == pytest.approx(tensors * 8e-5)
    for layout in (ParallelLayout(dp=2, zero=1), ParallelLayout(tp=2)):  # DTensor parameters
        base, more = step(gpus=2, layout=layout), step(gpus=2, layout=layout, dtensor_tensor_overhead_s=1e-4)
        assert float(more["parts"]["optimizer"] - base["parts"]["optimizer"]) > 0


def test_ranks_share_the_cores_and_contend_beyond_them():
    def terms(gpus, threads=2, gamma=1.0):
        problem = Problem(get_preset("tiny"), cpu_system(threads=threads, oversubscription_exponent=gamma), gpus,
                          128, 16, runtime="luban")
        got = cpu_terms(problem)
        return got["slow"], got["contend"]

    # 2 cores, probe process with 2 threads twice as fast as one (reference 0.1 s vs 0.2 s):
    # 1 rank keeps both threads, 2 ranks get one core each (kernels at half speed, overheads
    # unaffected), 4 ranks of one thread share 2 cores
    assert terms(1) == (1.0, 1.0) and terms(2) == (2.0, 1.0) and terms(4) == (4.0, 2.0)
    assert terms(1, threads=1) == (1.0, 1.0) and terms(4, threads=1) == (2.0, 2.0)
    assert terms(4, gamma=2.5) == pytest.approx((2 * 2**2.5, 2**2.5)) and terms(2, gamma=2.5) == (2.0, 1.0)
    one = step(gpus=2, layout=ParallelLayout(dp=2), threads=1)
    two = step(gpus=2, layout=ParallelLayout(dp=2), threads=2, op_overhead_s=1e-15)
    base = step(gpus=2, layout=ParallelLayout(dp=2), threads=1, op_overhead_s=1e-15)
    assert float(two["parts"]["forward"]) == pytest.approx(2 * float(base["parts"]["forward"]))
    assert float(one["parts"]["forward"] - base["parts"]["forward"]) > 0  # overheads, not slowed by threads


def test_tensor_parallel_ops_and_fsdp_groups_cost_their_measured_overheads():
    counts = model_overhead_counts(get_preset("tiny"))
    m, layers = 16 // 4, 4
    tp = ParallelLayout(tp=2, micro_batch=4)
    base, more = step(gpus=2, layout=tp), step(gpus=2, layout=tp, tp_op_overhead_s=2e-4)
    extra = m * (layers * counts["layer_ops"] + counts["rest_ops"]) * 1e-4  # forward + backward
    assert float(more["step"] - base["step"]) == pytest.approx(extra)
    assert float(step(gpus=2, layout=ParallelLayout(dp=2, micro_batch=4), op_overhead_s=1e-3)["step"]) > float(
        step(gpus=2, layout=ParallelLayout(dp=2, micro_batch=4))["step"])  # plain ops: op_overhead_s
    for zero in (1, 2, 3):  # (zero 3's may partly hide behind compute: the profile's zero3_overlap)
        dp = ParallelLayout(dp=2, zero=zero, micro_batch=4)
        base, more = step(gpus=2, layout=dp), step(gpus=2, layout=dp, fsdp_group_overhead_s=3e-3)
        per_rank = m // 2  # micro-batches of each dp rank
        hooks = per_rank * (layers + 1) * 2e-3
        assert float(more["dp_hidden"] - base["dp_hidden"]) + float(more["parts"]["dp_comm"] - base["parts"]["dp_comm"]) \
            == pytest.approx(hooks)
    ddp = ParallelLayout(dp=2, micro_batch=4)
    assert float(step(gpus=2, layout=ddp, fsdp_group_overhead_s=3e-3)["step"]) == float(step(gpus=2, layout=ddp)["step"])


def test_thread_scaling_follows_amdahl():
    cpu = {"threads": 4, "reference_s": 0.4, "reference_one_thread_s": 1.0}  # serial 0.2 s, parallel 0.8 s
    assert [thread_slowdown(cpu, t) for t in (4, 8)] == [1.0, 1.0]
    assert thread_slowdown(cpu, 2) == pytest.approx((0.2 + 0.4) / 0.4)
    assert thread_slowdown(cpu, 1) == pytest.approx(2.5)
    assert thread_slowdown({**cpu, "reference_one_thread_s": 0.4}, 1) == pytest.approx(1.0)  # no thread scaling


def test_probe_fits_the_oversubscription_exponent(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr("torch.get_num_threads", lambda: 1)
    alone = {"op_overhead_s": 1e-5, "tensor_overhead_s": 1e-5, "reference_s": 0.1, "reference_one_thread_s": 0.1}
    together = {**alone, "tp_op_overhead_s": 1e-4, "fsdp_group_overhead_s": 1e-3, "dtensor_tensor_overhead_s": 5e-5}
    cpu = probe.cpu_profile(alone, {**together, "reference_s": 0.8}, world=2)
    assert cpu["oversubscription_exponent"] == pytest.approx(3.0)  # 2 one-thread ranks on 1 core: 2^3 = 8
    assert probe.cpu_profile(alone, together, world=2)["oversubscription_exponent"] == 1.0  # never below a fair share
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr("torch.get_num_threads", lambda: 2)  # 2 ranks of 1 thread on 2 cores: no contention
    assert probe.cpu_profile(alone, {**together, "reference_s": 0.8}, world=2)["oversubscription_exponent"] == 1.0
    # measured with 4 one-thread processes on the 2 cores: 2^1.5 slower, 10 ms per all-reduce
    over = {"world": 4, "reference_s": 0.1 * 2**1.5, "all_reduce_s": 0.010}
    cpu = probe.cpu_profile(alone, together, world=2, over=over, latency=0.5e-3)
    assert cpu["oversubscription_exponent"] == pytest.approx(1.5)
    assert cpu["oversubscribed_stall_s"] == pytest.approx(0.010 / 6 - 0.5e-3)  # 2(n-1) ring steps
    System.from_dict({**json.loads(json.dumps(load_system("dgx-a100-80g").to_dict())), "cpu": cpu})


def test_collectives_wait_for_descheduled_peers_only_when_ranks_outnumber_cores():
    layout = ParallelLayout(dp=4, zero=2, micro_batch=2)
    base, more = step(gpus=4, layout=layout), step(gpus=4, layout=layout, oversubscribed_stall_s=1e-3)
    assert float(more["parts"]["dp_comm"]) > float(base["parts"]["dp_comm"]) + 20 * 3 * 1e-3 * 0.99  # 20 collectives, 3 steps
    two = ParallelLayout(dp=2, zero=2, micro_batch=4)
    assert float(step(gpus=2, layout=two, oversubscribed_stall_s=1e-3)["step"]) == float(step(gpus=2, layout=two)["step"])


def test_no_cpu_terms_on_gpu_profiles_or_for_megatron():
    gpu = Problem(get_preset("tiny"), load_system("dgx-a100-80g"), 4, 128, 16, runtime="luban")
    assert cpu_terms(gpu) == cpu_terms(Problem(get_preset("tiny"), cpu_system(), 4, 128, 16))
    assert cpu_terms(gpu)["slow"] == 1.0 and cpu_terms(gpu)["layer"] == 0.0


def test_luban_fsdp_issues_collectives_per_block_and_microbatch():
    problem = Problem(get_preset("tiny"), cpu_system(), 4, 128, 16, runtime="luban")
    m, n = np.array(2), np.array(4)
    for zero, gathers, reductions in ((1, 10, 5), (2, 10, 10), (3, 20, 10)):
        g = Grid.from_layout(ParallelLayout(dp=4, zero=zero, micro_batch=2))
        assert [int(x) for x in dp_collective_counts(problem, g, m, n)] == [gathers, reductions, 5]
    megatron = Problem(get_preset("tiny"), cpu_system(), 4, 128, 16)
    g = Grid.from_layout(ParallelLayout(dp=4, zero=2, micro_batch=2))
    assert [int(x) for x in dp_collective_counts(megatron, g, m, n)] == [1, 1, 1]


def test_bad_cpu_table_is_a_one_line_error():
    with pytest.raises(LubanError, match="cpu"):
        cpu_system(cores=0)
