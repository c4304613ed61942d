"""Hostile review of the Hugging Face interchange and sampling (2026-11-28): what a config.json
transformers would read as another model, and what a sampling temperature did to finite logits."""

import json

import pytest
import torch

from luban.errors import LubanError
from luban.model import get_preset
from luban.model.hf import read_config
from luban.model.transformer import build_model
from luban.train.sample import generate

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=61,
            max_position_embeddings=64, intermediate_size=48, num_experts_per_tok=2)
MOE = {"mixtral": dict(TINY, model_type="mixtral"),
       "qwen3_moe": dict(TINY, model_type="qwen3_moe", moe_intermediate_size=24, norm_topk_prob=True)}


@pytest.mark.parametrize("kind", list(MOE))
def test_two_different_expert_counts_are_refused_naming_both(kind):
    """``num_experts`` and ``num_local_experts`` name one count (transformers 5's attribute_map). With both,
    different, transformers 5.24 built Qwen3-MoE from num_local_experts and Mixtral from num_experts, while
    luban read the other one of the two for each (a Mixtral folder of 4 experts saying num_experts = 8 was
    imported with 4, one that transformers refuses to load): now one line names both."""
    raw = dict(MOE[kind], num_experts=4, num_local_experts=8)
    with pytest.raises(LubanError, match=r"^config\.json: (num_experts = 4, num_local_experts = 8|num_local_experts = 8, "
                                         r"num_experts = 4): one value expected .*; keep one of the two$"):
        read_config(raw)
    for one in ({"num_experts": 4}, {"num_local_experts": 4}, {"num_experts": 4, "num_local_experts": 4}):
        cfg, _, _ = read_config(dict(MOE[kind], **one))
        assert cfg.experts == 4, (kind, one)


def test_mixtral_expert_count_under_its_alias_is_read():
    """A Mixtral config.json giving ``num_experts`` only: transformers 5 reads it (alias of num_local_experts);
    luban took MixtralConfig's default of 8 instead and then refused the weights of 4 experts as missing."""
    raw = dict(MOE["mixtral"], num_experts=4)
    assert read_config(raw)[0].experts == 4
    transformers = pytest.importorskip("transformers")
    assert transformers.MixtralConfig.from_dict(json.loads(json.dumps(raw))).num_local_experts == 4


GPT2 = dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=61)


def test_gpt2_keys_under_transformers_aliases():
    """GPT-2's config reads hidden_size, max_position_embeddings, num_attention_heads, num_hidden_layers as
    n_embd, n_positions, n_head, n_layer (attribute_map). A file with n_layer = 2 and num_hidden_layers = 1
    was imported with 2 layers where transformers built 1 (logits 3.7 apart); one giving the aliases only,
    which transformers loads, was refused as "n_embd missing"."""
    with pytest.raises(LubanError, match=r"^config\.json: n_layer = 2, num_hidden_layers = 1: one value expected"):
        read_config(dict(GPT2, num_hidden_layers=1))
    aliased = dict(model_type="gpt2", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=64, vocab_size=61)
    assert read_config(aliased)[0] == read_config(GPT2)[0]
    assert read_config(dict(GPT2, num_hidden_layers=2))[0] == read_config(GPT2)[0]
    with pytest.raises(LubanError, match=r"^config\.json: num_attention_heads = 3: must divide hidden_size = 32"):
        read_config(dict(aliased, num_attention_heads=3))  # a refusal names the key the file gives


def test_low_temperature_on_large_finite_logits_samples_the_likeliest_token():
    """Finite weights whose logits are large (6e35: a run near divergence) divided by --temperature 0.001
    overflowed to inf: softmax gave NaN and torch.multinomial raised (a traceback from ``luban sample``).
    The logits are now shifted by their maximum first: at such a temperature every draw is the argmax."""
    cfg = get_preset("tiny").replace(layers=1, vocab=64, seq_len=16)
    model = build_model(cfg).eval()
    with torch.no_grad():
        model.norm.weight.mul_(1e36)  # the final norm's scale multiplies every logit
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all()
    greedy = generate(model, [1, 2, 3], 4, temperature=0)
    for top_k in (0, 5):
        assert generate(model, [1, 2, 3], 4, temperature=1e-3, top_k=top_k) == greedy


LLAMA = dict(TINY, model_type="llama")


@pytest.mark.parametrize("factor, message", [
    (float("nan"), "factor = nan: a finite number"), (1e16, r"factor = 1e\+16: a finite number"),
    ("2", "factor = '2': a finite number"), (None, "factor missing: NTK 'dynamic' RoPE needs it")])
def test_ntk_dynamic_factor_that_changes_transformers_base_is_refused(factor, message):
    """transformers computes dynamic NTK's base at every length, within max_position_embeddings too:
    rope_theta * (factor - (factor - 1)) ** (d / (d - 2)). A NaN factor, or 1e16 (the difference rounds
    to 0), gave it NaN logits, and without a factor it built no model; luban imported each as "exact"
    (its warning) with plain RoPE. Ordinary factors stay accepted."""
    rope = {"rope_type": "dynamic", "rope_theta": 1e4, **({} if factor is None else {"factor": factor})}
    with pytest.raises(LubanError, match="^config.json: rope_parameters: " + message):
        read_config(dict(LLAMA, rope_parameters=rope))
    for ok in (1.1, 2.0, 8, 32.0):
        cfg, extra, notes = read_config(dict(LLAMA, rope_parameters={**rope, "factor": ok}))
        assert cfg.rope_theta == 1e4 and "rope_parameters" in extra and notes


@pytest.mark.parametrize("key", ["rms_norm_eps", "rope_theta", "initializer_range"])
def test_a_number_too_large_for_a_float_is_one_line(key):
    """JSON integers have no size limit: rms_norm_eps = 10**400 raised OverflowError from math.isfinite
    (a traceback from ``luban import``); now it is refused as not a finite number."""
    with pytest.raises(LubanError, match=rf"^config\.json: {key} = 1000+(\.\.\.)?: a finite number >= 0$"):
        read_config(dict(LLAMA, **{key: 10 ** 400}))
    with pytest.raises(LubanError, match=r"factor = 1000+(\.\.\.)?: a finite number"):
        read_config(dict(LLAMA, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 10 ** 400}))


def test_rope_table_grows_with_the_lengths_run_not_the_models_seq_len():
    """An imported model with ``max_position_embeddings`` 2^24 sampled from a short prompt built a
    table of every position first: 8 * 2^24 * head_dim bytes (17 GB at head_dim 128). The table now
    covers the lengths run (rounded up to a power of two), and its rows are those of a full table."""
    import dataclasses

    import torch

    from luban.model.presets import get_preset
    from luban.model.transformer import Transformer, rope_tables

    cfg = dataclasses.replace(get_preset("tiny-llama"), seq_len=1 << 24)
    model = Transformer(cfg)
    cpu = torch.device("cpu")
    for length, rows in ((3, 4), (4, 4), (5, 8), (2, 8), (17, 32)):
        cos, sin = model.rope(None, length, cpu)
        assert model._rope_cache[cpu][0].shape[0] == rows
        full_cos, full_sin = rope_tables(dataclasses.replace(cfg, seq_len=64), torch.arange(64))
        assert torch.equal(cos, full_cos[:length]) and torch.equal(sin, full_sin[:length])
    short = dataclasses.replace(cfg, seq_len=6)
    assert Transformer(short).rope(None, 5, cpu)[0].shape[0] == 5  # capped at seq_len: 6 rows, 5 read
