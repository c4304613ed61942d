"""Review of 2026-12-03: one model table, one model, whoever reads it."""

import json
import math

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


# -- a capacity factor: the planner times the rows luban's experts compute ---------------------------

def _runtime_rows(cfg, tokens: int) -> int:
    """Rows luban's MoE layer hands its experts for a micro-batch of ``tokens`` tokens (one process)."""
    import torch

    from luban.model.moe import MoE

    torch.manual_seed(0)
    layer = MoE(cfg)
    seen = []
    real = layer.run_experts
    layer.run_experts = lambda rows, *a, **k: seen.append(rows.shape[0]) or real(rows, *a, **k)
    with torch.no_grad():
        layer(torch.randn(tokens, cfg.hidden))
    return seen[0]


@pytest.mark.parametrize("factor", [0.0, 0.6, 1.0, 1.25, 2.0, 1000.0])
@pytest.mark.parametrize("micro_batch, seq", [(1, 8), (2, 16), (4, 32)])
def test_the_planners_expert_rows_are_the_runtimes(factor, micro_batch, seq):
    """The planner costed a capacity factor as dropless (T·k rows, paced by the busiest rank) while
    luban's experts compute fixed zero-padded buffers of C rows each (E·C rows on every rank alike)."""
    from luban.model import flops
    from luban.parallel.layout import ParallelLayout
    from luban.plan.grid import Grid
    from luban.plan.memory import expert_rows
    from luban.plan.problem import Problem
    from luban.plan.system import load_system

    cfg = get_preset("tiny-moe").replace(capacity_factor=factor)
    p = Problem(cfg, load_system("dgx-h100"), 1, seq, micro_batch, "luban")
    share, capped = expert_rows(p, Grid.from_layout(ParallelLayout(micro_batch=micro_batch)))
    tokens = micro_batch * seq
    assert float(share) * tokens * cfg.experts_per_token == pytest.approx(_runtime_rows(cfg, tokens), rel=1e-12)
    assert bool(capped) == bool(flops.expert_capacity(factor, tokens, cfg.experts_per_token, cfg.experts))


def test_a_capacity_times_its_padded_buffers_and_no_imbalance():
    """Dropless pays the busiest rank's load (``--expert-imbalance``); a capacity's fixed buffers are
    the same on every rank, so the imbalance no longer paces it, and c = 2 computes and sends
    twice dropless's rows."""
    from luban.parallel.layout import ParallelLayout
    from luban.plan.estimate import evaluate
    from luban.plan.grid import Grid
    from luban.plan.problem import Problem
    from luban.plan.system import load_system

    def parts(factor, imbalance=1.0):
        cfg = get_preset("qwen3-30b-a3b").replace(capacity_factor=factor)
        p = Problem(cfg, load_system("dgx-h100"), 16, 4096, 256, "luban", expert_imbalance=imbalance)
        g = Grid.from_layout(ParallelLayout(dp=16, ep=8, zero=1, precision="bf16", recompute="full"))
        r = evaluate(p, g)
        return float(r["time"]["parts"]["ep_comm"]), float(r["memory"]["first"]["activations"])

    (free, free_mem), (skew, _) = parts(0.0), parts(0.0, 1.5)
    assert skew == pytest.approx(1.5 * free)
    (two, two_mem), (two_skew, _) = parts(2.0), parts(2.0, 1.5)
    # twice the bytes (C = 512 of 4096 tokens x 8 / 128 experts: E·C = 2·T·k); a larger message runs
    # nearer the link's bandwidth, so the time is a little less than twice
    assert 1.5 * free < two <= 2 * free and two_skew == pytest.approx(two)
    assert two_mem > free_mem


def test_a_width_override_keeps_the_presets_expert_width():
    """A preset's expert width is its own (Mixtral's 14336), and a run's checkpoints record the width
    its table resolved to: re-deriving it from an overridden hidden (tried 2026-12-03) shrank
    ``{"preset": "mixtral-8x7b", "hidden": 4096}`` from 46.7 B to 36.2 B parameters and refused the
    resume of every run whose ``[model]`` overrides hidden (expert_ffn_hidden differs)."""
    from luban.model import flops

    mixtral = get_preset("mixtral-8x7b")
    restated = ModelConfig.from_dict({"preset": "mixtral-8x7b", "hidden": mixtral.hidden})
    assert restated.expert_ffn_hidden == mixtral.expert_ffn_hidden == 14336
    assert flops.param_count(restated) == flops.param_count(mixtral)
    tiny = get_preset(DEFAULT_PRESET)
    assert ModelConfig.from_dict({"hidden": 64, "heads": 4}).expert_ffn_hidden == tiny.expert_ffn_hidden
    assert ModelConfig.from_dict({"experts": 4, "hidden": 256}).expert_ffn_hidden == tiny.expert_ffn_hidden


def test_the_shared_capacity_formula_traces_without_a_graph_break():
    """``flops.expert_capacity`` first took numpy for the runtime too: under ``torch.compile`` the
    layer's size became a tensor and its read a data-dependent graph break (16 graphs, not 10, for
    four micro-batch sizes). The layer's answer is the eager one either way."""
    import torch
    from torch._dynamo.utils import counters

    from luban.model.config import ModelConfig
    from luban.model.moe import MoE

    torch.manual_seed(0)
    layer = MoE(ModelConfig(hidden=16, layers=1, heads=2, experts=4, experts_per_token=2, capacity_factor=1.25))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer)
    for tokens in (32, 48, 64):  # the second size makes Dynamo trace the size symbolically
        x = torch.randn(tokens, 16)
        assert torch.allclose(compiled(x), layer(x), atol=1e-6)
        assert layer.capacity(tokens) == math.ceil(1.25 * tokens * 2 / 4)
    assert not [why for why in counters["graph_break"] if "Data dependent" in why], dict(counters["graph_break"])


@pytest.mark.parametrize("text, expected", [
    ("[train]\nlr = 0.001\n", "tiny"),  # a run config without [model]: train builds tiny; plan said "model.train: unknown key"
    ("[model]\n", "tiny"),  # an empty [model]: plan refused "an empty table"
    ("[model]\nhidden = 64\nheads = 4\n[data]\nseq_len = 32\n", "tiny-custom"),
])
def test_any_run_config_plans_what_train_builds(tmp_path, text, expected):
    run = tmp_path / "run.toml"
    run.write_text(text)
    assert load_model(str(run)) == load_config(str(run)).model and load_model(str(run)).name == expected


@pytest.mark.parametrize("text, what", [
    ("model = 5\n", "model = 5: must be a table of keys"),  # a run config's faults as train names them
    ("train = 3\n", "train = 3: must be a table of keys"),  # planned as tiny before (the sections' names alone were looked at)
    ("[model]\nhidden = 64\nheads = 4\n[eval]\nx = 1\n", "section = 'eval': unknown"),  # was "model.model: unknown key"
    ("", "not an empty table"),
])
def test_a_model_file_that_is_no_table_is_one_line(tmp_path, text, what):
    from luban.errors import LubanError

    bad = tmp_path / "m.toml"
    bad.write_text(text)
    with pytest.raises(LubanError, match=what):
        load_model(str(bad))


def test_a_huge_capacity_factor_runs_dropless_without_a_warning_or_overflow(tmp_path):
    """``capacity_factor = 1e308`` (accepted: finite) overflowed: an OverflowError traceback in the
    layer (math.ceil of inf), a RuntimeWarning on the planner's stderr."""
    import warnings

    import numpy as np
    import torch

    from luban.model import flops
    from luban.model.moe import MoE

    cfg = get_preset("tiny-moe").replace(capacity_factor=1e308)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert flops.expert_capacity(1e308, 64, 2, 4) == 0
        assert flops.expert_capacity(1e308, np.array([64.0, 128.0]), 2, 4).tolist() == [0, 0]
        layer = MoE(cfg)
        assert layer.capacity(64) is None
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.1)
        assert torch.isfinite(layer(torch.randn(8, cfg.hidden))).all()
