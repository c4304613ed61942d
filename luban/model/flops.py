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
* Mixture of experts (``luban.model.moe``): a MoE layer holds the router (E·h), E routed
  experts and the shared experts; a token runs the router, its k routed experts and the
  shared ones. *Total* parameters count every expert, *active* parameters (and all FLOPs,
  hence MFU) only what a token runs. Dropped tokens (capacity factor) are not discounted, nor
  the zero rows a capacity's fixed expert buffers compute (``expert_capacity``): MFU counts the
  model's FLOPs, the planner's time the rows the runtime computes.
"""

from __future__ import annotations

import math

import numpy as np

from luban.model.config import ModelConfig


def expert_capacity(capacity_factor: float, tokens, k: int, experts: int):
    """Rows of each expert's fixed buffer for a micro-batch of ``tokens`` tokens under capacity
    factor c (GShard, Lepikhin et al. 2020): C = ceil(c·T·k/E); 0 where nothing can be dropped
    (dropless, c = 0; or C >= T: an expert gets a token at most once, so the layer runs dropless).
    ``tokens`` a numpy array or scalar (the planner's grid), or a Python or symbolic integer (the
    runtime, ``MoE.capacity``: plain ``math`` there, which ``torch.compile`` traces without a graph
    break; numpy on a traced size broke the graph at a data-dependent read). One formula, both ways."""
    if isinstance(tokens, (np.ndarray, np.generic)):
        with np.errstate(over="ignore"):  # c = 1e308: inf rows, which no expert reaches (dropless)
            capacity = np.ceil(capacity_factor * tokens * k / experts)
        return np.where((capacity_factor > 0) & (capacity < tokens), capacity, 0).astype(np.int64)
    share = capacity_factor * tokens * k / experts
    if not (capacity_factor > 0 and share < tokens):  # dropless, or C >= T (an overflow to inf too: c = 1e308)
        return 0
    capacity = math.ceil(share)
    return capacity if capacity < tokens else 0


def attention_params(cfg: ModelConfig) -> int:
    """Q, K, V and output projections of one layer (weights and biases)."""
    qkv = cfg.hidden * (cfg.q_dim + 2 * cfg.kv_dim)
    out = cfg.q_dim * cfg.hidden
    bias = (cfg.q_dim + 2 * cfg.kv_dim + cfg.hidden) if cfg.bias else 0
    return qkv + out + bias


def ffn_matrices(cfg: ModelConfig) -> int:
    """Weight matrices of one feed-forward network: GELU has up+down, SwiGLU gate+up+down."""
    return 3 if cfg.activation == "swiglu" else 2


def mlp_params(cfg: ModelConfig) -> int:
    """Dense MLP of one layer (weights and biases)."""
    mats = ffn_matrices(cfg)
    weights = mats * cfg.hidden * cfg.ffn_hidden
    bias = ((mats - 1) * cfg.ffn_hidden + cfg.hidden) if cfg.bias else 0
    return weights + bias


def expert_params(cfg: ModelConfig) -> int:
    """One routed or shared expert (no biases)."""
    return ffn_matrices(cfg) * cfg.hidden * cfg.expert_ffn_hidden


def router_params(cfg: ModelConfig) -> int:
    return cfg.experts * cfg.hidden


def moe_params(cfg: ModelConfig, active: bool = False) -> int:
    """Feed-forward of one MoE layer: router + routed experts (all, or the k a token uses) + shared."""
    routed = cfg.experts_per_token if active else cfg.experts
    return router_params(cfg) + (routed + cfg.shared_experts) * expert_params(cfg)


def norm_params(cfg: ModelConfig) -> int:
    """One normalisation layer: LayerNorm has weight and bias, RMSNorm weight only."""
    return 2 * cfg.hidden if cfg.norm == "layernorm" else cfg.hidden


def qk_norm_params(cfg: ModelConfig) -> int:
    return 2 * cfg.head_dim if cfg.qk_norm else 0


def layer_params(cfg: ModelConfig, moe: bool = False, active: bool = False) -> int:
    """One block: a dense one, or (``moe``) one whose feed-forward is a MoE (``active``: per token)."""
    ffn = moe_params(cfg, active) if moe else mlp_params(cfg)
    return attention_params(cfg) + qk_norm_params(cfg) + ffn + 2 * norm_params(cfg)


def over_layers(cfg: ModelConfig, per_layer) -> float:
    """Sum of ``per_layer(moe)`` over the model's dense and MoE layers (``dense_layers`` dense,
    then ``moe_layers`` MoE); the planner divides it by ``layers`` for its average layer."""
    dense = cfg.layers - cfg.moe_layers
    return dense * per_layer(False) + (cfg.moe_layers * per_layer(True) if cfg.moe_layers else 0)


def embedding_params(cfg: ModelConfig) -> int:
    """Token embedding, learned positions, and an untied LM head."""
    n = cfg.vocab * cfg.hidden
    if cfg.position == "learned":
        n += cfg.seq_len * cfg.hidden
    if not cfg.tie_embeddings:
        n += cfg.vocab * cfg.hidden
    return n


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters of ``luban.model.transformer.Transformer(cfg)`` (all experts)."""
    return over_layers(cfg, lambda moe: layer_params(cfg, moe)) + embedding_params(cfg) + norm_params(cfg)


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token uses (equal to ``param_count`` for a dense model)."""
    return over_layers(cfg, lambda moe: layer_params(cfg, moe, active=True)) + embedding_params(cfg) + norm_params(cfg)


def narayanan_eq2(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Narayanan et al. 2021, Eq. 2: P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))."""
    return 12 * layers * hidden**2 * (1 + 13 / (12 * hidden) + (vocab + seq) / (12 * layers * hidden))


def narayanan_eq3(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021, Eq. 3: FLOPs of one iteration with full recompute."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def layer_matmul_flops(cfg: ModelConfig, moe: bool = False) -> int:
    """Forward matmul FLOPs per token of one layer's weight matrices (biases excluded); a MoE
    layer counts the router, the k routed experts and the shared experts a token runs."""
    ffn = (moe_params(cfg, active=True) if moe else ffn_matrices(cfg) * cfg.hidden * cfg.ffn_hidden)
    return 2 * (cfg.hidden * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * cfg.hidden + ffn)


def attention_core_flops(cfg: ModelConfig, seq: int, causal: bool = False) -> float:
    """Forward FLOPs per token of QK^T and AV in one layer."""
    keys = (seq + 1) / 2 if causal else seq
    return 4 * keys * cfg.q_dim


def head_flops(cfg: ModelConfig) -> int:
    """Forward FLOPs per token of the LM head (embedding lookups cost nothing)."""
    return 2 * cfg.hidden * cfg.vocab


def recompute_fraction(recompute: str, layers: int) -> float:
    """Fraction of layers whose forward is repeated: ``full`` = all, ``full:k`` = every k-th."""
    from luban.parallel.layout import parse_recompute

    mode, every = parse_recompute(recompute)
    return recomputed_share(layers, every) if mode == "full" else 0.0


def recomputed_share(layers, every):
    """Share of ``layers`` recomputed by ``full:every`` (layers 0, k, 2k, ...: ⌈l/k⌉ of l);
    ints or numpy arrays (the planner's grids)."""
    return -(-layers // every) / layers


def flops_per_token(cfg: ModelConfig, seq: int | None = None, *, attention: bool = True,
                    causal: bool = False, recompute: str = "none") -> float:
    """Training FLOPs (forward + backward, plus recompute if asked) per token.

    ``recompute="none"`` gives the model FLOPs behind MFU; the layout's recompute mode
    gives the hardware FLOPs behind HFU.
    """
    seq = cfg.seq_len if seq is None else seq
    attn = attention_core_flops(cfg, seq, causal) if attention else 0.0
    layers_fwd = over_layers(cfg, lambda moe: layer_matmul_flops(cfg, moe) + attn)
    total = 3 * (layers_fwd + head_flops(cfg))
    if recompute == "selective":
        total += cfg.layers * attn
    else:
        total += recompute_fraction(recompute, cfg.layers) * layers_fwd
    return total
