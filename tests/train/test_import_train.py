"""A run from the weights `luban import` read: `luban train --resume auto` in the imported run
folder (docs/training.md: "a run trained from the imported checkpoint"). Until 2026-11-27 it failed
with "meta.json has no loader" (the imported checkpoint has no optimizer, loader or [train]), its
[model] had to be copied key by key, and without --resume a run trained from random weights there."""

from __future__ import annotations

import json

import pytest
import torch

from .conftest import luban, tiny_overrides

transformers = pytest.importorskip("transformers")


def _sets(overrides):
    return sum((["--set", s] for s in overrides), [])


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A Llama that transformers wrote (grouped-query attention, untied head), its vocabulary above
    the byte tokenizer's 257 ids."""
    folder = tmp_path_factory.mktemp("hf") / "llama"
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("layout", [{}, {"parallel.pp": 2, "parallel.dp": 1}], ids=["one-process", "pp2"])
def test_training_continues_from_the_imported_weights(hf_llama, small_dataset, tmp_path, layout):
    """The run takes the checkpoint's [model] (none given), loads its weights as step 0 with a new
    optimizer and data order, and saves ordinary checkpoints: at a vanishing learning rate its last
    checkpoint, exported, has transformers' logits of the folder imported (on one process, and on a
    pipeline of two ranks, each loading its own layer)."""
    run = tmp_path / "ft"
    luban("import", hf_llama, run, check=0)
    sets = tiny_overrides(small_dataset, run, **{"train.steps": 2, "train.lr": 1e-12, "train.min_lr": 0.0,
                                                 "train.weight_decay": 0.0, "train.eval_every": 0,
                                                 "train.checkpoint_every": 2, **layout})
    sets = [s for s in sets if not s.startswith("model.")]  # no [model] key: the checkpoint's
    ranks = ["--nproc", "2"] if layout else []
    out = luban("train", *_sets(sets), *ranks, "--resume", "auto", check=0).stdout
    assert f"[model]: the checkpoint's ({run / 'checkpoints' / 'step_0000000'}): hf-llama, " in out, out
    assert f"the weights imported from {hf_llama}, as step 0: a new optimizer" in out, out
    assert "step 2/2" in out
    meta = json.loads((run / "checkpoints" / "step_0000002" / "meta.json").read_text())
    assert meta["loader"]["consumed_samples"] == 8 and meta["config"]["model"]["arch"] == "llama"

    luban("export", run, "--format", "hf", tmp_path / "out", check=0)
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf_llama).eval()
    ours = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(ours(x).logits, theirs(x).logits, atol=1e-5, rtol=0)


def test_a_model_that_differs_from_the_imported_one_names_every_key(hf_llama, small_dataset, tmp_path):
    run = tmp_path / "ft"
    luban("import", hf_llama, run, check=0)
    proc = luban("train", *_sets(tiny_overrides(small_dataset, run, **{"train.steps": 1})), "--resume", "auto")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("luban: error: model.arch = 'gpt2': 'llama', as in the checkpoint --resume names ")
    assert ("whose [model] differs in 14 key(s): arch = \"llama\", hidden = 64, kv_heads = 2, head_dim = 16, "
            "ffn_hidden = 128, vocab = 300, seq_len = 64, ") in proc.stderr  # layers = 2 is given, name is a label: not listed
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_0000000"]  # nothing written


def test_an_imported_checkpoint_of_another_folder_into_a_run_is_refused(hf_llama, small_dataset, tmp_path):
    """An attack on the day's changes, 2026-11-27: `--resume OTHER/checkpoints/step_0000000` (an
    import, or any checkpoint of another folder) into a run.dir holding a run started there as step 0
    and saved its steps over that run's (a llama run's step_0000002 became a gpt2's, its step_0000004
    stayed: --resume auto mixed them). Refused in one line, nothing changed; into a new run.dir it runs."""
    run, other = tmp_path / "run", tmp_path / "other"
    luban("import", hf_llama, run, check=0)
    luban("import", hf_llama, other, check=0)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    sets = [s for s in tiny_overrides(small_dataset, run, **{"train.steps": 1}) if not s.startswith("model.")]
    named = other / "checkpoints" / "step_0000000"
    proc = luban("train", *_sets(sets), "--resume", named, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"luban: error: --resume = '{named}': a checkpoint of another folder, and "
                                  f"run.dir = '{run}' already holds a run (1 checkpoint(s), the newest step_0000000)")
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


def _set_source(ckpt, source) -> None:
    """meta.json's ``source`` set to ``source``, the manifest updated to match (the checksums pass)."""
    import zlib

    meta = json.loads((ckpt / "meta.json").read_text())
    meta["source"] = source
    (ckpt / "meta.json").write_text(json.dumps(meta))
    data = (ckpt / "meta.json").read_bytes()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["meta.json"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_an_imported_source_with_control_codes_is_printed_escaped(hf_llama, small_dataset, tmp_path):
    """An attack on the day's changes, 2026-11-27: an imported checkpoint's meta.json `source` (any
    text: a folder received from someone) was printed as written in the resume note, its ESC, BEL and
    newline driving the terminal; now escaped like every foreign text luban prints."""
    run = tmp_path / "run"
    luban("import", hf_llama, run, check=0)
    _set_source(run / "checkpoints" / "step_0000000", "\x1b]0;owned\x07/hf\nfake line")
    sets = [s for s in tiny_overrides(small_dataset, run, **{"train.steps": 1}) if not s.startswith("model.")]
    out = luban("train", *_sets(sets), "--resume", "auto", check=0, timeout=120).stdout
    assert "the weights imported from \\x1b]0;owned\\x07/hf\\nfake line, as step 0" in out, out
    assert "\x1b" not in out and "\x07" not in out


def test_the_imported_model_given_key_by_key_resumes_whatever_its_name(hf_llama, small_dataset, tmp_path):
    """An attack on the day's changes, 2026-11-27: a config giving every [model] key of the imported
    checkpoint but its name (a label: ``ModelConfig.name`` is ``compare=False``; the config's derives
    'tiny-custom') was refused: "model.name = 'tiny-custom': 'hf-llama' ... differs in 1 key(s)"."""
    run = tmp_path / "run"
    luban("import", hf_llama, run, check=0)
    model = json.loads((run / "checkpoints" / "step_0000000" / "meta.json").read_text())["config"]["model"]
    sets = [s for s in tiny_overrides(small_dataset, run, **{"train.steps": 1}) if not s.startswith("model.")]
    sets += [f"model.{k}={json.dumps(v)}" for k, v in model.items() if k != "name"]
    out = luban("train", *_sets(sets), "--resume", "auto", check=0, timeout=120).stdout
    assert "the weights imported from" in out and "step 1/1" in out, out


def test_resume_auto_from_a_damaged_import_does_not_train_random_weights(hf_llama, small_dataset, tmp_path):
    """An attack on the day's changes, 2026-11-27: `--resume auto` in an imported run whose only
    checkpoint fails its checks (here meta.json's `source` is not text) took the checkpoint's [model],
    skipped the checkpoint and said "starting fresh": a llama of random weights trained, saved beside
    the import (a start without --resume there is refused for that). Refused in one line."""
    run = tmp_path / "run"
    luban("import", hf_llama, run, check=0)
    ckpt = run / "checkpoints" / "step_0000000"
    _set_source(ckpt, 5)
    sets = [s for s in tiny_overrides(small_dataset, run, **{"train.steps": 1}) if not s.startswith("model.")]
    proc = luban("train", *_sets(sets), "--resume", "auto", timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("luban: error: --resume = 'auto': none of run.dir's 1 checkpoint(s) is valid "
                                  "(the newest step_0000000: "), proc.stderr
    assert f"skipping checkpoint {ckpt}: meta.json source = 5" in proc.stdout
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_0000000"]
