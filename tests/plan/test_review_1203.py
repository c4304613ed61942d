"""Review of 2026-12-03: one model table, one model, whoever reads it."""

import json

import pytest

from luban.config import load_config
from luban.model.config import DEFAULT_PRESET, ModelConfig
from luban.model.presets import get_preset
from luban.plan.cli import load_model


@pytest.mark.parametrize("table", [
    {"hidden": 256, "layers": 2},  # no preset: tiny's other keys (vocab 257, seq 128), not GPT-2's 50257 x 1024
    {"arch": "llama", "hidden": 64, "heads": 4},
    {"preset": "tiny-moe", "experts": 0},
    {"name": "mine"},
])
def test_a_run_config_plans_the_model_train_builds(tmp_path, table):
    """``luban plan estimate --model run.toml`` planned a GPT-2-sized model (vocab 50257, seq 1024)
    for a ``[model]`` without ``preset`` that ``luban train`` builds on ``tiny``."""
    lines = ["[model]"] + [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    run = tmp_path / "run.toml"
    run.write_text("\n".join(lines) + "\n")
    flat = tmp_path / "model.json"
    flat.write_text(json.dumps(table))
    trained = load_config(str(run)).model
    assert load_model(str(run)) == trained
    assert load_model(str(flat)) == trained
    assert load_model(str(run)).name == trained.name


def test_the_default_preset_fills_what_a_table_omits():
    tiny = get_preset(DEFAULT_PRESET)
    model = ModelConfig.from_dict({"layers": 2})
    assert (model.vocab, model.seq_len, model.hidden) == (tiny.vocab, tiny.seq_len, tiny.hidden)
    assert model.name == f"{tiny.name}-custom"
    assert ModelConfig.from_dict({}) == tiny and ModelConfig.from_dict({}).name == tiny.name
    full = get_preset("llama-8b").to_dict()  # a checkpoint's whole table is read as written
    assert ModelConfig.from_dict(full) == get_preset("llama-8b") and ModelConfig.from_dict(full).name == "llama-8b"
