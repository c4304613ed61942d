"""What-if systems: ``--system-set KEY=VALUE`` overrides any profile field."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from luban.errors import LubanError
from luban.parallel.layout import ParallelLayout
from luban.plan.estimate import estimate
from luban.plan.system import GIB, System, load_system

ROOT = Path(__file__).resolve().parents[2]


def luban(*args):
    return subprocess.run([sys.executable, "-m", "luban", "plan", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_overrides_in_convenient_units_and_by_field_name():
    s = load_system("dgx-h100", ["hbm_gib=120", "offload_gib=1024", "offload_gbps=100", "nvlink_domain=16",
                                 "gpus_per_node=4", "peak_tflops.bf16=1979", "peak_flops.fp16=1.5e15",
                                 "efficiency.zero3_overlap=0.5", "internode_bandwidth=1e11"])
    assert s.hbm_bytes == 120 * GIB and s.offload_bytes == 1024 * GIB and s.offload_bandwidth == 100e9
    assert s.nvlink_domain == 16 and isinstance(s.nvlink_domain, int) and s.gpus_per_node == 4
    assert s.peak("bf16") == 1979e12 and s.peak_flops["fp16"] == 1.5e15
    assert s.efficiency["zero3_overlap"] == 0.5 and s.internode_bandwidth == 1e11
    base = load_system("dgx-h100")
    assert base.hbm_bytes == 80 * GIB  # the profile itself is untouched


def test_unlimited_offload_tier():
    s = load_system("dgx-h100", ["offload_gib=inf", "offload_gbps=inf"])
    assert math.isinf(s.offload_bytes) and math.isinf(s.offload_bandwidth)


def test_optional_fields_default_from_the_others():
    raw = load_system("dgx-a100-80g").to_dict()
    for key in ("nvlink_domain", "offload_bytes", "offload_bandwidth"):
        raw.pop(key)
    raw["gpus_per_node"] = 4
    s = System.from_dict(raw)
    assert s.nvlink_domain == 4
    assert s.offload_bytes == raw["host_bytes"] / 4 and s.offload_bandwidth == raw["host_link_bandwidth"]


@pytest.mark.parametrize("item,match", [
    ("hbm_gb=80", "unknown key 'hbm_gb'"), ("peak_tflops.int4=1", "unknown key"),
    # (2026-12-04) a curve said "unknown key", efficiency.KEY advertised; a name said "a number"; float() read
    # "1_0" as 10 and Arabic-Indic digits as 80
    ("efficiency.matmul=1", "^--system-set efficiency.matmul = '1': a curve \\(a list of numbers by size\\)"),
    ("name=x", "^--system-set name = 'x': text, which --system-set does not set"),
    ("nvlink_domain=3", "nvlink_domain = 3: a divisor or a multiple of gpus_per_node = 8"),  # (2026-12-04: accepted)
    ("hbm_gib=1_0", "^--system-set hbm_gib = '1_0': a number"), ("hbm_gib=\u0668\u0660", "^--system-set hbm_gib = .*: a number"),
    ("hbm_gib", "KEY=VALUE"), ("hbm_gib=lots", "a number"), ("hbm_gib=-1", "a positive number"),
    ("offload_gbps=nan", "a positive number"), ("nvlink_domain=2.5", "^--system-set nvlink_domain = '2.5': an integer from 1 to 16777216$"),
    ("efficiency.pp_overlap=inf", "unknown key"), ("efficiency.hbm_efficiency=0", "a number >= 1e-09 and <= 1$"),
    # an integer, never "(inf for unlimited)" (it said so, then refused inf, 2026-12-04)
    ("nvlink_domain=inf", "^--system-set nvlink_domain = 'inf': an integer from 1 to 16777216$"),
    ("gpus_per_node=inf", "^--system-set gpus_per_node = 'inf': an integer from 1 to 16777216$"),
    ("gpus_per_node=0", "^--system-set gpus_per_node = '0': an integer from 1 to 16777216$"),
    ("nvlink_latency=-1", "^--system-set nvlink_latency = '-1': a positive number$"),
    ("framework_overhead_bytes=inf", "a number > 0 and <= 1e"), ("peak_tflops.bf16=inf", r"from 1e-12 to 1e\+12 \(TFLOP/s"),
    # what once overflowed into a traceback or printed inf / NaN (a hostile sweep, 2026-11-27)
    ("nvlink_domain=1e19", "an integer from 1 to 16777216"), ("nvlink_latency=1e308", "<= 3600"),
    ("nvlink_gbps=1e-300", "a number >= 1e-09 and"), ("peak_flops.bf16=1e-300", r"a number from 1 to 1e\+24"),
    ("peak_flops.bf16=1e308", r"a number from 1 to 1e\+24"), ("efficiency.elementwise_traffic=1e300", "<= 1000"),
    ("efficiency.hbm_efficiency=5", "a number >= 1e-09 and <= 1"),
])
def test_bad_overrides_are_one_line_errors(item, match):
    with pytest.raises(LubanError, match=match) as err:
        load_system("dgx-h100", [item])
    assert "\n" not in str(err.value)


def test_overrides_change_the_estimate():
    cfg_args = dict(global_batch=64, seq=2048)
    layout = ParallelLayout(dp=1, tp=8, pp=8, zero=1, precision="bf16", offload="optimizer",
                            schedule="interleaved-1f1b", virtual_stages=2, recompute="full")
    from luban.model.presets import get_preset

    cfg = get_preset("gpt3-175b")
    base = estimate(cfg, "dgx-h100", layout, **cfg_args)
    fast = estimate(cfg, load_system("dgx-h100", ["peak_tflops.bf16=1979"]), layout, **cfg_args)
    assert fast.time_breakdown_s["forward"] < base.time_breakdown_s["forward"]
    slow_link = estimate(cfg, load_system("dgx-h100", ["offload_gbps=5"]), layout, **cfg_args)
    assert slow_link.time_breakdown_s["offload"] == pytest.approx(10 * base.time_breakdown_s["offload"])
    small_tier = estimate(cfg, load_system("dgx-h100", ["offload_gib=1"]), layout, **cfg_args)
    assert base.fits and not small_tier.fits
    wide = estimate(cfg, load_system("dgx-h100", ["nvlink_domain=64"]), layout, **cfg_args)
    assert wide.time_breakdown_s["pp_p2p"] < base.time_breakdown_s["pp_p2p"]
    big = estimate(cfg, load_system("dgx-h100", ["hbm_gib=4"]), layout, **cfg_args)
    assert not big.fits


def test_cli_estimate_and_search_take_system_set():
    common = ("--model", "gpt3-175b", "--gpus", "64", "--global-batch", "64", "--system", "dgx-h100", "--json")
    r1 = luban("estimate", *common, "--tp", "8", "--pp", "8", "--zero", "1", "--recompute", "full")
    r2 = luban("estimate", *common, "--tp", "8", "--pp", "8", "--zero", "1", "--recompute", "full",
               "--system-set", "hbm_gib=40", "--system-set", "nvlink_domain=4")
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    a, b = json.loads(r1.stdout), json.loads(r2.stdout)
    assert a["fits"] and not b["fits"]
    assert b["time_breakdown_s"]["tp_comm"] > a["time_breakdown_s"]["tp_comm"]  # tp=8 now leaves the domain
    r = luban("search", *common, "--top", "1", "--system-set", "hbm_gib=1000")
    assert r.returncode == 0, r.stderr
    bad = luban("search", *common, "--system-set", "nvlink=16")
    assert bad.returncode == 2 and bad.stderr.startswith("luban: error: --system-set = 'nvlink=16': unknown key")
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


CPU_TERMS = {"cores": 2, "threads": 2, "oversubscription_exponent": 1.0, "oversubscribed_stall_s": 1e-9,
             "op_overhead_s": 1e-5, "tensor_overhead_s": 2e-5, "reference_s": 0.1, "reference_one_thread_s": 0.2,
             "tp_op_overhead_s": 1e-4, "fsdp_group_overhead_s": 1e-3, "dtensor_tensor_overhead_s": 5e-5}


def _profile(cpu=None, **efficiency) -> dict:
    raw = json.loads(json.dumps(load_system("dgx-h100").to_dict()))
    raw["efficiency"].update(efficiency)
    if cpu is not None:
        raw["cpu"] = {**CPU_TERMS, **cpu}
    return raw


@pytest.mark.parametrize("raw,match", [
    (_profile(matmul=[1e-300] * 6), r"efficiency.matmul = \[1e-300.*: a list of numbers, each >= 1e-09 and <= 1$"),
    (_profile(collective=[1e-300] * 6), r"efficiency.collective = .*each >= 1e-09"),
    (_profile(hbm_efficiency=1e-300), r"efficiency.hbm_efficiency = 1e-300: a number >= 1e-09 and <= 1$"),
    (_profile(attention_matmul=1e-300), r"efficiency.attention_matmul = 1e-300"),
    (_profile(fp8_matmul=1e-300), r"efficiency.fp8_matmul = 1e-300"),
    (_profile(attention_fa3_speedup=1e-300), r"efficiency.attention_fa3_speedup = 1e-300: a number >= 1e-09 and <= 100"),
    (_profile(unaligned_gemm=1e-300), r"efficiency.unaligned_gemm = 1e-300: 0 \(not measured\) or a number >= 1e-09"),
    (_profile(cpu={"reference_s": 1e-300, "reference_one_thread_s": 1e300, "threads": 4}),
     r"cpu.reference_s = 1e-300: a number >= 1e-09 and <= 3600 \(seconds\)$"),
    (_profile(cpu={"op_overhead_s": 1e300}), r"cpu.op_overhead_s = 1e\+300: a number > 0 and <= 3600 \(seconds\)$"),
    (_profile(cpu={"cores": 2.5}), r"cpu.cores = 2.5: a whole number > 0 and <= 16,777,216$"),
    ({**_profile(), "name": 5}, r"system.name = 5: non-empty UTF-8 text$"),
    ({**_profile(), "name": ""}, r"system.name = '': non-empty UTF-8 text$"),
    ({**_profile(), "description": ["x"]}, r"system.description = \['x'\]: text$"),
])
def test_profile_values_that_planned_nonsense_are_refused(raw, match):
    """A share of a peak or a link near 0 (efficiency 1e-300) planned a step of inf ms, then NaN, with
    numpy overflow warnings; a CPU profile's reference times of 1e-300 s and 1e300 s planned NaN and a
    per-op overhead of 1e300 s a 1e+300 ms step printed as valid; a name or description that was no
    text (5, a list, empty) was printed as is (a hostile sweep, 2026-11-27)."""
    with pytest.raises(LubanError, match=match) as err:
        System.from_dict(raw)
    assert "\n" not in str(err.value)


def test_a_profile_at_its_bounds_plans_finite_times():
    """The smallest shares, bandwidths and peaks a profile may hold, and the farthest-apart CPU
    reference times, still plan a finite, positive step (what the bounds above are for)."""
    import warnings

    from luban.model.presets import get_preset
    from luban.plan.system import MIN_SHARE

    slow = _profile(matmul=[MIN_SHARE] * 6, collective=[MIN_SHARE] * 6, hbm_efficiency=MIN_SHARE, fp8_matmul=MIN_SHARE,
                    attention_matmul=MIN_SHARE, attention_fa3_speedup=MIN_SHARE, unaligned_gemm=MIN_SHARE,
                    elementwise_traffic=1000)
    slow.update({k: 1.0 for k in ("hbm_bandwidth", "nvlink_bandwidth", "internode_bandwidth", "host_bandwidth",
                                  "host_link_bandwidth", "offload_bandwidth")},
                peak_flops={p: 1.0 for p in ("fp32", "bf16", "fp16", "fp8")})
    cpu = _profile(cpu={"threads": 4, "reference_s": 1e-9, "reference_one_thread_s": 3600.0,
                        **{k: 3600.0 for k in CPU_TERMS if k.endswith("_s") and not k.startswith("reference")}})
    layout = ParallelLayout(dp=2, tp=2, pp=2, zero=1, sp=True, recompute="full", precision="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow in numpy is a RuntimeWarning
        for raw, runtime in ((slow, "fsdp2"), (cpu, "luban")):  # (pytorch runs no zero = 1: one process)
            e = estimate(get_preset("llama-405b").replace(vocab=50257), System.from_dict(raw), layout, global_batch=8,
                         seq=8192, runtime=runtime)
            times = [e.step_time_s, *e.time_breakdown_s.values()]
            assert all(math.isfinite(t) and t >= 0 for t in times) and e.step_time_s > 0, e.time_breakdown_s


@pytest.mark.parametrize("item", ["hbm_gib=1e300", "hbm_gib=1e25", "offload_gbps=1e300"])
def test_an_override_beyond_its_field_in_convenient_units_is_refused(item):
    """hbm_gib=1e300 overflowed to inf bytes and was taken as "unlimited" (hbm_bytes=1e300 itself is
    refused), and hbm_gib=1e25 was refused as hbm_bytes = 1.07e+34 (a hostile sweep, 2026-11-27)."""
    name = item.partition("=")[0]
    with pytest.raises(LubanError, match=rf"^--system-set {name} = '[0-9e]+': a number >=? [0-9.e+-]+ and <= [0-9.e+]+ \(inf for unlimited\)$"):
        load_system("dgx-h100", [item])
    assert math.isinf(load_system("dgx-h100", ["hbm_gib=inf"]).hbm_bytes)  # what inf is for


def test_a_huge_profile_or_model_file_is_refused_unread(tmp_path):
    """A multi-GB file named as --system or --model (a checkpoint by mistake) was read whole into
    memory: seconds per GB, then a MemoryError traceback under a memory limit (a hostile sweep, 2026-11-27)."""
    from luban.plan.cli import load_model
    from luban.plan.system import MAX_FILE_BYTES

    big = tmp_path / "model.safetensors"
    with open(big, "wb") as f:
        f.truncate(4 * MAX_FILE_BYTES)  # sparse: no disk, no time
    for load, key in ((load_system, "--system"), (load_model, "--model")):
        with pytest.raises(LubanError, match=rf"^{key} = '.*model.safetensors': a file of at most 16,777,216 bytes"):
            load(str(big))


@pytest.mark.parametrize("item,field", [("efficiency.kernel_launch_s=0", "kernel_launch_s"),
                                        ("efficiency.elementwise_traffic=0", "elementwise_traffic"),
                                        ("efficiency.unaligned_gemm=0", "unaligned_gemm"),
                                        ("efficiency.zero3_overlap=0", "zero3_overlap")])
def test_an_override_may_set_what_a_profile_may_hold(item, field):
    """--system-set kept ranges of its own for efficiency.*: "a finite number > 0" refused kernel_launch_s=0 (the
    default: no host pacing), elementwise_traffic=0 (a CPU probe's fit) and unaligned_gemm=0 (not measured), all
    of which a profile file holds (a hostile sweep, 2026-11-27). It now takes the profile's own ranges."""
    assert load_system("dgx-h100", [item]).efficiency[field] == 0


@pytest.mark.parametrize("item,match", [
    ("hbm_gbps=1e-300", r"^--system-set hbm_gbps = '1e-300': a number >= 1e-09 and <= 1e\+21 \(inf for unlimited\)$"),
    ("peak_tflops.bf16=1e300", r"^--system-set peak_tflops.bf16 = '1e300': a number from 1e-12 to 1e\+12 \(TFLOP/s per GPU\)$"),
    ("peak_flops.fp8=-1", r"^--system-set peak_flops.fp8 = '-1': a number from 1 to 1e\+24 \(FLOP/s per GPU\)$"),
    ("efficiency.kernel_launch_s=5", r"^--system-set efficiency.kernel_launch_s = '5': a number >= 0 and <= 1$"),
])
def test_a_bad_override_is_named_as_typed(item, match):
    """hbm_gbps=1e-300 was refused as '--system-set.hbm_bandwidth = 1e-291' and peak_tflops.bf16=1e300 as the
    whole peak_flops table in FLOP/s: neither the key nor the value the user typed (a hostile sweep, 2026-11-27)."""
    with pytest.raises(LubanError, match=match):
        load_system("dgx-h100", [item])


def test_a_profile_files_own_fault_is_named_by_the_file_not_by_system_set(tmp_path):
    """A profile file with a key it should not have, loaded with any --system-set, was refused as
    '--system-set.bogus = 1: not a profile key': the user's override blamed for the file (a hostile sweep,
    2026-11-27)."""
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**load_system("dgx-h100").to_dict(), "bogus": 1}))
    with pytest.raises(LubanError, match=r"^mine\.json\.bogus = 1: not a profile key"):
        load_system(str(path), ["hbm_gbps=100"])


@pytest.mark.parametrize("raw", [_profile(zero3_overlap=10**400), _profile(cpu={"op_overhead_s": 10**400}),
                                 _profile(matmul=[10**400] * 6)])
def test_an_integer_beyond_a_float_in_a_profile_is_a_one_line_error(raw):
    """A JSON profile may hold an integer of hundreds of digits; an efficiency or [cpu] term of 10**400 was an
    OverflowError traceback in the range check (a hostile sweep, 2026-11-27)."""
    with pytest.raises(LubanError, match=r"= \[?1000000.*: a (list of numbers, each|number) >=? "):
        System.from_dict(raw)


def test_a_json_file_is_json_whatever_the_case_of_its_suffix(tmp_path):
    """``.JSON`` was read as TOML ("cannot parse") by the planner and written as TOML by probe."""
    import tomllib

    from luban.model.presets import get_preset
    from luban.plan.cli import load_model
    from luban.plan.probe import write_profile

    raw = tomllib.loads((ROOT / "luban/plan/systems/dgx-h100.toml").read_text())
    profile = tmp_path / "H100.JSON"
    write_profile(raw, profile)
    assert json.loads(profile.read_text())["name"] == raw["name"]
    assert load_system(str(profile)).hbm_bytes == load_system("dgx-h100").hbm_bytes
    model = tmp_path / "M.Json"
    model.write_text(json.dumps(get_preset("tiny").to_dict()))
    assert load_model(str(model)) == get_preset("tiny")
