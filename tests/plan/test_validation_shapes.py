"""Every validation row is planned on the model its source ran: the parameter count of each
row's ``ModelConfig`` equals the published size. (Until 2026-11-26 ``ModelConfig(arch="llama",
...)`` without explicit parts built GPT-2's LayerNorm/GELU/learned-position/bias layers, so every
Llama-shaped row -- Llama 3, Qwen3, GPT-OSS, torchtitan's -- was planned with a two-matrix GELU MLP,
and the H100 profile's constants were fitted to those wrong shapes; nothing checked the sizes.)"""

from __future__ import annotations

import pytest

from luban.model import flops
from luban.model.config import DEFAULT_PRESET, ModelConfig
from luban.model.presets import get_preset
from luban.plan import validate

# published sizes (billions of parameters): Llama 3 paper (arXiv 2407.21783) Table 3; Qwen3 technical
# report (arXiv 2505.09388) Tables 1-2 (total / activated); OpenAI gpt-oss model card (116.83B total);
# MosaicML MPT model cards and llm-foundry yamls (the sizes in the benchmark table's names); BLOOM 176B;
# MT-NLG 530B (Smith et al. 2022); nanotron scripts/scaling_benchmarks.py estimate_num_params
PUBLISHED = {"LLAMA3_8B": 8.03, "LLAMA3_70B": 70.6, "LLAMA3.1_405B": 405.9, "llama3.1-8b": 8.03, "llama3.1-70b": 70.6,
             "Qwen3_30B_a3B": 30.5, "GPT OSS 120B": 116.8, "qwen3-235b-a22b": 235.1,
             "mpt-7b": 6.7, "mpt-30b": 30.0, "bloom-176b": 176.2, "mt-nlg-530b": 530.0,
             "nanotron-1.34b": 1.34, "nanotron-3.57b": 3.57, "nanotron-8.86b": 8.86, "nanotron-80b": 80.0}
ACTIVATED = {"Qwen3_30B_a3B": 3.3, "qwen3-235b-a22b": 22.0}


def models() -> dict:
    out = {}
    for r in validate.read_table("megatron_bridge_h100_dense.csv"):
        out[r["model_as_published"]] = validate._llama(r, 8192)
    for r in validate.read_table(validate.MOE_TABLE):
        if not r["model_as_published"].startswith("Nemotron"):
            out[r["model_as_published"]] = validate._moe_model(r)
    out["qwen3-235b-a22b"] = validate.QWEN3_235B
    for name in ("torchtitan_llama3_h100.csv", "trainy_torchtitan_h200.csv", "mosaicml_llm_foundry_throughput.csv",
                 "megatron_deepspeed_a100.csv", "nanotron_scaling_h100.csv"):
        for r in validate.read_source_table(name):
            out[r["model"]] = validate._source_model(r)
    return out


def test_llama_arch_means_llama_parts():
    cfg = ModelConfig(arch="llama", hidden=64, layers=1, heads=4)
    assert (cfg.norm, cfg.activation, cfg.position, cfg.bias, cfg.tie_embeddings) == ("rmsnorm", "swiglu", "rope", False, False)
    assert ModelConfig(arch="llama", hidden=64, heads=4, norm="layernorm", bias=True).norm == "layernorm"  # given: kept
    # a table's keys not given come from the default preset (tiny: GPT-2's parts), for train and plan alike
    tiny = get_preset(DEFAULT_PRESET)
    assert ModelConfig.from_dict({}) == tiny and (tiny.arch, tiny.norm) == ("gpt2", "layernorm")
    assert ModelConfig(arch="llama", hidden=64, heads=4, layers=tiny.layers, vocab=tiny.vocab, seq_len=tiny.seq_len,
                       expert_ffn_hidden=tiny.expert_ffn_hidden) == ModelConfig.from_dict({"arch": "llama", "hidden": 64,
                                                                                           "heads": 4})


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_validation_rows_have_their_published_sizes(name):
    cfg = models()[name]
    assert flops.param_count(cfg) / 1e9 == pytest.approx(PUBLISHED[name], rel=0.01), (name, cfg)
    if name in ACTIVATED:
        assert flops.active_param_count(cfg) / 1e9 == pytest.approx(ACTIVATED[name], rel=0.03), name
