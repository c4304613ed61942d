"""Kernel efficiency as a property of the runtime (luban.plan.runtimes): eager vs compiled
elementwise traffic, FSDP's 16-bit gathers, torchtitan's op-level selective checkpointing,
luban's causal attention on a GPU."""

import numpy as np
import pytest

from luban.model.presets import get_preset
from luban.parallel.layout import ParallelLayout
from luban.plan import runtimes
from luban.plan.estimate import Estimate, evaluate
from luban.plan.grid import Grid
from luban.plan.problem import Problem
from luban.plan.system import load_system


def _step(runtime="fsdp2", compiled=None, system="dgx-h100", model="llama-1b", gpus=1, zero=0, recompute="none",
          precision="bf16", **kw):
    cfg = get_preset(model) if isinstance(model, str) else model
    problem = Problem(cfg, load_system(system), gpus, 1024, 8 * gpus, runtime=runtime,
                      compiled=compiled, **kw)
    g = Grid.from_layout(ParallelLayout(dp=gpus, zero=zero, precision=precision, micro_batch=8, recompute=recompute))
    return Estimate.from_results(problem, g, evaluate(problem, g))


def test_eager_runtimes_move_more_elementwise_bytes_than_compiled_ones():
    eager, blocks, whole = (_step(compiled=c).step_time_s for c in (False, "blocks", True))
    assert eager > blocks > whole
    # fused runtimes (Megatron's kernels) ignore the switch; so does any runtime on a CPU profile
    assert _step("megatron-core", False).step_time_s == _step("megatron-core", True).step_time_s
    problem = Problem(get_preset("tiny"), load_system("dgx-h100"), 1, 64, 1, runtime="fsdp2", compiled=False)
    assert runtimes.get("fsdp2").traffic_scale(problem) == runtimes.EAGER_TRAFFIC
    cpu = load_system("dgx-h100").to_dict()
    from luban.plan.system import CPU_KEYS, System
    cpu["cpu"] = {k: 1.0 for k in CPU_KEYS}
    problem.system = System.from_dict(cpu)
    assert runtimes.get("fsdp2").traffic_scale(problem) == 1.0


def test_luban_is_compiled_by_default_on_a_gpu_and_eager_when_off():
    assert runtimes.get("luban").compiled(Problem(get_preset("tiny"), load_system("dgx-h100"), 1, 64, 1, runtime="luban"))
    assert _step("luban").step_time_s == _step("luban", True).step_time_s < _step("luban", False).step_time_s
    with pytest.raises(Exception, match="--compile"):
        Problem(get_preset("tiny"), load_system("dgx-h100"), 1, 64, 1, runtime="luban", compiled="sometimes")


def test_fsdp_gathers_16_bit_weights_and_luban_only_in_bf16():
    """torchtitan's FSDP2 gathers bf16 weights; luban's gathers what its FSDP2 casts to, bf16 only
    (``luban.parallel.precision.FSDP_PARAM_DTYPE``), measured 2026-11-28 on 2 gloo ranks
    (tests/plan/test_fsdp_gather_measured.py: bf16 2.0 bytes per parameter, fp16 and fp32 4.0); the
    planner had charged luban 4 bytes in bf16 (``gather_half = False``, measured before 2026-11-21)."""
    fsdp2, luban = runtimes.get("fsdp2"), runtimes.get("luban")
    from luban.plan.grid import BF16, FP16, FP32
    assert float(fsdp2.gather_bytes(4.0, np.array(BF16))) == 2.0 and float(fsdp2.gather_bytes(4.0, np.array(FP32))) == 4.0
    assert float(luban.gather_bytes(4.0, np.array(BF16))) == 2.0
    assert float(luban.gather_bytes(4.0, np.array(FP16))) == 4.0 and float(luban.gather_bytes(4.0, np.array(FP32))) == 4.0
    # across nodes, zero 3: luban's bf16 gathers are cheaper than its fp16 ones (fp32 weights)
    bf16, fp16 = (_step("luban", True, gpus=64, zero=3, model="llama-8b", precision=p) for p in ("bf16", "fp16"))
    assert bf16.time_breakdown_s["dp_comm"] + bf16.dp_hidden_s < fp16.time_breakdown_s["dp_comm"] + fp16.dp_hidden_s


def test_fsdp_gathered_copies_are_in_the_gathered_dtype():
    """luban zero 2 over dp 2 keeps the gathered weights unsharded from forward to backward
    (``memory.fsdp_transients``): bf16 copies (2 bytes, what FSDP2 gathered) where fp16 keeps fp32 ones:
    half the parameters x 2 bytes more per rank (the planner had 4 bytes for both)."""
    from luban.plan.memory import memory

    problem = Problem(get_preset("llama-1b"), load_system("dgx-h100"), 2, 1024, 16, runtime="luban")
    other = {p: float(memory(problem, Grid.from_layout(ParallelLayout(dp=2, zero=2, precision=p, micro_batch=8)))["first"]["other"])
             for p in ("bf16", "fp16")}
    from luban.model import flops

    assert other["fp16"] - other["bf16"] == pytest.approx(flops.param_count(problem.model) / 2 * (4.0 - 2.0), rel=1e-6)


def test_torchtitan_fp8_gathers_the_linear_weights_in_fp8():
    """torchtitan's ``--float8.enable_fsdp_float8_all_gather`` (the Trainy rows ran it): an fp8 run's
    all-gathers move 1 byte per linear-layer weight and 2 for the rest (embedding, output, norms);
    bf16 runs and the runtimes without torchao's fp8 all-gather keep 2 bytes (luban: its 4)."""
    from luban.model import flops
    from luban.plan.grid import BF16, FP8

    cfg = get_preset("llama-8b")
    problem = Problem(cfg, load_system("hgx-h200"), 32, 8192, 64, runtime="fsdp2")
    linear = cfg.layers * problem.derived["layer_matmul_weights"] / flops.param_count(cfg)
    assert 0.8 < linear < 0.95  # Llama 3.1 8B: 7.0 of 8.0 B parameters are the layers' linear weights
    fsdp2 = runtimes.get("fsdp2")
    assert float(fsdp2.gather_bytes(4.0, np.array(FP8), problem)) == pytest.approx(linear + 2 * (1 - linear))
    assert float(fsdp2.gather_bytes(4.0, np.array(BF16), problem)) == 2.0
    for name, expected in (("composer-fsdp", 2.0), ("luban", 4.0)):
        assert float(runtimes.get(name).gather_bytes(4.0, np.array(FP8), problem)) == expected
    # fewer bytes, less communication at 32 GPUs over the network (whether any is exposed depends on
    # the compute that hides it)
    g = Grid.from_layout(ParallelLayout(dp=32, zero=3, precision="fp8", micro_batch=2, recompute="selective"))
    fp8 = Estimate.from_results(problem, g, evaluate(problem, g))
    saved = runtimes.FSDP2.fp8_gather
    try:
        runtimes.FSDP2.fp8_gather = False
        bf16_gathers = Estimate.from_results(problem, g, evaluate(problem, g))
    finally:
        runtimes.FSDP2.fp8_gather = saved
    def communication(e):
        return e.time_breakdown_s["dp_comm"] + e.dp_hidden_s

    assert communication(fp8) < communication(bf16_gathers)
    assert fp8.step_time_s <= bf16_gathers.step_time_s


def test_torchtitan_selective_recomputes_every_other_matmul():
    """Op-level SAC (fsdp2) recomputes the 2nd, 4th and 6th of a Llama block's seven GEMMs; Korthikanti's
    selective (megatron-core) only the attention core: fsdp2's selective costs more."""
    cfg = get_preset("llama-1b")
    h, q, kv, f = cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.ffn_hidden
    share = (h * kv + q * h + h * f) / (h * q + 2 * h * kv + q * h + 3 * h * f)
    assert 0.3 < share < 0.45
    titan = _step("fsdp2", True, recompute="selective").time_breakdown_s["recompute"]
    mcore = _step("megatron-core", None, recompute="selective").time_breakdown_s["recompute"]
    assert titan > 3 * mcore > 0


def test_luban_selective_recomputes_elementwise_work_only():
    """luban's op-level SAC saves every GEMM and the fused attention: its recompute costs a small
    share of full recompute's (no GEMM, no attention again), adds no hardware FLOPs, and keeps
    more than full but far less than no recompute."""
    none, sel, full = (_step("luban", True, recompute=r) for r in ("none", "selective", "full"))
    redo_sel, redo_full = (e.time_breakdown_s["recompute"] for e in (sel, full))
    assert 0 < redo_sel < 0.5 * redo_full  # llama-1b on an H100: the elementwise kernels are ~30% of a forward
    assert sel.hfu == sel.mfu and full.hfu > full.mfu
    acts = [e.activation_bytes_per_microbatch for e in (none, sel, full)]
    assert acts[2] < acts[1] < 0.8 * acts[0]


def test_luban_attention_skips_the_causal_half_on_a_gpu_only():
    luban = runtimes.get("luban")
    gpu = Problem(get_preset("tiny"), load_system("dgx-h100"), 1, 64, 1, runtime="luban")
    assert luban.skips_causal(gpu) and not runtimes.get("megatron").skips_causal(gpu)


def test_device_probe_runs_on_cpu_and_yields_a_profile():
    """``luban plan probe --device cuda``'s code path, run on the CPU at small sizes."""
    from luban.plan.probe_device import attention_flops, probe_device
    from luban.plan.system import System

    raw = probe_device("cpu", "dgx-h100", scale=1e-3, budget=0.01)
    system = System.from_dict(raw)
    eff = system.efficiency
    assert len(eff["matmul"]) == len(eff["matmul_size"]) and all(0 < e <= 1 for e in eff["matmul"])
    assert 0 < eff["attention_matmul"] <= 1 and eff["attention_fa3_speedup"] == 1.0
    assert eff["elementwise_traffic"] > 0 and system.hbm_bandwidth > 0 and system.host_link_bandwidth > 0
    assert eff["kernel_launch_s"] > 0
    assert 0 < eff["unaligned_gemm"] <= 1
    assert system.peak("bf16") == load_system("dgx-h100").peak("bf16")  # datasheet figures kept
    assert attention_flops(1, 1, 2, 1) == 3.5 * 4 * 4 / 2


def test_a_probed_kernel_launch_cost_paces_eager_runtimes_only():
    """``efficiency.kernel_launch_s`` (probed; 0 on the built-in profiles): an eager runtime's
    micro-batch takes at least its kernels x the launch cost; compiled layers and fused runtimes
    are not paced; the breakdown's ``host`` part holds what the GPU time does not cover."""
    slow_host = load_system("dgx-h100", ["efficiency.kernel_launch_s=1e-3"])

    def est(runtime, compiled):
        problem = Problem(get_preset("gpt2-124m"), slow_host, 1, 1024, 16, runtime=runtime, compiled=compiled)
        g = Grid.from_layout(ParallelLayout(precision="bf16", micro_batch=16))
        return Estimate.from_results(problem, g, evaluate(problem, g))

    from luban.plan.overhead import model_overhead_counts

    counts = model_overhead_counts(get_preset("gpt2-124m"))
    eager = est("luban", False)
    kernels = 12 * counts["layer_ops"] + counts["rest_ops"]
    busy = eager.step_time_s - eager.time_breakdown_s["host"] - eager.time_breakdown_s["optimizer"]
    assert eager.time_breakdown_s["host"] == pytest.approx(kernels * 1e-3 - busy, rel=1e-6)
    assert est("luban", True).time_breakdown_s["host"] == 0.0
    assert est("megatron-core", None).time_breakdown_s["host"] == 0.0
    assert _step("luban", False).time_breakdown_s["host"] == 0.0  # the built-in profile: not probed


def test_moe_token_permutation_is_charged_per_routed_copy(monkeypatch):
    """Dropless dispatch copies each token's k routed copies into expert order and back
    (``time.moe_permutation_bytes``): k·h·e bytes x 4 passes per MoE layer, after the router's
    scores (7 bytes per expert: logits read, fp32 probabilities and the routing map written);
    nothing for a dense model."""
    from luban.plan import time as plan_time

    moe = Problem(get_preset("tiny-moe"), load_system("dgx-h100"), 1, 128, 8, runtime="megatron-core")
    cfg = moe.model
    assert plan_time.moe_permutation_bytes(moe, 2.0) == pytest.approx(
        moe.derived["moe_share"] * (4 * cfg.experts_per_token * cfg.hidden * 2.0 + 7 * cfg.experts))
    dense = Problem(get_preset("tiny-llama"), load_system("dgx-h100"), 1, 128, 8, runtime="megatron-core")
    assert plan_time.moe_permutation_bytes(dense, 2.0) == 0.0
    g = Grid.from_layout(ParallelLayout(precision="bf16", micro_batch=8))
    with_perm = evaluate(moe, g)["time"]["parts"]["forward"]
    monkeypatch.setattr(plan_time, "PERMUTE_PASSES", 0)
    assert float(evaluate(moe, g)["time"]["parts"]["forward"]) < float(with_perm)


def test_an_unaligned_vocabulary_costs_one_head_gemm_on_the_generic_kernel():
    """GPT-2's 50,257-wide head: one of its three GEMMs a micro-batch runs at ``unaligned_gemm`` of
    the peak (issue #22's H100 profile) unless the runtime pads the vocabulary or Inductor compiles
    the head; an aligned vocabulary, a profile without the figure and fp32 pay nothing."""
    from luban.plan import time as plan_time

    def step(runtime="pytorch", compiled=False, vocab=50257, system="dgx-h100", **kw):
        return _step(runtime, compiled, system=system, model=get_preset("gpt2-124m").replace(vocab=vocab), **kw)

    gpt2 = get_preset("gpt2-124m")
    h100 = load_system("dgx-h100")
    share = h100.efficiency["unaligned_gemm"]
    assert 0 < share < h100.matmul_efficiency(1e12)
    # the extra time is one head GEMM at the generic kernel's rate minus the same GEMM on the curve
    problem = Problem(gpt2, h100, 1, 1024, 8, runtime="pytorch", compiled=False)
    g = Grid.from_layout(ParallelLayout(precision="bf16", micro_batch=8))
    tokens = 8 * 1024
    one = tokens * 2 * gpt2.hidden * gpt2.vocab
    peak = h100.peak("bf16")
    expected = one / (peak * share) - one / (peak * h100.matmul_efficiency(one))
    assert float(plan_time.unaligned_head_seconds(problem, g, tokens, peak)) == pytest.approx(expected)
    slow, aligned = step(), step(vocab=50304)
    assert slow.step_time_s - aligned.step_time_s > 0.9 * expected
    # what pads it: the runtime (luban today, megatron), Inductor (head compiled), or the problem
    assert step(compiled=True).step_time_s < step(compiled=True, vocab=50304).step_time_s + 0.1 * expected
    assert step("pytorch", pads_vocab=True).step_time_s < step("pytorch", pads_vocab=True, vocab=50304).step_time_s + 0.1 * expected
    for runtime in ("luban", "megatron-core"):
        problem = Problem(gpt2, h100, 1, 1024, 8, runtime=runtime, compiled=False)
        assert float(plan_time.unaligned_head_seconds(problem, g, tokens, peak)) == 0.0
    problem = Problem(gpt2, h100, 1, 1024, 8, runtime="luban", compiled=False, pads_vocab=False)  # main 3457f4b
    assert float(plan_time.unaligned_head_seconds(problem, g, tokens, peak)) == pytest.approx(expected)
    # luban pads only its fused head and loss: under tensor parallel (vocab-parallel head, 50,257 / 2
    # per rank) and on a pipeline's last stage the model's width stays
    luban = Problem(gpt2, h100, 2, 1024, 8, runtime="luban", compiled=False)
    tp2 = Grid.from_layout(ParallelLayout(tp=2, precision="bf16", micro_batch=8))
    pp2 = Grid.from_layout(ParallelLayout(pp=2, precision="bf16", micro_batch=8))
    assert float(plan_time.unaligned_head_seconds(luban, tp2, tokens, peak)) > 0
    assert float(plan_time.unaligned_head_seconds(luban, pp2, tokens, peak)) == pytest.approx(expected)
    what_if = Problem(gpt2, h100, 2, 1024, 8, runtime="luban", compiled=False, pads_vocab=True)  # --pad-vocab on
    assert float(plan_time.unaligned_head_seconds(what_if, pp2, tokens, peak)) == 0.0
    # fp32 GEMMs and profiles without the measured figure: nothing added
    fp32 = Grid.from_layout(ParallelLayout(precision="fp32", micro_batch=8))
    problem = Problem(gpt2, h100, 1, 1024, 8, runtime="pytorch", compiled=False)
    assert float(plan_time.unaligned_head_seconds(problem, fp32, tokens, peak)) == 0.0
    a100 = Problem(gpt2, load_system("dgx-a100-80g"), 1, 1024, 8, runtime="pytorch", compiled=False)
    assert float(plan_time.unaligned_head_seconds(a100, g, tokens, peak)) == 0.0
    with pytest.raises(Exception, match="--pad-vocab"):
        Problem(gpt2, h100, 1, 1024, 8, pads_vocab="yes")


def test_unaligned_gemm_share_is_the_curve_when_nothing_is_lost_and_lower_when_time_is(monkeypatch):
    """The probe's figure charges one head GEMM the measured difference between the odd and the
    aligned vocabulary: equal per-column times give the curve (no penalty in the planner); a
    measured extra second gives the share at which one GEMM takes that second more."""
    from luban.plan import probe_device as pd

    tokens, hidden, vocab = 16, 8, 1001
    flops = 2.0 * tokens * hidden * vocab
    per_column = {1001: 1.0, 1024: 1.0 * 1024 / 1001}  # seconds of the three GEMMs, by width
    calls = []

    def fake_timed(fn, device, budget):
        calls.append(1)
        width = len(calls) <= 3 and vocab or 1024
        return per_column[width] / 3
    monkeypatch.setattr(pd, "_timed", fake_timed)
    curve = lambda f: 0.5  # noqa: E731
    assert pd.unaligned_gemm_share("cpu", 1e9, curve, tokens, hidden, vocab) == pytest.approx(0.5)
    calls.clear()
    per_column[1001] = 1.0 + 1.0  # one second more at the odd width
    share = pd.unaligned_gemm_share("cpu", 1e9, curve, tokens, hidden, vocab)
    assert flops / (1e9 * share) - flops / (1e9 * 0.5) == pytest.approx(1.0)
