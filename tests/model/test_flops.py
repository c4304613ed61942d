"""Parameter and FLOP formulas against published figures."""

import csv
from pathlib import Path

import pytest

from luban.model import ModelConfig, get_preset
from luban.model.flops import flops_per_token, narayanan_eq2, narayanan_eq3, param_count
from luban.model.transformer import build_model

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference"
NARAYANAN_TABLE1 = [  # params (B), heads, hidden, layers — Narayanan et al. 2021, Table 1
    (1.7, 24, 2304, 24), (3.6, 32, 3072, 30), (7.5, 32, 4096, 36), (18.4, 48, 6144, 40), (39.1, 64, 8192, 48),
    (76.1, 80, 10240, 60), (145.6, 96, 12288, 80), (310.1, 128, 16384, 96), (529.6, 128, 20480, 105),
    (1008.0, 160, 25600, 128)]


def test_gpt2_124m_has_124439808_parameters():
    assert param_count(get_preset("gpt2-124m")) == 124_439_808


@pytest.mark.parametrize("name, expected", [("llama-8b", 8_030_261_248), ("llama-1b", 1_235_814_400)])
def test_llama_parameter_counts_match_model_cards(name, expected):
    assert param_count(get_preset(name)) == expected


@pytest.mark.parametrize("name", ["tiny", "tiny-llama", "gpt2-124m"])
def test_param_count_equals_the_built_model(name):
    cfg = get_preset(name)
    assert param_count(cfg) == sum(p.numel() for p in build_model(cfg).parameters())


@pytest.mark.parametrize("billions, heads, hidden, layers", NARAYANAN_TABLE1)
def test_narayanan_eq2_reproduces_table1(billions, heads, hidden, layers):
    cfg = ModelConfig(hidden=hidden, heads=heads, layers=layers, vocab=51200, seq_len=2048)
    assert round(narayanan_eq2(layers, hidden, 51200, 2048) / 1e9, 1) == pytest.approx(billions, abs=0.051)
    # the exact count differs from Eq. 2 only by the final LayerNorm (2h)
    assert param_count(cfg) - narayanan_eq2(layers, hidden, 51200, 2048) == pytest.approx(2 * hidden)


def test_reference_csv_matches_table_above():
    path = REFERENCE / "narayanan2021_table1_weak_scaling.csv"
    if not path.is_file():
        pytest.skip(f"{path} not beside the checkout")
    rows = list(csv.DictReader(path.open()))
    got = [(float(r["params_billion"]), int(r["attention_heads"]), int(r["hidden_size"]), int(r["num_layers"]))
           for r in rows]
    assert got == NARAYANAN_TABLE1


def test_full_recompute_flops_reproduce_narayanan_eq3():
    for billions, heads, hidden, layers in NARAYANAN_TABLE1:
        cfg = ModelConfig(hidden=hidden, heads=heads, layers=layers, vocab=51200, seq_len=2048)
        batch = 512
        ours = flops_per_token(cfg, recompute="full") * batch * 2048
        assert ours == pytest.approx(narayanan_eq3(batch, 2048, layers, hidden, 51200), rel=1e-12)


def test_flops_variants_are_ordered():
    cfg = get_preset("gpt2-124m")
    base = flops_per_token(cfg)
    assert flops_per_token(cfg, attention=False) < flops_per_token(cfg, causal=True) < base
    assert base < flops_per_token(cfg, recompute="selective") < flops_per_token(cfg, recompute="full")
    assert flops_per_token(cfg, recompute="full:2") < flops_per_token(cfg, recompute="full")
    # 6N rule of thumb without attention (N = matmul weights incl. the LM head)
    assert flops_per_token(cfg, attention=False) == pytest.approx(6 * (85_000_000 + 768 * 50257), rel=0.01)
