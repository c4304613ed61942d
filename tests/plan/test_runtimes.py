"""Runtime models (luban.plan.runtimes): layout rules, byte accounting and overlap per mechanism."""

import json

import numpy as np
import torch
import pytest

from luban.cli import main
from luban.model.presets import get_preset
from luban.parallel.layout import PRECISIONS, ParallelLayout
from luban.plan import runtimes
from luban.plan.estimate import estimate
from luban.plan.grid import Grid
from luban.plan.memory import activation_bytes, rank_layers
from luban.plan.time import step_time
from luban.plan.memory import memory
from plan_helpers import make_problem

NARAYANAN = ["--model", "megatron-145.6b", "--gpus", "1536", "--global-batch", "1536", "--tp", "8", "--pp", "12",
             "--seq", "2048", "--system", "dgx-a100-80g", "--json"]


def test_megatron_ddp_with_tp_is_accepted_and_fsdp_runtimes_refuse_it(capsys):
    for rt in ("megatron", "megatron-core"):
        assert main(["plan", "estimate", *NARAYANAN, "--runtime", rt]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["layout"]["zero"] == 0 and out["layout"]["dp"] == 16 and out["step_time_s"] > 0
    for rt in ("fsdp2", "luban"):
        assert main(["plan", "estimate", *NARAYANAN, "--runtime", rt]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("luban: error: --zero / parallel.zero = 0:") and "zero >= 1" in err[0]
    assert main(["plan", "estimate", *NARAYANAN, "--runtime", "deepspeed"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("luban: error: --runtime = 'deepspeed': one of megatron, megatron-core, fsdp2, luban, "
                   "megatron-deepspeed, composer-fsdp, pytorch, transformers")
    assert main(["plan", "estimate", *NARAYANAN, "--runtime", ""]) == 2  # empty is not the default
    assert capsys.readouterr().err.startswith("luban: error: --runtime = '':")


def test_search_under_megatron_rules_admits_ddp_with_tp(capsys):
    args = ["plan", "search", "--model", "megatron-18.4b", "--gpus", "64", "--global-batch", "64",
            "--system", "dgx-a100-80g", "--json"]
    out = {}
    for rt in ("megatron", "luban"):
        assert main([*args, "--runtime", rt]) == 0
        out[rt] = json.loads(capsys.readouterr().out)
    rule = "tp > 1 with dp*cp > 1 needs zero >= 1"
    assert out["luban"]["rejected"].get(rule, 0) > 0
    assert out["megatron"]["rejected"].get(rule, 0) == 0
    assert out["megatron"]["evaluated"] == out["luban"]["evaluated"]


@pytest.mark.parametrize("name,bf16,fp32", [
    ("megatron", (2, 2, 12), (4, 4, 8)),  # ZeRO Sec. 3.1: 2 + 2 + 12 bytes under mixed precision
    ("megatron-core", (2, 4, 12), (4, 4, 8)),  # fp32 main gradients under bf16
    ("fsdp2", (4, 4, 8), (4, 4, 8)),
    ("luban", (4, 4, 8), (4, 4, 8)),
])
def test_bytes_per_parameter(name, bf16, fp32):
    rt = runtimes.get(name)
    for precision, want in (("bf16", bf16), ("fp32", fp32)):
        got = tuple(float(x) for x in rt.param_bytes(2, np.array(PRECISIONS.index(precision))))
        assert got == want


def _grid(**kw):
    base = dict(dp=8, tp=8, pp=4, zero=1, precision="bf16", micro_batch=1)
    return Grid.from_layout(ParallelLayout(**{**base, **kw}))


def test_flash_attention_runtimes_save_no_scores():
    seq = 4096
    g = _grid(recompute="none")
    per = {rt: float(activation_bytes(make_problem("gpt3-175b", gpus=256, seq=seq, batch=256, runtime=rt), g)["none"])
           for rt in ("megatron", "megatron-core")}
    cfg = get_preset("gpt3-175b")
    scores = cfg.heads * seq * (2 * 2 + 1) / 8  # Korthikanti Table 2: 5as/t bytes per token
    masks = 2 * cfg.hidden  # the two dropout masks: the papers' runs had them, the preset has dropout 0
    assert cfg.dropout == 0
    assert per["megatron"] - per["megatron-core"] == pytest.approx(masks + scores - 4 * cfg.heads / 8)
    dropout = make_problem(cfg.replace(dropout=0.1), gpus=256, seq=seq, batch=256, runtime="megatron-core")
    assert float(activation_bytes(dropout, g)["none"]) - per["megatron-core"] == pytest.approx(masks)


def _time(rt, system="dgx-a100-80g", gpus=256, batch=256, **kw):
    problem = make_problem("gpt3-175b", gpus=gpus, seq=2048, batch=batch, runtime=rt, system=system)
    g = _grid(**kw)
    return step_time(problem, g, memory(problem, g))


def test_tp_overlap_needs_sequence_parallel_and_is_bounded_by_the_gemms():
    for sp in (False, True):
        old, new = _time("megatron", sp=sp), _time("megatron-core", sp=sp)
        if sp:
            assert float(new["parts"]["tp_comm"]) < float(old["parts"]["tp_comm"])
        else:
            assert float(new["parts"]["tp_comm"]) == pytest.approx(float(old["parts"]["tp_comm"]))
    # with NVLink 100x slower the GEMMs cannot hide it all
    slow = make_problem("gpt3-175b", gpus=256, seq=2048, batch=256, runtime="megatron-core",
                        system=__import__("luban.plan.system", fromlist=["load_system"]).load_system(
                            "dgx-a100-80g", ["nvlink_bandwidth=3e9"]))
    g = _grid(sp=True)
    assert float(step_time(slow, g, memory(slow, g))["parts"]["tp_comm"]) > 0


def test_pp_p2p_overlap_only_with_interleaving():
    for v, sched in ((1, "1f1b"), (2, "interleaved-1f1b")):
        old = _time("megatron", virtual_stages=v, schedule=sched)
        new = _time("megatron-core", virtual_stages=v, schedule=sched)
        if v == 1:
            assert float(new["parts"]["pp_p2p"]) == pytest.approx(float(old["parts"]["pp_p2p"]))
        else:
            assert float(new["parts"]["pp_p2p"]) < float(old["parts"]["pp_p2p"])


def test_dp_overlap_per_runtime_bounded_by_one_microbatch():
    # 8 micro-batches of 1: gradient reduction over InfiniBand dwarfs one micro-batch's backward
    for zero in (0, 1):
        r = {rt: _time(rt, batch=64, zero=zero) for rt in runtimes.RUNTIMES if rt not in ("fsdp2", "luban") or zero}
        assert float(r["megatron"]["dp_hidden"]) == 0.0  # the 2021 papers did not overlap
        hidden = float(r["megatron-core"]["dp_hidden"])
        F, B = float(r["megatron-core"]["F"]), float(r["megatron-core"]["B"])
        assert 0 < hidden <= F + B + 1e-12
        if zero:
            assert float(r["fsdp2"]["dp_hidden"]) > hidden  # FSDP2 prefetch overlaps across the whole step
            assert float(r["luban"]["dp_hidden"]) == 0.0  # as measured: ZeRO 1-2 reductions not hidden


def test_profiles_carry_no_runtime_overlap_constants():
    from luban.plan.system import SYSTEMS_DIR, load_system

    for path in SYSTEMS_DIR.glob("*.toml"):
        eff = load_system(path.stem).efficiency
        assert "dp_overlap" not in eff and "pp_overlap" not in eff, path


def test_estimate_api_checks_with_the_runtime_rules():
    cfg = get_preset("megatron-145.6b")
    layout = ParallelLayout(dp=16, tp=8, pp=12, zero=0)
    assert estimate(cfg, "dgx-a100-80g", layout, global_batch=1536, runtime="megatron").step_time_s > 0
    with pytest.raises(Exception, match="needs zero >= 1"):
        estimate(cfg, "dgx-a100-80g", layout, global_batch=1536, runtime="fsdp2")


def test_fp8_is_planned_not_run(capsys, tmp_path):
    from luban.errors import LubanError

    with pytest.raises(LubanError, match="parallel.precision = 'fp8': this runtime runs fp32, bf16, fp16"):
        ParallelLayout.from_dict({"precision": "fp8"})  # a training config's [parallel] precision = "fp8"
    base = ["plan", "estimate", "--model", "llama-8b", "--gpus", "8", "--global-batch", "64", "--precision", "fp8"]
    assert main([*base, "--runtime", "luban", "--system", "dgx-h100"]) == 2
    assert "this runtime runs fp32, bf16, fp16" in capsys.readouterr().err
    assert main([*base, "--runtime", "megatron-core", "--system", "dgx-a100-80g"]) == 2  # no fp8 peak on A100
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("luban: error: --precision / parallel.precision = 'fp8'")
    assert main([*base, "--runtime", "megatron-core", "--system", "dgx-h100", "--zero", "1"]) == 0


def _fp8_vs_bf16(rt):
    problem = make_problem("llama-70b", gpus=64, seq=8192, batch=128, runtime=rt, system="dgx-h100")
    out = {}
    for precision in ("bf16", "fp8"):
        g = _grid(dp=2, tp=4, pp=8, sp=True, precision=precision)
        mem = memory(problem, g)
        out[precision] = (mem, step_time(problem, g, mem), activation_bytes(problem, g))
    return problem, out


def test_fp8_transformer_engine_accounting():
    problem, out = _fp8_vs_bf16("megatron-core")
    cfg = problem.model
    (m16, t16, a16), (m8, t8, a8) = out["bf16"], out["fp8"]
    # GEMM inputs kept in fp8: QKV and MLP inputs (replicated, split by sp), out-proj and fc2 inputs
    saved = 2 * cfg.hidden / 4 + (cfg.q_dim + cfg.ffn_hidden) / 4
    assert float(a16["none"] - a8["none"]) == pytest.approx(saved)
    # master weights and optimizer in higher precision: unchanged
    for key in ("weights", "gradients", "optimizer"):
        assert float(m8["first"][key]) == float(m16["first"][key])
    # fp8 weight + transpose per linear parameter of the rank's layers, plus amax/scale state
    layers = float(rank_layers(problem, _grid(dp=2, tp=4, pp=8))[0])  # the runtime's split: 11 on rank 0
    assert layers >= 80 / 8
    extra = layers * (2.0 * problem.derived["layer_matmul_weights"] / 4 + 3 * runtimes.GEMMS_PER_LAYER * 4 * (1024 + 2))
    assert float(m8["first"]["other"] - m16["first"]["other"]) == pytest.approx(extra)
    assert float(t8["step"]) < float(t16["step"])


def test_fp8_torchao_keeps_bf16_activations_and_pays_the_casts(monkeypatch):
    _, out = _fp8_vs_bf16("fsdp2")
    (m16, t16, a16), (m8, t8, a8) = out["bf16"], out["fp8"]
    # the same activations; the gathered weights (``memory.fsdp_transients``, prefetch) are in the dtype
    # FSDP2 gathered (2026-11-28: ``gather_bytes``), fp8 for the linear layers with torchao's fp8 all-gather
    assert float(a8["none"]) == float(a16["none"]) and float(m8["total"]) < float(m16["total"])
    problem = make_problem("llama-70b", gpus=64, seq=8192, batch=128, runtime="fsdp2", system="dgx-h100")
    g8 = _grid(dp=2, tp=4, pp=8, sp=True, precision="fp8")
    cast = float(runtimes.get("fsdp2").fp8_cast_bytes(problem, g8))
    assert cast == 2 * float(runtimes.get("megatron-core").fp8_cast_bytes(problem, g8)) > 0
    # the amax + cast passes cost exactly their HBM traffic in the forward of every layer and micro-batch
    mem = memory(problem, g8)
    with_casts = float(step_time(problem, g8, mem)["parts"]["forward"])
    monkeypatch.setattr(runtimes.FSDP2, "fp8_cast_passes", 0)
    without = float(step_time(problem, g8, mem)["parts"]["forward"])
    s = problem.system
    tokens = 1 * problem.seq  # micro-batch 1, no cp
    expected = float(mem["microbatches"]) * float(rank_layers(problem, g8)[2]) * cast * tokens / (
        s.hbm_bandwidth * s.efficiency["hbm_efficiency"])
    assert with_casts - without == pytest.approx(expected, rel=1e-9) and expected > 0
    # and the fp8 GEMMs themselves are faster than bf16 ones: without the casts fp8's forward is shorter
    assert without < float(t16["parts"]["forward"])


def test_attention_matmul_applies_only_to_causal_skipping_runtimes():
    from luban.plan.system import load_system

    steps = {}
    for rt in runtimes.RUNTIMES:
        for share in (1.0, 0.5):
            system = load_system("dgx-h100", [f"efficiency.attention_matmul={share}"])
            problem = make_problem("llama-8b", gpus=8, seq=32768, batch=8, runtime=rt, system=system)
            g = _grid(dp=2, tp=4, pp=1, zero=1, sp=True)
            steps[rt, share] = float(step_time(problem, g, memory(problem, g))["parts"]["forward"])
    for rt in runtimes.RUNTIMES:
        if runtimes.get(rt).skips_causal(problem):
            assert steps[rt, 0.5] > steps[rt, 1.0]
        else:
            assert steps[rt, 0.5] == steps[rt, 1.0]
    # luban: SDPA's flash kernel on a GPU profile (its CPU math path never skips: causal_skip False)
    assert {rt for rt in runtimes.RUNTIMES if runtimes.get(rt).skips_causal(problem)} == {
        "megatron-core", "fsdp2", "luban", "composer-fsdp", "pytorch", "transformers"}


def test_fa3_attention_speeds_up_only_causal_kernels_on_hopper():
    """``--attention-kernel``: an FA3-class kernel is the profile's FA2-class share times its cited
    speedup (FlashAttention-3's 1.5-2.0x midpoint on H100); A100 profiles have none (x1)."""
    from luban.plan.time import attention_share

    forward = {}
    for system in ("dgx-h100", "dgx-a100-80g"):
        for rt in runtimes.RUNTIMES:
            for kernel in ("fa2", "fa3"):
                problem = make_problem("llama-8b", gpus=8, seq=32768, batch=8, runtime=rt, system=system)
                problem.attention_kernel = kernel
                g = _grid(dp=2, tp=4, pp=1, zero=1, sp=True)
                forward[system, rt, kernel] = float(step_time(problem, g, memory(problem, g))["parts"]["forward"])
                if kernel == "fa3" and system == "dgx-h100":
                    eff = problem.system.efficiency
                    assert attention_share(problem) == pytest.approx(eff["attention_matmul"] * 1.75)
    for rt in runtimes.RUNTIMES:
        skips = runtimes.get(rt).skips_causal(problem)
        assert (forward["dgx-h100", rt, "fa3"] < forward["dgx-h100", rt, "fa2"]) == skips, rt
        assert forward["dgx-a100-80g", rt, "fa3"] == forward["dgx-a100-80g", rt, "fa2"], rt



def test_transformers_under_compile_computes_every_block_of_the_scores():
    """``transformers`` compiled hands SDPA an explicit causal mask (``masks_attention``): a fused
    kernel that skips nothing, so its attention costs the full s x s FLOPs at the FA2-class share:
    the causal kernel's attention time once more, forward and backward; eager (is_causal) and the
    plain ``pytorch`` loop compiled skip the masked half."""
    from luban.plan import time as ptime

    g = _grid(dp=1, tp=1, pp=1, zero=0, micro_batch=8)
    steps = {}
    for rt in ("pytorch", "transformers"):
        for compiled in (False, True):
            problem = make_problem("llama-1b", gpus=1, seq=4096, batch=8, runtime=rt, system="dgx-h100")
            problem.attention_kernel, problem.compiled = "fa2", compiled
            steps[rt, compiled] = float(step_time(problem, g, memory(problem, g))["step"])
            assert runtimes.get(rt).masks_attention(problem) == (rt == "transformers" and compiled)
    d, eff = problem.derived, problem.system.efficiency
    causal = 8 * 4096 * d["causal_attention_flops"]  # one micro-batch, forward
    assert d["attention_flops"] == pytest.approx(2 * d["causal_attention_flops"], rel=0.01)
    one = ptime.compute_seconds(problem, causal, causal / 2, problem.system.peak("bf16") * eff["attention_matmul"])
    # forward + backward (2x) of every layer: the scores' other half once more
    assert steps["transformers", True] - steps["pytorch", True] == pytest.approx(3 * problem.model.layers * one, rel=0.02)
    assert steps["transformers", False] == steps["pytorch", False]  # Llama: SiLU, no extra kernels


def test_gelu_new_passes_are_counted_from_transformers_code():
    """``GELU_NEW_EXTRA_PASSES`` is what transformers' NewGELUActivation (GPT-2's ``gelu_new``) moves
    forward + backward beyond ATen's fused GELU, counted op by op (bytes read and written over one
    [tokens, ffn] tensor's); the planner charges it to eager GPT-2 under ``transformers`` only."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from transformers.activations import NewGELUActivation

    class Traffic(TorchDispatchMode):
        moved = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func not in (torch.ops.aten.detach.default, torch.ops.aten.ones_like.default):  # views, the seed
                tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor) and t.numel() > 1]
                self.moved += sum(t.numel() * t.element_size() for t in tensors)
            return out

    passes = {}
    for name, fn in (("gelu_new", NewGELUActivation()), ("aten", lambda x: torch.nn.functional.gelu(x, approximate="tanh"))):
        x = torch.randn(256, 64, dtype=torch.bfloat16, requires_grad=True)
        with Traffic() as t:
            fn(x).backward(torch.ones_like(x))
        passes[name] = t.moved / (x.numel() * x.element_size())
    assert passes["gelu_new"] - passes["aten"] == runtimes.GELU_NEW_EXTRA_PASSES == 41
    g = _grid(dp=1, tp=1, pp=1, zero=0, micro_batch=16)
    steps = {}
    for rt in ("pytorch", "transformers"):
        for compiled in (False, True):
            problem = make_problem("gpt2-124m", gpus=1, seq=1024, batch=16, runtime=rt, system="dgx-h100")
            problem.compiled = compiled
            steps[rt, compiled] = float(step_time(problem, g, memory(problem, g))["step"])
    cfg, s = problem.model, problem.system
    extra = 41 * cfg.layers * 16 * 1024 * cfg.ffn_hidden * 2 / (s.hbm_bandwidth * s.efficiency["hbm_efficiency"])
    assert steps["transformers", False] - steps["pytorch", False] == pytest.approx(extra, rel=0.01)
    assert steps["transformers", True] > steps["pytorch", True]  # compiled: the GELU fuses, the mask stays


def test_the_planner_knows_where_luban_casts_with_fsdp2():
    """``luban_fsdp_casts`` (arrays) is ``uses_fsdp`` (one layout) in a precision whose FSDP2 casts the
    parameters (``luban.parallel.precision.fsdp_casts``): 2026-11-27 ``offload = params`` became FSDP2 on
    any dp·cp (it did nothing without data parallel); 2026-11-28 fp16 under FSDP2 gathers the fp32
    weights and runs autocast (``FSDP_PARAM_DTYPE``), so only bf16 casts: fp16's residual stream is fp32
    again and its autocast weight copies are saved."""
    import itertools

    from luban.parallel.data_parallel import uses_fsdp
    from luban.parallel.layout import ParallelLayout
    from luban.parallel.layout import fsdp_casts
    from luban.plan.grid import Grid
    from luban.plan.runtimes import luban_fsdp_casts, luban_residual_bytes

    for dp, cp, zero, offload, precision in itertools.product((1, 2), (1, 2), (0, 1, 3), ("none", "params"),
                                                              ("bf16", "fp16", "fp32")):
        layout = ParallelLayout(dp=dp, cp=cp, zero=zero, offload=offload, precision=precision)
        expected = uses_fsdp(layout) and fsdp_casts(layout.precision)
        g = Grid.from_layout(layout)
        assert bool(luban_fsdp_casts(g)) == expected, layout
        assert float(luban_residual_bytes(g)) == (2.0 if expected else 4.0), layout
    assert not fsdp_casts("fp16") and fsdp_casts("bf16")  # fp16 sharded by FSDP2 is one of the cases above
