"""Probe pieces, profile files and ``choose_layout``."""

import json

import pytest
import torch

from luban.errors import LubanError
from luban.model.presets import get_preset
from luban.parallel.layout import check_layout
from luban.plan import probe
from luban.plan.auto import choose_layout
from luban.plan.system import System, builtin_systems, load_system


def test_builtin_profiles_load():
    assert set(builtin_systems()) >= {"dgx-a100-80g", "dgx-a100-40g", "dgx-h100", "hgx-h200"}
    h100 = load_system("dgx-h100")
    assert h100.peak("bf16") > load_system("dgx-a100-80g").peak("bf16")


def test_measure_matmul_peak_is_positive_and_quick():
    assert probe.measure_matmul_peak(0.2) > 1e8


def test_fit_collectives_recovers_ring_model():
    bandwidth, latency = 2e9, 1e-4
    times = {"all-reduce": {m: 2 * latency + m / bandwidth for m in probe.MESSAGE_SIZES}}
    fit = probe.fit_collectives(times, world=2)
    assert fit["latency"] == pytest.approx(latency * (1 + probe.MESSAGE_SIZES[0] / bandwidth / (2 * latency)))
    assert fit["bandwidth"] == pytest.approx(probe.MESSAGE_SIZES[-1] / times["all-reduce"][probe.MESSAGE_SIZES[-1]])
    assert fit["efficiency"][-1] == 1.0


def fake_profile():
    p = json.loads(json.dumps(load_system("dgx-a100-80g").to_dict()))
    p.update(name="probe-test", peak_flops={"fp32": 5e10, "bf16": 1e9, "fp16": 1e9}, hbm_bytes=4e9, gpus_per_node=2,
             nvlink_domain=2, cpu={"cores": 2, "threads": 2, "oversubscription_exponent": 1.0, "oversubscribed_stall_s": 1e-9, "op_overhead_s": 1e-5,
                                   "tensor_overhead_s": 1e-5, "reference_s": 0.05, "reference_one_thread_s": 0.08,
                                   "tp_op_overhead_s": 1e-4, "fsdp_group_overhead_s": 1e-3, "dtensor_tensor_overhead_s": 5e-5})
    return p


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_profile_round_trip(tmp_path, suffix):
    path = probe.write_profile(fake_profile(), tmp_path / f"p{suffix}")
    assert load_system(path) == System.from_dict(fake_profile())


def test_bad_profile_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n')
    with pytest.raises(LubanError, match=r"^bad\.toml\.gpus_per_node = '\(missing\)': required"):
        load_system(bad)


def test_choose_layout_uses_the_cached_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("LUBAN_CACHE", str(tmp_path))
    probe.cache_path().parent.mkdir(parents=True, exist_ok=True)
    probe.cache_path().write_text(json.dumps(fake_profile()))
    cfg = get_preset("tiny")
    layout, est = choose_layout(cfg, 2, 16, 128)
    assert est.system == "probe-test" and layout.precision == "fp32" and est.runtime == "luban"
    check_layout(layout, cfg, 16, 2, 128)
    assert est.param_bytes > 0 and est.optimizer_bytes > 0 and est.activation_bytes_per_microbatch > 0
    assert est.step_time_s > 0


def test_choose_layout_on_a_gpu_profile_and_when_nothing_fits():
    layout, est = choose_layout(get_preset("llama-8b"), 16, 64, 4096, system="dgx-h100")
    assert layout.world_size == 16 and est.fits and layout.precision == "bf16"
    with pytest.raises(LubanError, match="no layout"):
        choose_layout(get_preset("llama-405b"), 2, 2, 8192, system="dgx-a100-40g", offloads=(0,))


@pytest.mark.multirank
def test_gloo_collectives_between_two_processes():
    times = probe.collective_times(2)
    assert all(times["all-reduce"][m] > 0 for m in probe.MESSAGE_SIZES)
    assert torch.distributed.is_available()


def test_probe_system_writes_a_loadable_profile(tmp_path, monkeypatch):
    """The whole probe with the 2-process collective timing replaced by a ring-model fake."""
    fake = {name: {m: 1e-4 + m / 1e9 for m in probe.MESSAGE_SIZES} for name in ("all-reduce", "all-gather")}
    fake["overhead"] = {"op_overhead_s": 1e-3, "tensor_overhead_s": 1e-3, "reference_s": 1.0, "reference_one_thread_s": 1.5,
                      "tp_op_overhead_s": 1e-2, "fsdp_group_overhead_s": 1e-2, "dtensor_tensor_overhead_s": 1e-2}
    monkeypatch.setattr(probe, "collective_times", lambda world=2: fake)
    monkeypatch.setattr(probe, "oversubscribed_times", lambda cores: {"world": 4, "reference_s": 3.0, "all_reduce_s": 0.01})
    monkeypatch.setattr(probe, "MATMUL_SIZES", (32, 64))
    profile = probe.probe_system()
    system = load_system(probe.write_profile(profile, tmp_path / "me.toml"))
    assert system.peak("fp32") > 0 and system.hbm_bandwidth > 0 and system.nvlink_bandwidth > 0
    assert max(system.efficiency["matmul"]) == 1.0 and system.gpus_per_node == 2
    assert system.cpu["op_overhead_s"] > 0 and system.cpu["oversubscription_exponent"] >= 1.0


def test_a_cached_probe_the_planner_refuses_is_measured_again(tmp_path, monkeypatch):
    """The probe cache is luban's own file, measured again when damaged; one that parsed but held a value the
    planner refuses (edited, or written under looser bounds than today's: here oversubscribed_stall_s = 0,
    which must be > 0) was returned as is, and every --parallel auto then failed on
    'probe.cpu.oversubscribed_stall_s = 0' until the user found and deleted the cache (a hostile sweep, 2026-11-27)."""
    monkeypatch.setenv("LUBAN_CACHE", str(tmp_path))
    stale = fake_profile()
    stale["cpu"]["oversubscribed_stall_s"] = 0
    probe.cache_path().parent.mkdir(parents=True, exist_ok=True)
    probe.cache_path().write_text(json.dumps(stale))
    fresh = fake_profile()
    monkeypatch.setattr(probe, "probe_system", lambda world=2: fresh)
    assert probe.cached_profile() == fresh
    assert json.loads(probe.cache_path().read_text()) == fresh


def test_a_profile_the_planner_would_refuse_is_not_written(tmp_path):
    """A probe whose measurement fell outside the planner's bounds (here an elementwise-traffic fit of 5000,
    allowed up to 1000) wrote a profile that every later 'luban plan estimate --system' refused: the file
    is now not written, and the one line names the value (a hostile sweep, 2026-11-27)."""
    bad = fake_profile()
    bad["efficiency"]["elementwise_traffic"] = 5000.0
    out = tmp_path / "me.toml"
    with pytest.raises(LubanError, match=r"^probe\.efficiency\.elementwise_traffic = 5000\.0: a number >= 0 and <= 1000$"):
        probe.write_profile(bad, out)
    assert not out.exists() and list(tmp_path.iterdir()) == []
