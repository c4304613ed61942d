"""Hugging Face ``transformers`` interop: export to / import from ``GPT2LMHeadModel``,
``LlamaForCausalLM``, ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM`` folders
(``config.json`` + ``model.safetensors``).

The mapping is a table of (luban name, HF name, transpose?) per layer; GPT-2 stores its
projections as ``Conv1D`` (weight [in, out]) with Q, K, V fused in ``c_attn``. Export then
import gives back bit-identical tensors.

Mixtures of experts are written in the Hub's per-expert layout (what the published
Mixtral and Qwen3-MoE checkpoints use; ``transformers`` 5 fuses it on load): luban's
stacked ``experts.w_gate/w_up/w_down [E, ...]`` become ``experts.{e}.w1/w3/w2`` (Mixtral,
under ``block_sparse_moe``) or ``experts.{e}.gate_proj/up_proj/down_proj`` (Qwen3-MoE,
under ``mlp``), the router ``mlp.gate``. Both routers are softmax top-k renormalised
(Qwen3-MoE with ``norm_topk_prob = true``), as luban's ``softmax`` router. Mixtral takes
models without qk-norm, shared experts or dense layers; Qwen3-MoE needs ``qk_norm`` and
keeps dense layers as ``mlp_only_layers``. Shared experts, the ``sigmoid`` router (whose
DeepSeek-V3 format adds group routing and a scaling factor) and biases have no equivalent
in these two and are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from luban.errors import LubanError
from luban.model.config import ModelConfig

GPT2_LAYER = [("norm1", "ln_1", False), ("norm2", "ln_2", False), ("attn.wo", "attn.c_proj", True),
              ("mlp.w_up", "mlp.c_fc", True), ("mlp.w_down", "mlp.c_proj", True)]
LLAMA_LAYER = [("norm1", "input_layernorm", False), ("norm2", "post_attention_layernorm", False),
               ("attn.wq", "self_attn.q_proj", False), ("attn.wk", "self_attn.k_proj", False),
               ("attn.wv", "self_attn.v_proj", False), ("attn.wo", "self_attn.o_proj", False),
               ("mlp.w_gate", "mlp.gate_proj", False), ("mlp.w_up", "mlp.up_proj", False),
               ("mlp.w_down", "mlp.down_proj", False)]


MOE_EXPERT = {"mixtral": ("block_sparse_moe", [("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")]),
              "qwen3_moe": ("mlp", [("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")])}


def _family(cfg: ModelConfig) -> str:
    gpt2 = dict(norm="layernorm", activation="gelu", position="learned", bias=True)
    llama = dict(norm="rmsnorm", activation="swiglu", position="rope")
    if cfg.moe:
        return _moe_family(cfg)
    if cfg.qk_norm:
        raise LubanError("model.qk_norm = true: a dense model with qk-norm has no Hugging Face equivalent here "
                         "(Qwen3-MoE export needs experts > 0)")
    if all(getattr(cfg, k) == v for k, v in gpt2.items()) and cfg.kv_heads == cfg.heads \
            and cfg.head_dim * cfg.heads == cfg.hidden:
        return "gpt2"
    if all(getattr(cfg, k) == v for k, v in llama.items()):
        return "llama"
    raise LubanError(f"model (arch={cfg.arch}, norm={cfg.norm}, activation={cfg.activation}, position={cfg.position}) "
                     "has no Hugging Face equivalent: GPT-2 needs layernorm+gelu+learned+bias, Llama rmsnorm+swiglu+rope")


def _moe_family(cfg: ModelConfig) -> str:
    """Mixtral (no qk-norm, every layer MoE) or Qwen3-MoE (qk-norm); one line for what neither has."""
    needs = {"norm": "rmsnorm", "activation": "swiglu", "position": "rope", "bias": False, "router": "softmax",
             "shared_experts": 0}
    for key, value in needs.items():
        if getattr(cfg, key) != value:
            raise LubanError(f"model.{key} = {getattr(cfg, key)!r}: a MoE model exports to Hugging Face "
                             f"(Mixtral, Qwen3-MoE) only with {key} = {value!r}")
    if cfg.qk_norm:
        return "qwen3_moe"
    if cfg.dense_layers:
        raise LubanError(f"model.dense_layers = {cfg.dense_layers}: Mixtral has no dense layers "
                         "(Qwen3-MoE has, with qk_norm = true)")
    return "mixtral"


def _pairs(cfg: ModelConfig, family: str):
    """(luban key, HF key, transpose) for every tensor except GPT-2's fused QKV."""
    if family == "gpt2":
        yield "tok_emb.weight", "transformer.wte.weight", False
        yield "pos_emb.weight", "transformer.wpe.weight", False
        for i in range(cfg.layers):
            for ours, theirs, t in GPT2_LAYER:
                yield f"layers.{i}.{ours}.weight", f"transformer.h.{i}.{theirs}.weight", t
                yield f"layers.{i}.{ours}.bias", f"transformer.h.{i}.{theirs}.bias", False
        yield "norm.weight", "transformer.ln_f.weight", False
        yield "norm.bias", "transformer.ln_f.bias", False
    else:
        from luban.model.moe import is_moe_layer

        yield "tok_emb.weight", "model.embed_tokens.weight", False
        for i in range(cfg.layers):
            for ours, theirs, _ in LLAMA_LAYER:
                if is_moe_layer(cfg, i) and ours.startswith("mlp."):
                    continue
                yield f"layers.{i}.{ours}.weight", f"model.layers.{i}.{theirs}.weight", False
                if cfg.bias and "norm" not in ours:
                    yield f"layers.{i}.{ours}.bias", f"model.layers.{i}.{theirs}.bias", False
            if cfg.qk_norm:
                for n in ("q_norm", "k_norm"):
                    yield f"layers.{i}.attn.{n}.weight", f"model.layers.{i}.self_attn.{n}.weight", False
            if is_moe_layer(cfg, i):
                block, _ = MOE_EXPERT[family]
                yield f"layers.{i}.mlp.router.weight", f"model.layers.{i}.{block}.gate.weight", False
        yield "norm.weight", "model.norm.weight", False
    if not cfg.tie_embeddings:
        yield "lm_head.weight", "lm_head.weight", False


def hf_config(cfg: ModelConfig, family: str) -> dict:
    if family == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab,
                "n_positions": cfg.seq_len, "n_embd": cfg.hidden, "n_layer": cfg.layers, "n_head": cfg.heads,
                "n_inner": cfg.ffn_hidden, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
                "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
                "torch_dtype": "float32"}
    common = {"vocab_size": cfg.vocab, "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers,
              "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
              "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
              "hidden_act": "silu", "attention_bias": cfg.bias, "attention_dropout": cfg.dropout,
              "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32"}
    if family == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common,
                "intermediate_size": cfg.expert_ffn_hidden, "num_local_experts": cfg.experts,
                "num_experts_per_tok": cfg.experts_per_token, "router_aux_loss_coef": cfg.aux_loss_coef,
                "sliding_window": None}
    if family == "qwen3_moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common,
                "intermediate_size": cfg.ffn_hidden, "moe_intermediate_size": cfg.expert_ffn_hidden,
                "num_experts": cfg.experts, "num_experts_per_tok": cfg.experts_per_token, "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": list(range(cfg.dense_layers)),
                "router_aux_loss_coef": cfg.aux_loss_coef, "use_sliding_window": False}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "intermediate_size": cfg.ffn_hidden, "mlp_bias": cfg.bias}


def _expert_pairs(cfg: ModelConfig, family: str):
    """(luban stacked key, HF per-expert key pattern with {e}) for every MoE layer."""
    from luban.model.moe import is_moe_layer

    if family not in MOE_EXPERT:
        return
    block, names = MOE_EXPERT[family]
    for i in range(cfg.layers):
        if is_moe_layer(cfg, i):
            for ours, theirs in names:
                yield f"layers.{i}.mlp.experts.{ours}", f"model.layers.{i}.{block}.experts.{{e}}.{theirs}.weight"


def to_hf(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """luban state dict -> (HF config.json dict, HF state dict)."""
    family = _family(cfg)
    out = {theirs: (state[ours].t() if t else state[ours]).contiguous() for ours, theirs, t in _pairs(cfg, family)}
    if family == "gpt2":
        for i in range(cfg.layers):
            p = f"layers.{i}.attn."
            out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat(
                [state[p + n + ".weight"] for n in ("wq", "wk", "wv")]).t().contiguous()
            out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat([state[p + n + ".bias"] for n in ("wq", "wk", "wv")])
    for ours, theirs in _expert_pairs(cfg, family):
        out.update({theirs.format(e=e): w.contiguous() for e, w in enumerate(state[ours].unbind(0))})
    return hf_config(cfg, family), out


def from_hf(hf_cfg: dict, tensors: dict[str, torch.Tensor]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """HF config.json dict + state dict -> (ModelConfig, luban state dict)."""
    kind = hf_cfg.get("model_type")
    if kind == "gpt2":
        cfg = ModelConfig(name="hf-gpt2", arch="gpt2", hidden=hf_cfg["n_embd"], layers=hf_cfg["n_layer"],
                          heads=hf_cfg["n_head"], ffn_hidden=hf_cfg.get("n_inner") or 4 * hf_cfg["n_embd"],
                          vocab=hf_cfg["vocab_size"], seq_len=hf_cfg["n_positions"],
                          norm_eps=hf_cfg.get("layer_norm_epsilon", 1e-5),
                          tie_embeddings=hf_cfg.get("tie_word_embeddings", True))
    elif kind == "llama":
        cfg = ModelConfig(name="hf-llama", ffn_hidden=hf_cfg["intermediate_size"],
                          **_llama_fields(hf_cfg, norm_eps=1e-5, rope_theta=10000.0))
    elif kind in MOE_EXPERT:
        cfg = _moe_config(hf_cfg, kind)
    else:
        raise LubanError(f"config.json model_type = {kind!r}: luban imports 'gpt2', 'llama', 'mixtral' or 'qwen3_moe'")
    family = _family(cfg)
    try:
        state = {ours: (tensors[theirs].t() if t else tensors[theirs]).contiguous()
                 for ours, theirs, t in _pairs(cfg, family)}
        if family == "gpt2":
            for i in range(cfg.layers):
                w = tensors[f"transformer.h.{i}.attn.c_attn.weight"].t()
                b = tensors[f"transformer.h.{i}.attn.c_attn.bias"]
                for j, n in enumerate(("wq", "wk", "wv")):
                    rows = slice(j * cfg.hidden, (j + 1) * cfg.hidden)
                    state[f"layers.{i}.attn.{n}.weight"] = w[rows].contiguous()
                    state[f"layers.{i}.attn.{n}.bias"] = b[rows].contiguous()
        for ours, theirs in _expert_pairs(cfg, family):
            state[ours] = torch.stack([tensors[theirs.format(e=e)] for e in range(cfg.experts)])
    except KeyError as err:
        raise LubanError(f"model.safetensors: missing tensor {err.args[0]} for a {kind} model") from None
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]
    return cfg, state


def _moe_config(hf_cfg: dict, kind: str) -> ModelConfig:
    """ModelConfig of a Mixtral or Qwen3-MoE config.json (softmax router, dropless)."""
    if kind == "qwen3_moe":
        sparse = [i for i in range(hf_cfg["num_hidden_layers"])
                  if i not in hf_cfg.get("mlp_only_layers", []) and (i + 1) % hf_cfg.get("decoder_sparse_step", 1) == 0]
        dense = hf_cfg["num_hidden_layers"] - len(sparse)
        if sparse != list(range(dense, hf_cfg["num_hidden_layers"])) or not hf_cfg.get("norm_topk_prob", False):
            raise LubanError("config.json: luban imports Qwen3-MoE with dense layers first (mlp_only_layers = "
                             "0..k-1, decoder_sparse_step = 1) and norm_topk_prob = true")
        moe = dict(experts=hf_cfg["num_experts"], expert_ffn_hidden=hf_cfg["moe_intermediate_size"],
                   ffn_hidden=hf_cfg["intermediate_size"], dense_layers=dense, qk_norm=True)
    else:
        moe = dict(experts=hf_cfg["num_local_experts"], expert_ffn_hidden=hf_cfg["intermediate_size"],
                   ffn_hidden=hf_cfg["intermediate_size"])
    return ModelConfig(name=f"hf-{kind}", experts_per_token=hf_cfg["num_experts_per_tok"],
                       aux_loss_coef=float(hf_cfg.get("router_aux_loss_coef", 0.01)),
                       **_llama_fields(hf_cfg, norm_eps=1e-6, rope_theta=1e6), **moe)


def _llama_fields(hf_cfg: dict, norm_eps: float, rope_theta: float) -> dict:
    """The ``ModelConfig`` fields every Llama-family config.json (llama, mixtral, qwen3_moe) sets
    the same way; ``norm_eps`` and ``rope_theta`` are the family's defaults where the file has none."""
    h, heads = hf_cfg["hidden_size"], hf_cfg["num_attention_heads"]
    return dict(arch="llama", hidden=h, layers=hf_cfg["num_hidden_layers"], heads=heads,
                kv_heads=hf_cfg.get("num_key_value_heads") or heads, head_dim=hf_cfg.get("head_dim") or h // heads,
                vocab=hf_cfg["vocab_size"], seq_len=hf_cfg.get("max_position_embeddings", 2048), norm="rmsnorm",
                activation="swiglu", position="rope", bias=bool(hf_cfg.get("attention_bias", False)),
                norm_eps=hf_cfg.get("rms_norm_eps", norm_eps), rope_theta=float(hf_cfg.get("rope_theta", rope_theta)),
                tie_embeddings=hf_cfg.get("tie_word_embeddings", False))


def export_folder(cfg: ModelConfig, state: dict, out: Path) -> None:
    from safetensors.torch import save_file

    hf_cfg, tensors = to_hf(cfg, state)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=1))


def import_folder(folder: Path) -> tuple[ModelConfig, dict]:
    from safetensors.torch import load_file

    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise LubanError(f"FOLDER = {str(folder)!r}: needs config.json and model.safetensors")
    return from_hf(json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors")))
