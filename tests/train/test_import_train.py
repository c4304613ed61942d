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
    assert ("whose [model] differs in 15 key(s): arch = \"llama\", hidden = 64, kv_heads = 2, head_dim = 16, "
            "ffn_hidden = 128, vocab = 300, seq_len = 64, ") in proc.stderr  # layers = 2 is given: not listed
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_0000000"]  # nothing written
