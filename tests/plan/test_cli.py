"""``luban plan`` through a subprocess, as users run it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from luban.cli import main

ROOT = Path(__file__).resolve().parents[2]


def luban(*args):
    return subprocess.run([sys.executable, "-m", "luban", "plan", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_estimate_json_has_the_documented_keys():
    r = luban("estimate", "--model", "gpt3-175b", "--gpus", "64", "--global-batch", "64", "--tp", "8", "--pp", "8",
              "--sp", "--recompute", "selective", "--schedule", "interleaved-1f1b", "--virtual-stages", "3",
              "--zero", "1", "--precision", "fp16", "--train-tokens", "3e11", "--price-per-gpu-hour", "2", "--runtime", "megatron", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("fits", "step_time_s", "tokens_per_s", "mfu", "hfu", "tflops_per_gpu", "memory_bytes",
                "time_breakdown_s", "gpu_hours", "cost"):
        assert key in out
    assert set(out["memory_bytes"]) >= {"weights", "gradients", "optimizer", "activations", "other", "total"}
    assert out["fits"] and out["layout"]["tp"] == 8 and out["cost"] > 0


def test_estimate_human_output_explains_an_infeasible_layout(tmp_path):
    model = tmp_path / "m.toml"
    model.write_text('[model]\npreset = "llama-8b"\nlayers = 40\n')
    r = luban("estimate", "--model", str(model), "--gpus", "1", "--global-batch", "8", "--seq", "8192",
              "--precision", "bf16", "--explain")
    assert r.returncode == 0, r.stderr
    assert "does not fit" in r.stdout and "GiB per GPU at zero=0" in r.stdout
    assert "nearest layouts that fit" in r.stdout and "[parallel]" in r.stdout
    assert "pipeline_bubble" in r.stdout  # --explain lists every time component


def test_bad_input_exits_2_with_one_line():
    r = luban("estimate", "--model", "megatron-22b", "--gpus", "8", "--global-batch", "8", "--tp", "3")
    assert r.returncode == 2 and r.stderr.strip() == "luban: error: --gpus = 8: must be divisible by tp*pp*cp = 3"


@pytest.mark.parametrize("args,needle", [
    (["--tp", "5", "--dp", "1", "--gpus", "5"], "parallel.tp = 5"),
    (["--model", "no-such-model"], "--model"),
    (["--zero", "7"], "--zero = 7: an integer from 0 to 3"),
    (["--system", "no-such-system"], "--system"),
    (["--global-batch", "3"], "train.global_batch = 3"),
])
def test_bad_input_messages_name_the_key(args, needle, capsys):
    base = {"--model": "megatron-22b", "--gpus": "8", "--global-batch": "8"}
    flags = list(args)
    for k, v in base.items():
        if k not in flags:
            flags += [k, v]
    assert main(["plan", "estimate", *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("luban: error:") and needle in lines[0], lines


def test_search_json_reports_count_rate_and_chart(tmp_path):
    chart = tmp_path / "best.png"
    r = luban("search", "--model", "megatron-22b", "--gpus", "16", "--global-batch", "32", "--json", "--top", "3",
              "--chart", str(chart))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["evaluated"] > 10000 and out["layouts_per_s"] > 0 and len(out["best"]) == 3
    assert sum(out["rejected"].values()) + out["valid"] == out["evaluated"]
    assert chart.read_bytes()[:4] == b"\x89PNG"


def test_validate_prints_per_row_errors():
    r = luban("validate")
    assert r.returncode == 0, r.stderr
    assert "korthikanti2022-t5: 8 rows" in r.stdout and "narayanan2021-t1: 10 rows" in r.stdout
    assert "MISMATCH" not in r.stdout
    # both leave-one-source-out refits: the dense knobs and the MoE host time (loso.fit_moe)
    assert "leave-one-source-out (dense, " in r.stdout and "leave-one-source-out (MoE, 2 sources" in r.stdout
    assert "nvidia-megatron-core-moe-modelzoo" in r.stdout


def test_estimate_on_a_probed_profile_models_luban_ranks(tmp_path):
    """A profile with a ``[cpu]`` table describes luban's own ranks: the luban runtime (CPU
    overheads included) is the default there; ``--runtime`` still overrides it."""
    from tests.plan.test_probe_auto import fake_profile

    from luban.plan.probe import write_profile

    path = write_profile(fake_profile(), tmp_path / "probe.toml")
    args = ("estimate", "--model", "tiny", "--system", str(path), "--gpus", "2", "--global-batch", "16", "--dp", "2",
            "--zero", "2", "--json")
    default, megatron = (json.loads(luban(*a).stdout) for a in (args, (*args, "--runtime", "megatron")))
    assert default["runtime"] == "luban" and megatron["runtime"] == "megatron"
    assert default["step_time_s"] > megatron["step_time_s"]  # framework overheads counted
    bad = luban(*args, "--runtime", "deepspeed")
    assert bad.returncode == 2 and "--runtime" in bad.stderr and "megatron" in bad.stderr


def test_pad_vocab_and_ep_overlap_reach_the_plan(capsys):
    """Each option changes the estimate it names: --pad-vocab off/on on GPT-2's odd vocabulary (one head
    GEMM on the generic kernel), --ep-overlap on a MoE's all-to-alls; a bad value is a one-line error."""
    def step(*flags):
        assert main(["plan", "estimate", "--system", "dgx-h100", "--gpus", "8", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["step_time_s"]

    gpt2 = ("--model", "gpt2-124m", "--global-batch", "64", "--seq", "1024", "--runtime", "pytorch",
            "--precision", "bf16", "--dp", "8")
    assert step(*gpt2) == step(*gpt2, "--pad-vocab", "off") > step(*gpt2, "--pad-vocab", "on")  # pytorch: no padding
    moe = ("--model", "qwen3-30b-a3b", "--global-batch", "64", "--seq", "4096", "--runtime", "megatron-core",
           "--precision", "bf16", "--dp", "8", "--ep", "8", "--zero", "1")
    assert step(*moe, "--ep-overlap") < step(*moe)
    assert main(["plan", "estimate", *gpt2, "--pad-vocab", "maybe"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("luban: error:") and "--pad-vocab" in err[0], err


def test_tp_overlap_hides_tensor_parallel_collectives_only_where_asked(capsys):
    """--tp-overlap: megatron-core overlaps its sequence-parallel TP collectives by default (the
    Megatron-Bridge recipes' --tp-comm-overlap) and ``off`` exposes them; fsdp2 (torchtitan) exposes
    them by default and ``on`` is its async TP, which hides the forward's only; without sequence
    parallel nothing hides, and asking for it there is refused."""
    def plan(*flags):
        assert main(["plan", "estimate", "--system", "dgx-h100", "--gpus", "8", "--json", "--model", "llama-8b",
                     "--global-batch", "64", "--seq", "4096", "--precision", "bf16", "--tp", "8", "--dp", "1",
                     "--micro-batch", "1", "--zero", "1", *flags]) == 0
        out = json.loads(capsys.readouterr().out)
        return out["time_breakdown_s"]["tp_comm"], out["step_time_s"]

    core = ("--runtime", "megatron-core", "--sp")
    assert plan(*core)[0] < plan(*core, "--tp-overlap", "off")[0]
    assert plan(*core) == plan(*core, "--tp-overlap", "on")
    titan = ("--runtime", "fsdp2", "--sp")
    assert plan(*titan) == plan(*titan, "--tp-overlap", "off")
    assert plan(*titan, "--tp-overlap", "on")[1] < plan(*titan)[1]
    assert plan(*titan, "--tp-overlap", "on")[0] > plan(*core)[0]  # async TP: the forward's collectives only
    assert main(["plan", "estimate", "--system", "dgx-h100", "--gpus", "8", "--model", "llama-8b", "--global-batch", "64",
                 "--tp", "8", "--dp", "1", "--runtime", "megatron-core", "--tp-overlap", "on"]) == 2  # no --sp
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tp-overlap = 'on': needs tensor + sequence parallel" in err[0], err


def test_grad_reduce_in_fp32_halves_megatron_core_main_gradients_only(capsys):
    """--grad-reduce-in-fp32 off (the Megatron-Bridge recipes' grad_reduce_in_fp32 = False): megatron-core
    keeps and reduces 2-byte main gradients instead of fp32 ones (memory and the data-parallel
    reduction both halve); auto and on are Megatron-LM's fp32 default; any other runtime, or a value
    that is not a switch, is a one-line error."""
    def plan(*flags):
        code = main(["plan", "estimate", "--system", "dgx-h100", "--gpus", "16", "--json", "--model", "llama-8b",
                     "--global-batch", "64", "--seq", "4096", "--precision", "bf16", "--dp", "16", "--zero", "1",
                     "--micro-batch", "1", *flags])
        captured = capsys.readouterr()
        return code, (json.loads(captured.out) if code == 0 else captured.err)

    core = ("--runtime", "megatron-core")
    _, default = plan(*core)
    _, fp32 = plan(*core, "--grad-reduce-in-fp32", "on")
    _, bf16 = plan(*core, "--grad-reduce-in-fp32", "off")
    assert default == fp32
    assert bf16["memory_bytes"]["gradients"] == pytest.approx(fp32["memory_bytes"]["gradients"] / 2)
    assert bf16["step_time_s"] <= fp32["step_time_s"]
    code, err = plan("--runtime", "fsdp2", "--grad-reduce-in-fp32", "off")
    assert code == 2 and err.strip() == ("luban: error: --grad-reduce-in-fp32 = 'off': auto (only megatron-core "
                                         "has the switch)")
    code, err = plan(*core, "--grad-reduce-in-fp32", "1")
    assert code == 2 and "--grad-reduce-in-fp32" in err and "Traceback" not in err


def test_runtime_help_names_every_runtime(capsys):
    """The --runtime help (written without importing the runtimes: no numpy at parse time) names
    each entry of luban.plan.runtimes.RUNTIMES."""
    from luban.plan.runtimes import RUNTIMES

    assert main(["plan", "estimate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps at hyphens
    assert all(name in text for name in RUNTIMES), text


def test_the_default_runtime_is_lubans_own_on_a_gpu_profile():
    """A plan answers for what `luban train` runs unless --runtime names another (it was the 2021
    megatron model on GPU profiles, which plans long Llama sequences as not fitting)."""
    base = ("estimate", "--model", "llama-8b", "--system", "dgx-h100", "--gpus", "8", "--global-batch", "32",
            "--seq", "8192", "--zero", "3", "--json")
    plans = [json.loads(luban(*base, *extra).stdout) for extra in ((), ("--runtime", "luban"), ("--runtime", "megatron"))]
    assert plans[0] == plans[1] and plans[0]["fits"]
    assert plans[0]["memory_bytes"] != plans[2]["memory_bytes"]


def test_an_unlimited_gpu_memory_is_not_printed_as_inf(capsys):
    """--system-set hbm_gib=inf (documented: an unlimited tier) printed 'fits in inf GiB' and, with
    --explain, 'of inf GiB' (a hostile sweep, 2026-11-27)."""
    import re

    for extra in ([], ["--explain"]):
        assert main(["plan", "estimate", "--model", "tiny", "--gpus", "1", "--global-batch", "1",
                     "--system-set", "hbm_gib=inf", *extra]) == 0
        out = capsys.readouterr().out
        assert "unlimited HBM" in out and not re.search(r"\binf\b", out), out


def test_an_mfu_above_100_percent_says_why(capsys):
    """Qwen3-30B-A3B at seq 40960 under fsdp2 planned MFU 101.8% on an A100 without a word (a hostile
    sweep, 2026-11-27): MFU and HFU count the full s x s attention (the validated tables' convention),
    the kernel executes the causal half. Said where it is above 100%, and only there."""
    argv = ["plan", "estimate", "--model", "qwen3-30b-a3b", "--gpus", "8", "--global-batch", "8", "--ep", "8",
            "--runtime", "fsdp2", "--zero", "3"]
    for extra in ([], ["--explain"]):
        assert main([*argv, *extra]) == 0
        out = capsys.readouterr().out
        assert "MFU and HFU above 100%: both count the full (non-causal) s x s attention" in out, out
    assert main(["plan", "estimate", "--model", "tiny", "--gpus", "1", "--global-batch", "1"]) == 0
    assert "above 100%" not in capsys.readouterr().out


def test_a_chart_of_a_huge_top_draws_the_best_chart_rows(tmp_path):
    """search --top 10000 --chart drew one bar per layout: 6 minutes for a 51 MB PNG 660,000 pixels tall
    (a hostile sweep, 2026-11-27); the chart now holds the best CHART_ROWS."""
    import struct

    from luban.model.presets import get_preset
    from luban.parallel.layout import ParallelLayout
    from luban.plan.chart import CHART_ROWS, write_chart
    from luban.plan.estimate import estimate

    one = estimate(get_preset("tiny"), "dgx-h100", ParallelLayout(), global_batch=1)
    path = write_chart([one] * (CHART_ROWS + 30), tmp_path / "best.png")
    width, height = struct.unpack(">II", path.read_bytes()[16:24])  # the PNG's IHDR
    assert height == round((2.2 + 0.6 * CHART_ROWS) * 110), (width, height)


def test_a_dollar_in_a_name_does_not_break_the_chart(tmp_path):
    """A model or profile named 'gpt $\\frac{$ x' made the chart's title TeX: matplotlib's mathtext
    raised a ValueError traceback after the whole search, and the search's result was never printed
    (a hostile sweep, 2026-11-27). The title is plain text."""
    from luban.model.presets import get_preset
    from luban.parallel.layout import ParallelLayout
    from luban.plan.chart import write_chart
    from luban.plan.estimate import estimate

    one = estimate(get_preset("tiny"), "dgx-h100", ParallelLayout(), global_batch=1)
    path = write_chart([one], tmp_path / "best.png", "gpt $\\frac{$ x on 8x h100")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_a_name_from_a_file_cannot_drive_the_terminal(tmp_path, monkeypatch):
    """A model file's (or profile's) name is printed in estimate's first line: one named
    'x\\x1b]0;title\\x07\\x1b[2J' set the terminal's title and cleared the screen (a hostile sweep,
    2026-11-27). On a terminal its controls are shown escaped (luban.errors.for_terminal); a pipe gets them as written."""
    import io

    model = tmp_path / "m.json"
    model.write_text(json.dumps({"preset": "tiny", "name": "x\x1b]0;title\x07\x1b[2J"}))

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["plan", "estimate", "--model", str(model), "--gpus", "1", "--global-batch", "1"]) == 0
    first = out.getvalue().splitlines()[0]
    assert first.startswith("x\\x1b]0;title\\x07\\x1b[2J on 1x ") and "\x1b" not in out.getvalue(), first


def test_probe_base_is_refused_where_it_would_be_ignored():
    """``--base`` names the GPU's datasheet profile for ``--device cuda``; the CPU probe has none, so
    the flag did nothing there, silently."""
    r = luban("probe", "--base", "hgx-h200")
    assert r.returncode == 2 and r.stderr.startswith("luban: error: --base = 'hgx-h200': only with --device cuda"), \
        r.stderr


def test_a_chart_asked_for_where_no_layout_fits_says_none_was_written(tmp_path):
    """``search --chart F --json`` with no layout that fits printed the JSON and nothing else: F was
    simply not there (a hostile review, 2026-11-27)."""
    chart = tmp_path / "best.png"
    r = luban("search", "--model", "llama-70b", "--gpus", "1", "--global-batch", "8", "--system", "dgx-h100",
              "--json", "--chart", str(chart))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["best"] == [] and not chart.exists()
    assert f"luban: warning: no layout fits: no chart written ({chart})" in r.stderr
