"""The CLI end to end on a tiny model: metrics, sampling, export/import, one-line errors."""

import json

import pytest
import torch

from .conftest import assert_bitwise_equal, final_weights, luban

METRIC_FIELDS = {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "hfu",
                 "time_data_s", "time_fwd_bwd_s", "time_optimizer_s", "time_step_s", "peak_memory_bytes",
                 "param_bytes", "grad_bytes", "optimizer_bytes"}


def _sets(overrides):
    return sum((["--set", s] for s in overrides), [])


def test_the_first_steps_memory_record_holds_the_optimizer_state(tiny, tmp_path):
    """metrics.jsonl's bytes are read after the optimizer step: AdamW makes its two states in the
    first step, and step 1 read 0 optimizer bytes (taken before that step)."""
    luban("train", *_sets(tiny(**{"train.steps": 2, "train.optimizer": '"adamw"'})), check=0)
    records = [r for line in (tmp_path / "run" / "metrics.jsonl").open() if "checkpoint" not in (r := json.loads(line))]
    assert [r["optimizer_bytes"] for r in records] == [2 * records[0]["param_bytes"]] * 2, records


def test_train_logs_metrics_and_learns_then_samples_exports_imports(tiny, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[model]\npreset = "tiny"\n[train]\noptimizer = "adamw"\n')
    proc = luban("train", config, *_sets(tiny(**{"train.steps": 30, "train.eval_every": 10,
                                                 "run.tensorboard": "true"})), check=0)
    assert "step 30/30" in proc.stdout
    records = [r for line in (tmp_path / "run" / "metrics.jsonl").open() if "checkpoint" not in (r := json.loads(line))]
    assert [r["step"] for r in records] == list(range(1, 31))
    assert all(METRIC_FIELDS <= r.keys() for r in records)
    assert [r["step"] for r in records if "val_loss" in r] == [10, 20, 30]
    assert records[-1]["loss"] < records[0]["loss"] - 1.0  # it learns
    assert (records[-1]["mfu"] is None or 0 < records[-1]["mfu"] <= 1) and records[-1]["tokens"] == 30 * 4 * 32
    assert records[-1]["param_bytes"] == sum(p.numel() for p in
                                             __import__("luban.model.transformer", fromlist=["x"]).build_model(
                                                 __import__("luban.config", fromlist=["x"]).load_config(
                                                     None, tiny()).model).parameters()) * 4
    assert any((tmp_path / "run" / "tensorboard").iterdir())

    out = luban("sample", tmp_path / "run", "--tokens", 40, "--samples", 2, "--prompt", "import ", check=0).stdout
    assert out.count("--- sample") == 2 and "import " in out

    luban("export", tmp_path / "run", "--format", "hf", tmp_path / "hf", check=0)
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    luban("import", tmp_path / "hf", tmp_path / "imported", check=0)
    original = final_weights(tmp_path / "run")
    assert_bitwise_equal(original, final_weights(tmp_path / "imported"))
    from luban.train.sample import load_model

    model, _ = load_model(str(tmp_path / "run"))
    x = torch.randint(0, 257, (1, 16))
    with torch.no_grad():
        assert torch.allclose(model(x), hf(x).logits, atol=1e-5)


@pytest.mark.parametrize("args, needle", [
    (["--set", "train.stepz=3"], "train.stepz = 3: unknown key"),
    (["--set", "train.steps=-4"], "train.steps = -4: must be positive"),
    (["--set", "train.lr=\"fast\""], "train.lr = 'fast': must be of type float"),
    (["--set", "model.heads=5"], "model.heads = 5: must divide hidden"),
    (["--set", "data.path=\"/nonexistent/data\""], "data.path = '/nonexistent/data': no dataset there"),
    (["--set", "parallel.tp=3", "--nproc", "3"], "parallel.tp = 3: must divide heads"),
    (["--set", "parallel.pipeline=2"], "parallel.pipeline = 2: unknown key"),
    (["--set", "train.global_batch=6", "--set", "parallel.micro_batch=4"], "train.global_batch = 6"),
    (["--set", "model.vocab=100"], "model.vocab = 100: must be >= the dataset's tokenizer vocabulary 257"),
    (["--set", "noequals"], "--set = 'noequals': expected section.key=value"),
    (["/nonexistent.toml"], "CONFIG = '/nonexistent.toml': an existing file"),
    (["--parallel", "auto", "--set", 'run.system="nope"'], "run.system = 'nope': a profile file or one of"),  # said --system
])
def test_bad_input_is_one_line_exit_2(tiny, args, needle):
    proc = luban("train", *_sets(tiny()), *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("luban: error:"), proc.stderr


@pytest.mark.parametrize("env, data_path, needle", [
    ({"LUBAN_PEAK_FLOPS": "abc"}, None, "LUBAN_PEAK_FLOPS = 'abc': the device's peak FLOP/s"),
    ({"LUBAN_PEAK_FLOPS": "nan"}, None, "LUBAN_PEAK_FLOPS = 'nan'"),  # was accepted: MFU nan%
    ({"LUBAN_PEAK_FLOPS": "-5"}, None, "LUBAN_PEAK_FLOPS = '-5'"),  # MFU -104762218592.5%
    ({"LUBAN_CACHE": "/proc/nope"}, "", "LUBAN_CACHE = '/proc/nope': a folder luban can write its cache into"),
])
def test_bad_environment_is_one_line_exit_2(tiny, tmp_path, env, data_path, needle):
    """A hostile sweep, 2026-11-27: each was a traceback or a nonsense MFU."""
    import os

    overrides = tiny(**({"data.path": '""'} if data_path is not None else {}))
    proc = luban("train", *_sets(overrides), env={**os.environ, **env})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr


def test_a_foreign_file_in_the_cache_names_luban_cache_not_a_flag(tiny, tmp_path):
    """The default dataset's folder holding a user's file was refused as ``--out = ...``, a flag
    ``luban train`` has not (claims review, 2026-11-28)."""
    import os

    folder = tmp_path / "cache" / "datasets" / "default-byte"
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    proc = luban("train", *_sets(tiny(**{"data.path": '""'})), env={**os.environ, "LUBAN_CACHE": str(tmp_path / "cache")})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"luban: error: LUBAN_CACHE = '{tmp_path / 'cache'}'") and "notes.txt" in lines[0]
    assert "--out" not in lines[0] and (folder / "notes.txt").read_text() == "mine"


def test_every_command_has_help():
    for cmd in ("train", "demo", "sample", "export", "import", "data"):
        proc = luban(cmd, "--help", check=0)
        assert "usage: luban" in proc.stdout


@pytest.mark.multirank
def test_demo_plans_then_moves_the_run_to_another_layout(tiny, tmp_path):
    """The README's ``luban demo`` path, shortened: 4 ranks, planned layout for the first half,
    resumed on pp=2 x dp=2 for the second, then samples."""
    proc = luban("demo", *_sets(tiny(**{"train.steps": 10, "train.global_batch": 8, "train.eval_every": 0})),
                 check=0, timeout=600)
    assert proc.stdout.count("plan: ") == 1 and "plan vs measured: step_time_s" in proc.stdout
    assert "steps 6-10: resuming step 5's checkpoint on another layout: pp=2, dp=2, zero=1" in proc.stdout
    assert "resumed from" in proc.stdout and "Samples from" in proc.stdout
    records = [r for line in (tmp_path / "run" / "metrics.jsonl").open() if "checkpoint" not in (r := json.loads(line))]
    assert [r["step"] for r in records] == list(range(1, 11))


def test_ranks_fit_the_gpus_present(capsys, monkeypatch, tmp_path):
    """A one-GPU machine: the demo takes one rank (it started 4, and ranks 1-3 died on
    ``set_device``); ``luban train --nproc 2`` is one line naming the count; CPU ranks when
    asked. Pure rule first, then through the CLI with the GPU count pinned."""
    from luban.cli import main
    from luban.train import cli as train_cli
    from luban.train.cli import fit_ranks

    assert [fit_ranks(None, g, demo=True) for g in (0, 1, 2, 3, 4, 8)] == [4, 1, 2, 2, 4, 4]
    assert fit_ranks(None, 1) == 1 and fit_ranks(2, 0) == 2 and fit_ranks(8, 8) == 8
    monkeypatch.setattr(train_cli, "local_gpus", lambda device: 0 if device == "cpu" else 1)
    code = main(["train", "--nproc", "2", "--set", f'run.dir="{tmp_path}/r"'])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [
        'luban: error: --nproc = 2: at most 1: this node has 1 GPU(s), one rank each; set run.device = "cpu" for CPU ranks']
    assert not (tmp_path / "r").exists()
