"""One decoder-only transformer covering GPT-2 and Llama from a ``ModelConfig``.

GPT-2 (Radford et al. 2019): learned positions, LayerNorm, GELU (tanh approximation), biases,
tied embeddings. Llama (Touvron et al. 2023): RoPE (the ``rotate_half`` convention of Hugging
Face ``transformers``), RMSNorm, SwiGLU, grouped-query attention, untied head. Attention uses
``torch.nn.functional.scaled_dot_product_attention``.

Designed to be sliced by the parallel runtime without changing parameter names:
* blocks live in ``layers``, an ``nn.ModuleDict`` keyed by global layer index, so a pipeline
  stage that deletes the others keeps the same fully qualified names (and so checkpoints
  reshard across layouts);
* ``tok_emb``/``pos_emb`` and ``norm``/``lm_head`` may be ``None`` on middle stages;
* each ``Attention`` calls ``self.attention_fn(q, k, v)`` so context parallel can swap the
  core for a ring/all-to-all version, and takes explicit ``positions``;
* ``init_weights`` seeds every parameter from (seed, its name), so any layout that builds
  any subset of the model initialises it bit-identically to the single-process model.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from luban.model.config import ModelConfig
from luban.model.head_loss import chunked_head_loss, lm_loss
from luban.model.moe import MoE, is_moe_layer


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float = 0.0) -> torch.Tensor:
    """SDPA with a causal mask; q is [b, heads, s, d], k/v [b, kv_heads, s, d]."""
    if k.shape[1] != q.shape[1]:  # grouped-query attention: share each kv head among heads/kv_heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)


def rope_tables(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [s, head_dim] for the given positions (Su et al. 2021, RoFormer), on
    ``positions``' device. Each entry depends on its position only, so a row of a longer table
    equals the row computed alone (the model caches one table per device: ``Transformer.rope``)."""
    arange = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=positions.device)
    inv = 1.0 / (cfg.rope_theta ** (arange / cfg.head_dim))
    angles = positions.to(torch.float32)[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [b, s, heads, d] by the position angles (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)


def head_norm(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """qk-norm of one head's query or key. Under autocast the heads come out of their projection
    in bf16/fp16 while the norm's weight stays fp32; ``rms_norm`` with mixed dtypes cannot use the
    fused kernel (torch warns and decomposes it into ~8 element-wise kernels that save ~6x the
    input's bytes for backward), so the head goes in as fp32 and comes back in its dtype: the
    same arithmetic (the decomposition computes in fp32 and rounds once), one fused kernel."""
    if x.dtype == norm.weight.dtype:
        return norm(x)
    return norm(x.float()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.wq = nn.Linear(cfg.hidden, cfg.q_dim, bias=cfg.bias)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_dim, bias=cfg.bias)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_dim, bias=cfg.bias)
        self.wo = nn.Linear(cfg.q_dim, cfg.hidden, bias=cfg.bias)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's query and key
            self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
            self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
        self.qk_norm = cfg.qk_norm
        self.attention_fn = causal_attention
        self.recompute_core = False  # checkpoint the core alone (Korthikanti et al. 2022, Sec. 4.2)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.qk_norm:
            q, k = head_norm(self.q_norm, q), head_norm(self.k_norm, k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        if self.recompute_core:
            out = checkpoint(self.attention_fn, q, k, v, dropout, use_reentrant=False)
        else:
            out = self.attention_fn(q, k, v, dropout)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        if self.swiglu:
            self.w_gate = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=cfg.bias)
        self.w_up = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=cfg.bias)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
        return self.w_down(F.gelu(self.w_up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.norm2 = make_norm(cfg)
        self.mlp = MoE(cfg) if is_moe_layer(cfg, layer) else MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        # checkpoint this block, saving what ``checkpoint_context`` says (nothing: full recompute;
        # an op policy: selective); set by ``luban.parallel.recompute.apply_recompute``
        self.recompute = False
        self.checkpoint_context = noop_context_fn

    def _forward(self, x, rope):
        x = x + self.drop(self.attn(self.norm1(x), rope))
        return x + self.drop(self.mlp(self.norm2(x)))

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            if self.checkpoint_context is noop_context_fn:  # full recompute: checkpoint's default, not passed
                # (torch 2.13's Dynamo refuses any context_fn given, even this one: a compiled block stopped)
                return checkpoint(self._forward, x, rope, use_reentrant=False)
            return checkpoint(self._forward, x, rope, use_reentrant=False, context_fn=self.checkpoint_context)
        return self._forward(x, rope)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.layers)})
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self._rope_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.head_loss = chunked_head_loss  # (h, head weight, labels) -> loss; compiled: apply_compile

    def rope(self, positions: torch.Tensor | None, length: int, device: torch.device,
             span: int | None = None):
        """cos/sin for ``positions`` (default ``0..length-1``) from a table built on that device
        (never on the host per forward) and kept per device: of the first ``length`` positions
        (``span`` where ``positions`` are given: the bound the caller knows they lie below, e.g.
        context parallel's whole sequence) rounded up to a power of two, grown when a longer one
        comes; of all ``seq_len`` positions where ``positions`` come without ``span`` (reading their
        largest would wait for the device). A table of all ``seq_len`` positions at once cost
        8·seq_len·head_dim bytes whatever was run: 17 GB for an imported model with
        ``max_position_embeddings`` 2^24 sampled from a short prompt (2026-11-28), and under cp
        whatever the sequence (until 2026-12-02). Rows do not depend on the table's length
        (``rope_tables``)."""
        needed = length if positions is None else span
        rows = self.cfg.seq_len if needed is None else min(self.cfg.seq_len, 1 << (max(needed, 1) - 1).bit_length())
        table = self._rope_cache.get(device)
        if table is None or table[0].shape[0] < rows:
            table = rope_tables(self.cfg, torch.arange(rows, device=device))
            self._rope_cache[device] = table
        if positions is None:
            return table[0][:length], table[1][:length]
        return table[0][positions], table[1][positions]

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, *, span: int | None = None) -> torch.Tensor:
        """Token ids [b, s] (or hidden states on a non-first pipeline stage) -> logits [b, s, V]
        (or hidden states on a non-last stage). ``positions`` default to 0..s-1; ``span``, where
        given, is a bound they lie below (it sizes the rope table: ``rope``). With ``labels``
        the part holding the head returns the mean loss instead, the head and the loss fused
        (``luban.model.head_loss``: no logits tensor, no fp32 copy of it)."""
        length = x.shape[1]
        if self.tok_emb is not None:
            h = self.tok_emb(x)
            if self.pos_emb is not None:
                h = h + self.pos_emb(torch.arange(length, device=x.device) if positions is None else positions)
            x = self.drop(h)
        rope = self.rope(positions, length, x.device, span) if self.cfg.position == "rope" else None
        for block in self.layers.values():
            x = block(x, rope)
        if self.norm is not None:
            x = self.norm(x)
        if self.lm_head is not None:
            if labels is not None:
                return self.head_loss(x, self.lm_head.weight, labels)
            x = self.lm_head(x)
        return x


def init_weights(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """GPT-2 initialisation: N(0, σ) weights, residual output projections N(0, σ/√(2l)),
    zero biases, unit norms, zero buffers (the MoE router's balancing bias). Each tensor draws
    from a generator seeded by (seed, name); a stacked MoE weight [E, ...] draws expert by
    expert from (seed, name.e), so expert parallel can build any subset of the experts."""
    residual_std = cfg.init_std / math.sqrt(2 * cfg.layers)
    norms = {f"{mod_name}.{leaf}" for mod_name, mod in model.named_modules()
             if isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) for leaf, _ in mod.named_parameters(recurse=False)}
    with torch.no_grad():
        for _, buf in model.named_buffers():
            buf.zero_()
        for name, p in model.named_parameters():
            if name in norms:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                std = residual_std if name.endswith(RESIDUAL_OUTPUTS) else cfg.init_std
                offset = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "expert_offset", None) \
                    if "experts." in name else None
                if offset is None:
                    p.copy_(_normal(seed, name, std, p.shape, p.dtype))
                else:  # stacked experts: one draw per global expert index
                    for e in range(p.shape[0]):
                        p[e].copy_(_normal(seed, f"{name}.{offset + e}", std, p.shape[1:], p.dtype))


# the projections writing into the residual stream (scaled by 1/sqrt(2l), GPT-2)
RESIDUAL_OUTPUTS = ("attn.wo.weight", "mlp.w_down.weight", "mlp.experts.w_down", "mlp.shared.w_down.weight")


def _normal(seed: int, name: str, std: float, shape, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.normal(0.0, std, tuple(shape), generator=gen).to(dtype)


def build_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    model = Transformer(cfg)
    init_weights(model, cfg, seed)
    return model


__all__ = ["Transformer", "build_model", "init_weights", "lm_loss"]
