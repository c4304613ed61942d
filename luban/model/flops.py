"""Parameter counts and FLOPs per token: the one place these formulas live.

The trainer's MFU/HFU, the planner's compute time and the tests all call this module.

Counting rules (per token, one multiply-add = 2 FLOPs):
* Matmuls: a weight matrix of n entries costs 2n FLOPs forward, 4n backward (input and
  weight gradients), so a full step costs 6n (Kaplan et al. 2020; Narayanan et al. 2021).
* Attention core: QK^T and AV each cost 2·s·(heads·head_dim) per token and layer forward.
  By default the full (non-causal) s×s product is counted, as Megatron-LM and PaLM
  (Chowdhery et al. 2022, App. B) do; ``causal=True`` counts only the (s+1)/2 keys a token
  actually attends to on average.
* Recompute (HFU only): ``full`` repeats the forward of the recomputed layers (not the LM
  head), ``selective`` repeats the attention core (Korthikanti et al. 2022, Sec. 4.2).
  With full recompute this reproduces Narayanan Eq. 3:
  F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)).
* Norms, biases, activations and softmax are not counted (they are <1% for real shapes).
"""

from __future__ import annotations

from luban.model.config import ModelConfig


def attention_params(cfg: ModelConfig) -> int:
    """Q, K, V and output projections of one layer (weights and biases)."""
    qkv = cfg.hidden * (cfg.q_dim + 2 * cfg.kv_dim)
    out = cfg.q_dim * cfg.hidden
    bias = (cfg.q_dim + 2 * cfg.kv_dim + cfg.hidden) if cfg.bias else 0
    return qkv + out + bias


def mlp_params(cfg: ModelConfig) -> int:
    """MLP of one layer: GELU has up+down, SwiGLU gate+up+down."""
    mats = 3 if cfg.activation == "swiglu" else 2
    weights = mats * cfg.hidden * cfg.ffn_hidden
    bias = ((mats - 1) * cfg.ffn_hidden + cfg.hidden) if cfg.bias else 0
    return weights + bias


def norm_params(cfg: ModelConfig) -> int:
    """One normalisation layer: LayerNorm has weight and bias, RMSNorm weight only."""
    return 2 * cfg.hidden if cfg.norm == "layernorm" else cfg.hidden


def layer_params(cfg: ModelConfig) -> int:
    return attention_params(cfg) + mlp_params(cfg) + 2 * norm_params(cfg)


def embedding_params(cfg: ModelConfig) -> int:
    """Token embedding, learned positions, and an untied LM head."""
    n = cfg.vocab * cfg.hidden
    if cfg.position == "learned":
        n += cfg.seq_len * cfg.hidden
    if not cfg.tie_embeddings:
        n += cfg.vocab * cfg.hidden
    return n


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters of ``luban.model.transformer.Transformer(cfg)``."""
    return cfg.layers * layer_params(cfg) + embedding_params(cfg) + norm_params(cfg)


def narayanan_eq2(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Narayanan et al. 2021, Eq. 2: P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))."""
    return 12 * layers * hidden**2 * (1 + 13 / (12 * hidden) + (vocab + seq) / (12 * layers * hidden))


def narayanan_eq3(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021, Eq. 3: FLOPs of one iteration with full recompute."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def layer_matmul_flops(cfg: ModelConfig) -> int:
    """Forward matmul FLOPs per token of one layer's weight matrices (biases excluded)."""
    mats = 3 if cfg.activation == "swiglu" else 2
    return 2 * (cfg.hidden * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * cfg.hidden + mats * cfg.hidden * cfg.ffn_hidden)


def attention_core_flops(cfg: ModelConfig, seq: int, causal: bool = False) -> float:
    """Forward FLOPs per token of QK^T and AV in one layer."""
    keys = (seq + 1) / 2 if causal else seq
    return 4 * keys * cfg.q_dim


def head_flops(cfg: ModelConfig) -> int:
    """Forward FLOPs per token of the LM head (embedding lookups cost nothing)."""
    return 2 * cfg.hidden * cfg.vocab


def recompute_fraction(recompute: str, layers: int) -> float:
    """Fraction of layers whose forward is repeated: ``full`` = all, ``full:k`` = every k-th."""
    if recompute.startswith("full"):
        every = int(recompute.split(":")[1]) if ":" in recompute else 1
        return len(range(0, layers, every)) / layers
    return 0.0


def flops_per_token(cfg: ModelConfig, seq: int | None = None, *, attention: bool = True,
                    causal: bool = False, recompute: str = "none") -> float:
    """Training FLOPs (forward + backward, plus recompute if asked) per token.

    ``recompute="none"`` gives the model FLOPs behind MFU; the layout's recompute mode
    gives the hardware FLOPs behind HFU.
    """
    seq = cfg.seq_len if seq is None else seq
    attn = attention_core_flops(cfg, seq, causal) if attention else 0.0
    layer_fwd = layer_matmul_flops(cfg) + attn
    total = 3 * (cfg.layers * layer_fwd + head_flops(cfg))
    if recompute == "selective":
        total += cfg.layers * attn
    else:
        total += recompute_fraction(recompute, cfg.layers) * cfg.layers * layer_fwd
    return total
