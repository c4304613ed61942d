"""Named model shapes: GPT-2, Llama-style, and the models of the papers the planner is checked against.

Sources: GPT-2 (Radford et al. 2019, HF ``gpt2*`` configs); Llama 3 / 3.1 / 3.2 model cards
(1B, 8B, 70B, 405B); Megatron GPT models of Narayanan et al. SC'21 Table 1 and Korthikanti
et al. 2022 Table 5 (vocab 51200, seq 2048); the Calculon repository's model files
(``../shared/reference/calculon_model_jsons.csv``; gpt3-13B hidden corrected to 5120).
Mixtures of experts: Mixtral 8x7B (Jiang et al. 2024; HF ``mistralai/Mixtral-8x7B-v0.1``
config.json), Qwen3-30B-A3B (HF ``Qwen/Qwen3-30B-A3B`` config.json), DeepSeek-V3 (Liu et al.
2024, Table/App. B and HF ``deepseek-ai/DeepSeek-V3`` config.json: the MoE part; MLA is
replaced by multi-head attention with 128 heads of 128, YaRN by plain RoPE at 4K, group-limited
routing and the routed scaling factor are not modelled, the MTP module is left out).
"""

from __future__ import annotations

from luban.errors import bad_value
from luban.model.config import ModelConfig


def _gpt2(name, hidden, layers, heads):
    return ModelConfig(name=name, arch="gpt2", hidden=hidden, layers=layers, heads=heads, vocab=50257, seq_len=1024)


def _megatron(name, hidden, layers, heads, head_dim=0, ffn=0, seq=2048):
    return ModelConfig(name=name, arch="gpt2", hidden=hidden, layers=layers, heads=heads, head_dim=head_dim,
                       ffn_hidden=ffn, vocab=51200, seq_len=seq)


def _llama(name, hidden, layers, heads, ffn, vocab=128256, tie=False, kv_heads=8):
    return ModelConfig(name=name, arch="llama", hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                       ffn_hidden=ffn, vocab=vocab, seq_len=8192, tie_embeddings=tie, rope_theta=500000.0)


_PRESETS = [
    # demo models that train in minutes on a CPU (byte-level vocabulary: 256 bytes + end-of-document)
    ModelConfig(name="tiny", arch="gpt2", hidden=128, layers=4, heads=4, vocab=257, seq_len=128),
    ModelConfig(name="tiny-llama", arch="llama", hidden=128, layers=4, heads=4, kv_heads=2, ffn_hidden=352,
                vocab=257, seq_len=128),
    ModelConfig(name="tiny-moe", arch="llama", hidden=128, layers=4, heads=4, kv_heads=2, ffn_hidden=352,
                vocab=257, seq_len=128, experts=8, experts_per_token=2, expert_ffn_hidden=64,
                shared_experts=1, dense_layers=1, router="sigmoid"),
    _gpt2("gpt2-124m", 768, 12, 12),
    _gpt2("gpt2-355m", 1024, 24, 16),
    _gpt2("gpt2-774m", 1280, 36, 20),
    _gpt2("gpt2-1.5b", 1600, 48, 25),
    _llama("llama-1b", 2048, 16, 32, 8192, tie=True),
    _llama("llama-8b", 4096, 32, 32, 14336),
    _llama("llama-70b", 8192, 80, 64, 28672),
    _llama("llama-405b", 16384, 126, 128, 53248),
    # Narayanan et al. 2021, Table 1
    _megatron("megatron-1.7b", 2304, 24, 24),
    _megatron("megatron-3.6b", 3072, 30, 32),
    _megatron("megatron-7.5b", 4096, 36, 32),
    _megatron("megatron-18.4b", 6144, 40, 48),
    _megatron("megatron-39.1b", 8192, 48, 64),
    _megatron("megatron-76.1b", 10240, 60, 80),
    _megatron("megatron-145.6b", 12288, 80, 96),
    _megatron("megatron-310.1b", 16384, 96, 128),
    _megatron("megatron-529.6b", 20480, 105, 128),
    _megatron("megatron-1t", 25600, 128, 160),
    # Korthikanti et al. 2022, Table 5 (megatron-1t above is the same shape)
    _megatron("megatron-22b", 6144, 48, 64),
    _megatron("gpt3-175b", 12288, 96, 96),
    _megatron("turing-530b", 20480, 105, 128),
    # Calculon model files
    _megatron("megatron-126m", 768, 12, 16, head_dim=48),
    _megatron("megatron-5b", 4096, 24, 32),
    _megatron("megatron-40b", 8192, 48, 64),
    _megatron("gpt3-13b", 5120, 40, 40),
    _megatron("anthropic-52b", 8192, 64, 64, seq=8192),
    _megatron("chinchilla", 8192, 80, 64),
    _megatron("gopher-280b", 16384, 80, 128),
    _megatron("lamda", 8192, 64, 128, head_dim=128, ffn=65536),
    _megatron("palm-540b", 18432, 118, 48, head_dim=256),
    # mixtures of experts (sources in the module docstring)
    _llama("mixtral-8x7b", 4096, 32, 32, 14336, vocab=32000).replace(
        seq_len=32768, rope_theta=1e6, experts=8, experts_per_token=2, expert_ffn_hidden=14336, aux_loss_coef=0.02),
    _llama("qwen3-30b-a3b", 2048, 48, 32, 6144, vocab=151936, kv_heads=4).replace(
        head_dim=128, seq_len=40960, rope_theta=1e6, norm_eps=1e-6, qk_norm=True, experts=128, experts_per_token=8,
        expert_ffn_hidden=768, aux_loss_coef=0.001),
    _llama("deepseek-v3", 7168, 61, 128, 18432, vocab=129280, kv_heads=128).replace(
        head_dim=128, seq_len=4096, norm_eps=1e-6, experts=256, experts_per_token=8, expert_ffn_hidden=2048,
        shared_experts=1, dense_layers=3, router="sigmoid", router_bias_rate=0.001, aux_loss_coef=0.0001),
]
PRESETS: dict[str, ModelConfig] = {m.name: m for m in _PRESETS}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except (KeyError, TypeError):  # TypeError: a list or table from a file (unhashable)
        raise bad_value("model.preset", name, f"one of {', '.join(PRESETS)}") from None
