"""Hugging Face ``transformers`` interop: export to / import from ``GPT2LMHeadModel``,
``LlamaForCausalLM``, ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM`` folders
(``config.json`` + ``model.safetensors``; exports add the run's tokenizer files; imports also read
sharded safetensors and the ``pytorch_model.bin`` pickles transformers 4.x could write, tensors only).

Import reads every ``config.json`` layout transformers 4.40 to 5.x writes (``read_config``): what
luban cannot compute exactly is refused with one line naming the key, what is harmless at the
lengths luban runs is accepted with a warning and kept (``extra``) for export to write back.

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
import math
import os
import re
from pathlib import Path
from typing import NamedTuple

import torch

from luban.errors import LubanError, OutputWriteError, bad_value
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


def exportable(cfg: ModelConfig) -> None:
    """Refuse, with one line, a model that has no Hugging Face equivalent (before anything is written:
    ``luban export`` claimed OUT first, and a refused export left it marked as an export)."""
    hf_config(cfg, _family(cfg))


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
    if all(getattr(cfg, k) == v for k, v in gpt2.items() if k != "bias"):  # a GPT-2 but for one key: name it
        why = next(w for w in (
            None if cfg.bias else "model.bias = false: GPT-2 (its Hugging Face class) has biases: bias = true",
            None if cfg.kv_heads == cfg.heads else f"model.kv_heads = {cfg.kv_heads}: GPT-2 (its Hugging Face class) "
                                                   f"has no grouped-query attention: kv_heads = heads = {cfg.heads}",
            f"model.head_dim = {cfg.head_dim}: GPT-2 (its Hugging Face class) needs head_dim x heads = hidden "
            f"({cfg.hidden // cfg.heads} here)") if w)
        raise LubanError(f"{why}; or a Llama (norm = rmsnorm, activation = swiglu, position = rope) exports with any")
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


def export_warnings(cfg: ModelConfig) -> list[str]:
    """What of ``cfg`` the exported folder computes differently, one line each (``luban export`` prints
    them): a capacity limit, which luban's experts apply in inference too, where Mixtral and Qwen3-MoE
    are dropless."""
    if cfg.moe and cfg.capacity_factor:
        return [f"model.capacity_factor = {cfg.capacity_factor}: {CAUSAL_LM[_family(cfg)][0]} is dropless (every "
                "token reaches its top-k experts), so its logits differ from luban's where this model's capacity "
                "drops tokens"]
    return []


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


# What a key missing from config.json means: the defaults of transformers' config classes (4.40 to 5.x);
# a key with no default here is required. ``rope_theta`` is each class's ``default_theta``.
DEFAULTS = {
    "gpt2": {"n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
             "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "initializer_range": 0.02,
             "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False},
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_key_value_heads": None, "max_position_embeddings": 2048,
              "mlp_bias": False},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
                "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
                "router_jitter_noise": 0.0, "sliding_window": None},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                  "num_experts": 128, "num_experts_per_tok": 8, "router_aux_loss_coef": 0.001, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": None, "use_sliding_window": False,
                  "sliding_window": 4096},
}
SILU_NAMES = ("silu", "swish")  # transformers' ACT2FN: "swish" is nn.SiLU, the same function as "silu"
LLAMA_DEFAULTS = {"hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "head_dim": None,
                  "tie_word_embeddings": False, "initializer_range": 0.02, "rope_parameters": None, "rope_scaling": None,
                  "partial_rotary_factor": 1.0}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# buffers older transformers saved with the weights (GPT-2's causal mask, RoPE frequencies): not weights
BUFFER = re.compile(r"\.attn\.(masked_)?bias$|\.rotary_emb\.inv_freq$")


# The config.json key each ModelConfig field is read from, per model_type (a refusal names the key in
# the user's file, not luban's), and the key hf_config writes it to; tests/model/test_hf.py checks that
# read_config reads each field from its key.
_LLAMA_KEYS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
               "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "vocab": "vocab_size",
               "seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
               "init_std": "initializer_range", "dropout": "attention_dropout", "ffn_hidden": "intermediate_size",
               "tie_embeddings": "tie_word_embeddings"}
_ROUTER_KEYS = {"experts_per_token": "num_experts_per_tok", "aux_loss_coef": "router_aux_loss_coef"}
CONFIG_KEYS = {
    "gpt2": {"hidden": "n_embd", "layers": "n_layer", "heads": "n_head", "ffn_hidden": "n_inner", "vocab": "vocab_size",
             "seq_len": "n_positions", "norm_eps": "layer_norm_epsilon", "init_std": "initializer_range",
             "dropout": "resid_pdrop", "tie_embeddings": "tie_word_embeddings"},
    "llama": _LLAMA_KEYS,
    "mixtral": {**_LLAMA_KEYS, **_ROUTER_KEYS, "expert_ffn_hidden": "intermediate_size", "experts": "num_local_experts"},
    "qwen3_moe": {**_LLAMA_KEYS, **_ROUTER_KEYS, "expert_ffn_hidden": "moe_intermediate_size", "experts": "num_experts"},
}


def hf_config(cfg: ModelConfig, family: str) -> dict:
    """The config.json of ``cfg``; read by transformers 4.40 to 5.x alike (RoPE's theta both at the top,
    as 4.x reads it, and under ``rope_parameters``, as 5.x writes it). The fields come from ``CONFIG_KEYS``
    (in mixtral one intermediate_size holds both widths), then each family's constants."""
    fields = {key: getattr(cfg, field) for field, key in CONFIG_KEYS[family].items()}
    if family == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **fields, "activation_function": "gelu_new",
                "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout, "torch_dtype": "float32"}
    common = {**fields, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}, "hidden_act": "silu",
              "torch_dtype": "float32"}
    if family == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common, "router_jitter_noise": 0.0,
                "sliding_window": None}
    if family == "qwen3_moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common, "attention_bias": False,
                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": list(range(cfg.dense_layers)),
                "use_sliding_window": False}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common, "attention_bias": cfg.bias,
            "mlp_bias": cfg.bias}


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


# the names transformers 5 reads as one another's (each config class's ``attribute_map``; GPT-2's since 4.x):
# luban reads a key under either, and refuses a file giving both with different values, since which one
# transformers builds from then depends on the class and version (5.24: GPT-2 with n_layer = 2 and
# num_hidden_layers = 1 built 1 layer; Qwen3-MoE took num_local_experts, Mixtral num_experts)
ALIASES = {"gpt2": {"n_embd": "hidden_size", "n_positions": "max_position_embeddings", "n_head": "num_attention_heads",
                    "n_layer": "num_hidden_layers"},
           "mixtral": {"num_local_experts": "num_experts"}, "qwen3_moe": {"num_experts": "num_local_experts"}}


class _Keys:
    """config.json's values, each with transformers' default where the file has none and checked for its
    type; every problem is one line naming the file and the key (the name the file gives it: ``aliases``)."""

    def __init__(self, raw: dict, src: str, defaults: dict, aliases: dict | None = None):
        self.raw, self.src, self.defaults = raw, src, defaults
        self.aliases = {**(aliases or {}), **{b: a for a, b in (aliases or {}).items()}}
        for a, b in (aliases or {}).items():
            if a in raw and b in raw and raw[a] != raw[b]:
                raise LubanError(f"{src}: {a} = {raw[a]!r}, {b} = {raw[b]!r}: one value expected (transformers reads "
                                 "each as the other; which one it builds from depends on the model class and its "
                                 "version); keep one of the two")

    def name(self, key: str) -> str:
        """The name ``key`` has in the file: itself, or its alias where only that is there."""
        other = self.aliases.get(key)
        return other if key not in self.raw and other in self.raw else key

    def __contains__(self, key: str) -> bool:
        return self.name(key) in self.raw

    def bad(self, key: str, value, allowed: str) -> LubanError:
        return bad_value(f"{self.src}: {key}", value, allowed)

    def get(self, key: str, kind: type | str, nullable: bool = False):
        """``kind``: a type, or ``"size"`` (an integer >= 1: a width, a count; 0 would be no model)."""
        value = self.raw.get(self.name(key), self.defaults.get(key, _MISSING))
        key = self.name(key)
        if value is _MISSING:
            raise LubanError(f"{self.src}: {key} missing: a {self.raw.get('model_type')} config needs it")
        if value is None and nullable:
            return None
        ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              "size": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
              float: lambda v: _finite_number(v) and v >= 0,
              bool: lambda v: isinstance(v, bool), str: lambda v: isinstance(v, str),
              list: lambda v: isinstance(v, list), dict: lambda v: isinstance(v, dict)}[kind]
        if not ok(value):
            what = {int: "an integer >= 0", "size": "an integer >= 1", float: "a finite number >= 0",
                    bool: "true or false", str: "a string", list: "a list", dict: "a JSON object"}[kind]
            raise self.bad(key, value, what + (" or null" if nullable else ""))
        return float(value) if kind is float else value


_MISSING = object()


def _index(v) -> bool:
    """An integer >= 0 (a token id, a layer index), not a bool."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _finite_number(v) -> bool:
    """A JSON number that is a finite float (an integer of 400 digits is not one: float() overflows)."""
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:
        return False


def read_config(raw, src: str = "config.json") -> tuple[ModelConfig, dict, list[str]]:
    """A config.json (any layout transformers 4.40 to 5.x writes) -> (ModelConfig, the keys luban accepted
    but does not model, to write back on export, warnings). What luban cannot represent exactly is refused
    with one line naming the key; what is harmless at the lengths luban runs is accepted with a warning."""
    if not isinstance(raw, dict):
        raise LubanError(f"{src}: a JSON object expected, found {type(raw).__name__}")
    kind = raw.get("model_type")
    if not isinstance(kind, str) or kind not in DEFAULTS:
        raise bad_value(f"{src}: model_type", kind, "one of 'gpt2', 'llama', 'mixtral', 'qwen3_moe'")
    keys = _Keys(raw, src, DEFAULTS[kind] if kind == "gpt2" else {**LLAMA_DEFAULTS, **DEFAULTS[kind]},
                 ALIASES.get(kind))
    quant = raw.get("quantization_config")
    if quant is not None:  # its weights are integers with scales, or floats that a scale tensor multiplies
        method = quant.get("quant_method", quant) if isinstance(quant, dict) else quant
        raise bad_value(f"{src}: quantization_config.quant_method", method, "absent: luban imports unquantized "
                        "weights (save the model dequantized, e.g. in bf16, then import that)")
    extra = {k: raw[k] if isinstance(raw[k], list) and all(_index(i) for i in raw[k])  # eos may be a list
             else keys.get(k, int, nullable=True) for k in TOKEN_IDS if k in keys}  # (of ids >= 0: [1, -5] was taken)
    notes: list[str] = []
    fields = _gpt2_fields(keys, notes, extra) if kind == "gpt2" else _llama_fields(keys, kind, notes, extra)
    try:
        return ModelConfig(name=f"hf-{kind}", **fields), extra, notes
    except LubanError as err:
        names = {field: keys.name(key) for field, key in CONFIG_KEYS[kind].items()}
        raise LubanError(f"{src}: {_in_config_keys(str(err), names)}") from None


def _in_config_keys(message: str, keys: dict) -> str:
    """A ModelConfig refusal (``model.heads = 3: must divide hidden = 100``) in config.json's names
    (``n_head = 3: must divide n_embd = 100``)."""
    message = re.sub(r"^model\.(\w+)", lambda m: keys.get(m.group(1), m.group(0)), message)
    return re.sub(r"\b(\w+) = ", lambda m: f"{keys.get(m.group(1), m.group(1))} = ", message)


def _gpt2_fields(keys: _Keys, notes: list[str], extra: dict) -> dict:
    act = keys.get("activation_function", str)
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise keys.bad("activation_function", act, "'gelu_new' or 'gelu_pytorch_tanh' (luban's GELU is the tanh "
                                                   "approximation)")
    if not keys.get("scale_attn_weights", bool):
        raise keys.bad("scale_attn_weights", False, "true (luban scales attention scores by 1/sqrt(head_dim))")
    if keys.get("add_cross_attention", bool):
        raise keys.bad("add_cross_attention", True, "false (luban's blocks have no cross-attention to an encoder)")
    if keys.get("scale_attn_by_inverse_layer_idx", bool):
        raise keys.bad("scale_attn_by_inverse_layer_idx", True, "false (luban does not scale attention by layer)")
    hidden = keys.get("n_embd", "size")
    return dict(arch="gpt2", hidden=hidden, layers=keys.get("n_layer", "size"), heads=keys.get("n_head", "size"),
                ffn_hidden=keys.get("n_inner", "size", nullable=True) or 4 * hidden,
                vocab=keys.get("vocab_size", "size"),
                seq_len=keys.get("n_positions", "size"), norm_eps=keys.get("layer_norm_epsilon", float),
                tie_embeddings=keys.get("tie_word_embeddings", bool), init_std=keys.get("initializer_range", float),
                dropout=_dropout(keys, ("resid_pdrop", "embd_pdrop", "attn_pdrop"), notes, extra))


def _llama_fields(keys: _Keys, kind: str, notes: list[str], extra: dict) -> dict:
    """The ``ModelConfig`` fields of a Llama-family config.json (llama, mixtral, qwen3_moe): the fields they
    share are read once here, then each family's own."""
    act = keys.get("hidden_act", str)
    if act not in SILU_NAMES:
        raise keys.bad("hidden_act", act, "'silu' or 'swish' (luban's swiglu MLP computes silu(gate) * up)")
    if act != "silu":  # written back as given: export keeps the file's own name
        extra["hidden_act"] = act
    h, heads = keys.get("hidden_size", "size"), keys.get("num_attention_heads", "size")
    bias = keys.get("attention_bias", bool)
    seq = keys.get("max_position_embeddings", "size")
    fields = dict(arch="llama", hidden=h, layers=keys.get("num_hidden_layers", "size"), heads=heads,
                  kv_heads=keys.get("num_key_value_heads", "size", nullable=True) or heads,
                  head_dim=keys.get("head_dim", "size", nullable=True) or (h // heads if heads else 0),
                  vocab=keys.get("vocab_size", "size"), seq_len=seq, norm="rmsnorm", activation="swiglu",
                  position="rope", bias=bias, norm_eps=keys.get("rms_norm_eps", float),
                  rope_theta=_rope_theta(keys, seq, notes, extra), tie_embeddings=keys.get("tie_word_embeddings", bool),
                  init_std=keys.get("initializer_range", float),
                  dropout=_dropout(keys, ("attention_dropout",), notes, extra))
    if kind == "llama":
        if keys.get("mlp_bias", bool) != bias:
            raise keys.bad("mlp_bias", not bias, f"equal to attention_bias = {str(bias).lower()} (luban's bias key "
                                                 "covers both)")
        return {**fields, "ffn_hidden": keys.get("intermediate_size", "size")}
    if bias:
        raise keys.bad("attention_bias", True, f"false (a {kind} model has no MLP biases; luban's bias key covers both)")
    _sliding_window(keys, kind, seq, notes, extra)
    fields.update(experts_per_token=keys.get("num_experts_per_tok", "size"),
                  aux_loss_coef=keys.get("router_aux_loss_coef", float))
    if kind == "mixtral":
        jitter = keys.get("router_jitter_noise", float)
        if jitter > 0:
            notes.append(f"router_jitter_noise = {jitter}: transformers jitters the router only in training, so the "
                         "imported logits are exact; training in luban runs without jitter; written back on export")
            extra["router_jitter_noise"] = jitter
        ffn = keys.get("intermediate_size", "size")
        return {**fields, "experts": keys.get("num_local_experts", "size"), "ffn_hidden": ffn,
                "expert_ffn_hidden": ffn}
    if not keys.get("norm_topk_prob", bool):
        raise keys.bad("norm_topk_prob", False, "true (luban's softmax router renormalises the top-k weights)")
    layers, step = fields["layers"], keys.get("decoder_sparse_step", "size")  # 0: transformers divides by it
    only = keys.get("mlp_only_layers", list, nullable=True) or []
    if not all(_index(i) for i in only):  # (["0"] was imported; transformers refuses to load it)
        raise keys.bad("mlp_only_layers", only, "a list of layer indices (integers >= 0) or null")
    sparse = [i for i in range(layers) if i not in only and (i + 1) % step == 0]
    dense = layers - len(sparse)
    if not sparse:
        raise keys.bad("mlp_only_layers", only, f"must leave a MoE layer among num_hidden_layers = {layers} (a model "
                                                "without one is a dense llama)")
    if sparse != list(range(dense, layers)):
        raise LubanError(f"{keys.src}: mlp_only_layers = {only}, decoder_sparse_step = {step}: luban keeps dense "
                         "layers only first (mlp_only_layers = [0, ..., k-1], decoder_sparse_step = 1)")
    return {**fields, "experts": keys.get("num_experts", "size"),
            "ffn_hidden": keys.get("intermediate_size", "size"),
            "expert_ffn_hidden": keys.get("moe_intermediate_size", "size"), "dense_layers": dense, "qk_norm": True}


def _rope_theta(keys: _Keys, seq: int, notes: list[str], extra: dict) -> float:
    """RoPE's base from ``rope_parameters`` (5.x) or ``rope_scaling`` with a top-level ``rope_theta``
    (4.x), in transformers' order; a frequency scaling luban does not have is refused, except NTK
    'dynamic', which changes nothing up to its original length (``_ntk_factor``)."""
    scaling = keys.get("rope_scaling", dict, nullable=True)
    where = "rope_scaling" if scaling else "rope_parameters"
    rope = scaling or keys.get("rope_parameters", dict, nullable=True) or {}
    if any(isinstance(v, dict) for v in rope.values()):
        raise keys.bad(where, rope, "one RoPE for every layer")
    nested = _Keys(rope, f"{keys.src}: {where}", {"rope_type": rope.get("type", "default"),
                                                  "rope_theta": keys.get("rope_theta", float),
                                                  "partial_rotary_factor": keys.get("partial_rotary_factor", float),
                                                  "original_max_position_embeddings": seq})
    theta, kind = nested.get("rope_theta", float), nested.get("rope_type", str)
    factor = nested.get("partial_rotary_factor", float)
    if factor != 1.0:  # under rope_parameters (5.x) or at the top (4.x; 5.x moves it under rope_parameters)
        where_factor = nested if "partial_rotary_factor" in rope else keys
        raise where_factor.bad("partial_rotary_factor", factor, "1.0 (luban rotates every dimension)")
    if kind == "dynamic" and nested.get("original_max_position_embeddings", int) >= seq:
        _ntk_factor(nested, seq)
        notes.append(f"{where}.rope_type = 'dynamic': NTK scaling starts only beyond max_position_embeddings = {seq}, "
                     "the longest sequence luban runs, so the model is exact; written back on export")
        extra[where] = rope
    elif kind != "default":
        raise nested.bad("rope_type", kind, "'default' (luban's RoPE has no frequency scaling; 'dynamic' is accepted "
                                            "where it starts beyond max_position_embeddings)")
    return theta


def _ntk_factor(rope: _Keys, seq: int) -> None:
    """NTK 'dynamic' RoPE's ``factor``, which transformers uses at every length: it computes the base as
    ``rope_theta * (factor * s / m - (factor - 1)) ** (d / (d - 2))`` with s = m = max_position_embeddings
    up to that length (modeling_rope_utils._compute_dynamic_ntk_parameters), rope_theta itself only where
    that difference is 1 in double precision. A NaN factor, or one of 1e16 (difference 0: infinite
    frequencies), gave NaN logits there; a missing or non-numeric one, no model at all."""
    if "factor" not in rope:
        raise LubanError(f"{rope.src}: factor missing: NTK 'dynamic' RoPE needs it")
    factor = rope.raw["factor"]
    if not _finite_number(factor) or factor * seq / seq - (factor - 1) != 1.0:
        raise rope.bad("factor", factor, "a finite number from which transformers' NTK base is rope_theta within "
                                         "max_position_embeddings")


def _sliding_window(keys: _Keys, kind: str, seq: int, notes: list[str], extra: dict) -> None:
    """Refuse a window shorter than the model's positions (luban attends to the whole context); accept a
    longer one, which never applies, with a warning; written back on export either way."""
    window = keys.get("sliding_window", int, nullable=True)
    used = keys.get("use_sliding_window", bool) if kind == "qwen3_moe" else window is not None
    extra.update({k: keys.raw[k] for k in ("sliding_window", "use_sliding_window", "max_window_layers") if k in keys})
    if not used or window is None:
        return
    if window < seq:
        raise keys.bad("sliding_window", window, f"null or >= max_position_embeddings = {seq} (luban attends to the "
                                                 f"whole context; a window of {window} differs beyond {window} tokens)")
    notes.append(f"sliding_window = {window} >= max_position_embeddings = {seq}: the window never applies at the "
                 "lengths luban runs, so the model is exact; written back on export")


def _dropout(keys: _Keys, names: tuple[str, ...], notes: list[str], extra: dict) -> float:
    """luban's one dropout probability (attention, residual and embedding outputs) from the file's."""
    values = {n: keys.get(n, float) for n in names}
    p = values[names[0]]
    if len(set(values.values())) > 1 or (names == ("attention_dropout",) and p > 0):
        notes.append(", ".join(f"{n} = {v}" for n, v in values.items()) + f": luban applies one dropout p = {p} to "
                     "attention, residual and embedding outputs in training (inference is unaffected); written back on "
                     "export")
        extra.update(values)
    return p


def _state(cfg: ModelConfig, tensors: dict[str, torch.Tensor], src: str, hint: str = "") -> dict[str, torch.Tensor]:
    """luban's state dict from the HF tensors, after checking that they are exactly the ones ``cfg``
    has (names, shapes, floating point, finite values): one line naming the first that is not (``hint``
    ends a message on the tensors' names: what config.json's ``architectures`` says the folder holds)."""
    from luban.model.transformer import Transformer

    family = _family(cfg)
    if family == "gpt2" and "transformer.wte.weight" not in tensors:  # saved from GPT2Model (the Hub's gpt2)
        tensors = {k if k.startswith("lm_head.") else f"transformer.{k}": v for k, v in tensors.items()}
    tensors = _unfused(cfg, family, tensors, src)
    names = [theirs for _, theirs, _ in _pairs(cfg, family)]  # first the names: a config.json that says 60,000
    if family == "gpt2":  # layers where the file has 2 is refused at once, before a model that size is built
        names += [f"transformer.h.{i}.attn.c_attn.{w}" for i in range(cfg.layers) for w in ("weight", "bias")]
    names += [theirs.format(e=e) for _, theirs in _expert_pairs(cfg, family) for e in range(cfg.experts)]
    missing = [k for k in names if k not in tensors]
    if missing:
        raise LubanError(f"{src}: tensor {missing[0]} missing ({len(missing)} missing): the {family} model of "
                         f"config.json has it{hint}")
    expected = set(names)
    unexpected = [k for k in tensors if k not in expected and not BUFFER.search(k)
                  and not (cfg.tie_embeddings and k == "lm_head.weight")]
    if unexpected:
        raise LubanError(f"{src}: tensor {unexpected[0]} ({len(unexpected)} unexpected) is not part of the "
                         f"{family} model of config.json; luban would drop it{hint}")
    head, embedding = tensors.get("lm_head.weight"), tensors[names[0]]  # names[0]: the token embedding
    if cfg.tie_embeddings and head is not None and not (head.shape == embedding.shape
                                                        and torch.equal(head.to(embedding.dtype), embedding)):
        # transformers 5 loads the saved head untied (warning), 4.x ties the two again: ambiguous
        raise LubanError(f"{src}: tensor lm_head.weight differs from {names[0]}, which config.json ties it to "
                         "(tie_word_embeddings = true): which one the head is depends on the transformers version; "
                         "set tie_word_embeddings = false in config.json to import the saved head")
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in to_hf(cfg, Transformer(cfg).state_dict())[1].items()}
    assert set(shapes) == expected, set(shapes) ^ expected
    for k, shape in shapes.items():
        if tuple(tensors[k].shape) != shape:
            raise LubanError(f"{src}: tensor {k} has shape {list(tensors[k].shape)}; config.json implies {list(shape)}")
        if not tensors[k].is_floating_point():
            raise LubanError(f"{src}: tensor {k} has dtype {tensors[k].dtype}; a floating-point weight expected")
    tensors = {k: tensors[k].float() for k in shapes}  # luban's weights are fp32 (bf16 and fp16 widen exactly)
    found = nonfinite(tensors)
    if found:  # transformers loads it; every logit it reaches is NaN, and training from it gives NaN losses
        raise LubanError(f"{src}: tensor {found[0]} has {found[1]} (of {tensors[found[0]].numel()}); "
                         f"finite weights expected")
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
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]
    return state


FUSED_EXPERTS = "model.layers.{i}.mlp.experts."  # + gate_up_proj [E, 2f, h] and down_proj [E, h, f]


def _unfused(cfg: ModelConfig, family: str, tensors: dict[str, torch.Tensor], src: str) -> dict[str, torch.Tensor]:
    """The per-expert tensors of a MoE folder transformers 5 saved fused (``save_pretrained(...,
    save_original_format=False)``: each layer's experts as ``mlp.experts.gate_up_proj`` [E, 2f, h], gate rows
    first (``MixtralExperts.forward``: ``linear(x, gate_up_proj[e]).chunk(2)``), ``down_proj`` [E, h, f], and
    Mixtral's router under ``mlp.gate``), named as the original format names them; ``tensors`` as they are
    otherwise. It was refused as "tensor ... missing", which transformers itself loads (a review of 2026-12-04)."""
    from luban.model.moe import is_moe_layer

    if family not in MOE_EXPERT or not any(k.endswith(".mlp.experts.gate_up_proj") for k in tensors):
        return tensors
    block, names = MOE_EXPERT[family]
    (_, gate), (_, up), (_, down) = names
    out = dict(tensors)
    for i in range(cfg.layers):
        fused = FUSED_EXPERTS.format(i=i)
        if not is_moe_layer(cfg, i) or fused + "gate_up_proj" not in out or fused + "down_proj" not in out:
            continue  # (what is missing is named below, as the original format's names)
        gate_up, down_w = out.pop(fused + "gate_up_proj"), out.pop(fused + "down_proj")
        if gate_up.dim() != 3 or gate_up.shape[0] != cfg.experts or gate_up.shape[1] != 2 * cfg.expert_ffn_hidden:
            raise LubanError(f"{src}: tensor {fused}gate_up_proj has shape {list(gate_up.shape)}; config.json implies "
                             f"{[cfg.experts, 2 * cfg.expert_ffn_hidden, cfg.hidden]}")
        if down_w.dim() != 3 or down_w.shape[0] != cfg.experts:
            raise LubanError(f"{src}: tensor {fused}down_proj has shape {list(down_w.shape)}; config.json implies "
                             f"{[cfg.experts, cfg.hidden, cfg.expert_ffn_hidden]}")
        f = cfg.expert_ffn_hidden
        for e in range(cfg.experts):
            at = f"model.layers.{i}.{block}.experts.{e}."
            out[at + f"{gate}.weight"], out[at + f"{up}.weight"] = gate_up[e, :f], gate_up[e, f:]
            out[at + f"{down}.weight"] = down_w[e]
        router = f"model.layers.{i}.mlp.gate.weight"
        if block != "mlp" and router in out:
            out[f"model.layers.{i}.{block}.gate.weight"] = out.pop(router)
    return out


def nonfinite(tensors: dict) -> tuple[str, str] | None:
    """The first floating-point tensor holding NaN or infinite values, and how many ("3 NaN or infinite
    values"), or None: the one check ``luban import`` and ``luban export`` make of a model's weights."""
    for name, t in tensors.items():
        bad = t.numel() - int(torch.isfinite(t).sum()) if t.is_floating_point() else 0
        if bad:
            return name, f"{bad} NaN or infinite value{'s' * (bad > 1)}"
    return None


class HfImport(NamedTuple):
    cfg: ModelConfig
    state: dict
    extra: dict  # config.json keys luban accepted but does not model: written back by export_folder
    warnings: list


def import_folder(folder: Path, fits=None) -> HfImport:
    """Read a folder transformers saved (config.json, model.safetensors or its sharded index). ``fits``:
    called with the model's config before any weight is read (``luban import``: does it fit in memory)."""
    src = folder / "config.json"
    if not src.is_file():
        raise LubanError(f"{src}: no such file; a Hugging Face folder holds config.json and model.safetensors")
    raw = _read_json(src)
    cfg, extra, notes = read_config(raw, str(src))
    if fits is not None:
        fits(cfg)
    tensors, where = _read_tensors(folder)
    if any(t.dtype == torch.float64 for t in tensors.values()):  # (narrowed in silence before, 2026-12-04)
        notes.append("float64 weights read as float32 (luban's weights are float32): what float64 held beyond "
                     "float32's precision is lost")
    return HfImport(cfg, _state(cfg, tensors, where, _architectures_hint(raw)), extra, notes)


# the classes whose folders luban reads, by model_type (GPT2Model: the Hub's gpt2, saved without its head)
CAUSAL_LM = {"gpt2": ("GPT2LMHeadModel", "GPT2Model"), "llama": ("LlamaForCausalLM",),
             "mixtral": ("MixtralForCausalLM",), "qwen3_moe": ("Qwen3MoeForCausalLM",)}


def _architectures_hint(raw: dict) -> str:
    """Where config.json names other classes only (a sequence classifier, a bare LlamaModel): the end of
    the message on the tensors, which is then what went wrong."""
    names, wanted = raw.get("architectures"), CAUSAL_LM[raw["model_type"]]
    if not isinstance(names, list) or not names or any(n in wanted for n in names):
        return ""
    return f" (config.json: architectures = {names!r}; luban imports {wanted[0]} folders)"


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise LubanError(f"{path}: not readable as JSON ({_first_line(err)})") from None


# the weight files transformers reads, in its order: safetensors (one file, or shards and their index), then
# PyTorch's pickles (what transformers 4.x wrote with safe_serialization=False), read with weights_only
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def weight_bytes(folder: Path) -> int:
    """Bytes of the weight files in ``folder`` (safetensors and bin files, shards too), at least 1."""
    total = 0
    for path in folder.iterdir() if folder.is_dir() else ():
        try:
            if path.suffix in (".safetensors", ".bin") and path.is_file():
                total += path.stat().st_size
        except OSError:
            continue
    return max(total, 1)


def _read_tensors(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    """(every tensor, the file(s) they came from for messages): the first of ``WEIGHT_FILES`` there; an
    index's shards must hold what its ``weight_map`` says, and no tensor may be in two shards."""
    found = next((folder / n for n in WEIGHT_FILES if (folder / n).is_file()), None)
    if found is None:
        variant = next((p.name for p in sorted(folder.glob("model.*.safetensors")) + sorted(folder.glob("pytorch_model.*.bin"))
                        if p.is_file() and not re.fullmatch(r".*-\d+-of-\d+\..*", p.name)), None)
        hint = (f"; it holds {variant}, a variant's weights (save_pretrained(variant=...)): rename it to the "
                "name without the variant" if variant else "")
        raise LubanError(f"{folder / WEIGHT_FILES[0]}: no such file; luban reads the weights transformers saves: "
                         f"{', '.join(WEIGHT_FILES[:-1])} or {WEIGHT_FILES[-1]} (with their shards){hint}")
    if not found.name.endswith(".index.json"):
        return _load_weights(found), str(found)
    index = _read_json(found)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    shards = list(weight_map.values()) if isinstance(weight_map, dict) else []
    if not shards or not all(isinstance(n, str) and n and Path(n).name == n and n not in (".", "..") for n in shards):
        raise LubanError(f"{found}: weight_map must name the shard files in {folder}")
    names = sorted(set(shards))
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for name in names:
        shard = _load_weights(folder / name)
        for key in shard:
            if key in where:
                raise LubanError(f"{folder / name}: tensor {key} is also in {where[key]}: which one the model "
                                 "has is ambiguous; each tensor belongs in one shard")
            where[key] = name
        tensors.update(shard)
    for key, name in weight_map.items():
        if where.get(key) != name:
            raise LubanError(f"{found}: weight_map places tensor {key} in {name}, which does not hold it"
                             + (f" ({where[key]} does)" if key in where else ""))
    return tensors, str(found)


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    """One safetensors file or PyTorch pickle (``weights_only``: no code runs), as name -> tensor; a file
    that is not one is one line naming it."""
    if not path.is_file():  # a shard the index names: a named pipe or a device would be waited on or read forever
        raise LubanError(f"{path}: {'not a regular file' if path.exists() else 'no such file'}; the index "
                         "names it as a shard of the weights")
    if path.name.endswith(".safetensors"):
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as err:  # safetensors' own error (truncated, garbled header) or OSError: name the file
            raise LubanError(f"{path}: not a readable safetensors file ({_first_line(err)})") from None
    import pickle
    import warnings
    import zipfile

    try:
        with warnings.catch_warnings():  # torch's remarks on the pickle protocol: not the user's concern
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError:  # torch's own message advises weights_only=False: running the file's code
        raise LubanError(f"{path}: not a PyTorch weights file, or one holding Python objects besides tensors "
                         "(luban loads only tensors from a pickle: torch.load(weights_only=True))") from None
    except Exception as err:  # noqa: BLE001 - a damaged pickle raises anything
        raise LubanError(f"{path}: not a readable PyTorch weights file ({_first_line(err)})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise LubanError(f"{path}: holds a {type(state).__name__}, not a state dict (tensor names to tensors)")
    return state


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:200]


# every file an export may write: re-exporting into luban's own folder replaces the ones it writes and
# removes the ones an earlier export wrote that this one does not (a stale tokenizer would pass for the model's)
EXPORT_NAMES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json")


def export_folder(cfg: ModelConfig, state: dict, out: Path, tokenizer=None, extra: dict | None = None,
                  record: bool = False) -> list[str]:
    """Write ``out/config.json`` and ``model.safetensors``; with ``tokenizer`` (luban's byte or BPE one) also
    ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``, and the special-token ids in
    ``config.json`` and ``generation_config.json``. ``extra``: keys an import accepted but luban does not model,
    written back. Every file gets the mode the umask gives (644 under 022). Returns the names written.

    ``record`` (``luban export``, into a folder ``luban.owned`` claimed): the marker ``.luban`` also lists the
    files written (size, modification time); a later export there refuses to replace one of ``EXPORT_NAMES``
    that it does not list as is (a user's copy), and removes those it lists that it does not write again."""
    from luban.data.tokenizer import hf_tokenizer_files

    hf_cfg, tensors = to_hf(cfg, state)
    hf_cfg.update(extra or {})
    files = {}
    if tokenizer is not None:
        eos = tokenizer.eos_id
        hf_cfg.update(bos_token_id=eos, eos_token_id=eos)
        files.update(hf_tokenizer_files(tokenizer, cfg.seq_len))
    generation = {k: hf_cfg[k] for k in TOKEN_IDS if hf_cfg.get(k) is not None}
    if tokenizer is not None:
        generation["pad_token_id"] = tokenizer.eos_id  # as GPT-2: padding with the end of document
    if generation:
        files["generation_config.json"] = json.dumps(generation, indent=1)
    files["config.json"] = json.dumps(hf_cfg, indent=1)
    names = ["model.safetensors", *files]
    held = _hold(out) if record and out.is_dir() else None  # one export at a time in a folder
    try:
        return _export_into(out, names, files, tensors, record, held)
    finally:
        if held is not None:
            os.close(held)


def _hold(out: Path) -> int | None:
    """The folder ``out``'s lock for one export (``owned.try_lock``), or a refusal while another export holds
    it: two at once each wrote their note over the other's, and each one's temporaries were left to the
    other's judgement. None where the folder cannot be opened or has no ``flock``: unguarded, as before."""
    from luban import owned

    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    held = owned.try_lock(fd)
    if not held:
        os.close(fd)
        if held is False:
            raise bad_value("OUT", str(out), "another luban export is writing into this folder now; wait for it to "
                                             "end, or choose another folder (nothing was changed)")
        return None
    return fd


def _export_into(out: Path, names: list[str], files: dict, tensors: dict, record: bool, held: int | None) -> list[str]:
    """``export_folder``'s writes (``held``: this process holds the folder's lock, ``_hold``)."""
    import time

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from luban.data.atomic import _fsync_dir

    if record and out.is_dir():  # what an export killed here left goes first (it may be what is judged next)
        _remove_killed_temporaries(out, alone=held is not None)
    ours = _earlier_export(out, names) if record else None
    umask = os.umask(0)
    os.umask(umask)
    pid = os.getpid()
    temps = {name: out / f".{name}.tmp-{pid}" for name in names}  # each file, whole, before any is replaced
    record = dict(ours or {})  # what the marker lists: the earlier export's files, then this one's
    before: set[str] | None = None  # the ``.tmp*`` names there before this export: a user's, they stay

    from luban import interrupt

    def remove_temporaries() -> None:
        """This export's temporaries, and what safetensors (0.7+) writes first beside ``temps``' own, its
        ``.tmpXXXXXX`` (renamed at the end): a forced exit in between (a Ctrl-C the native write does not
        answer) left it, as big as the model."""
        try:
            theirs = [n for n in os.listdir(out) if n.startswith(".tmp") and n not in before] if before is not None else []
        except OSError:
            theirs = []
        for path in [*temps.values(), *(out / n for n in theirs)]:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass

    def settle() -> None:
        """The record of an export that stops: each file it lists by its identity if it is there (the
        earlier export's, or this one's), else not at all, and no longer a note that one is written."""
        if ours is None:
            return
        try:
            _write_record(out, {n: _identity(out / n) for n in record if (out / n).is_file() and not (out / n).is_symlink()})
        except OSError:
            pass

    def stop() -> None:
        remove_temporaries()
        settle()

    clash = next((p for p in temps.values() if p.exists() or p.is_symlink()), None)
    if clash is not None:  # a user's file of that name (luban's own, left by a killed export, went above)
        raise bad_value("OUT", str(out), f"holds {clash.name!r}, which luban did not write (the name of its own "
                                         "temporary); move it away (nothing was changed)")

    try:
        out.mkdir(parents=True, exist_ok=True)
        before = {n for n in os.listdir(out) if n.startswith(".tmp")}
        since = time.time_ns()
        if ours is not None:  # who writes, since when: what a kill -9 during the writes leaves is found later
            _write_record(out, record, _writing({}, before, since))
        # 1. every file into its temporary: a Ctrl-C (a full disk) here leaves the earlier export whole
        with interrupt.on_abort(stop):
            save_file(tensors, str(temps["model.safetensors"]), metadata={"format": "pt"})
            for name, text in files.items():
                _write_synced(temps[name], text.encode("utf-8"))
        for path in temps.values():
            os.chmod(path, 0o666 & ~umask)  # safetensors creates its file 600; every file follows the umask
        # 2. all in place at once: a Ctrl-C now waits for the end (a re-export cut between its weights and
        # its config.json left another model's config beside them); the record lists each name first,
        # identity unknown, with the identity of the file it replaces (after a kill -9: luban's if that one)
        with interrupt.critical():
            if ours is not None:
                record.update(dict.fromkeys(names))
                _write_record(out, record, _writing({n: ours.get(n) for n in names}, before, since,
                                                    {n: _identity(temps[n]) for n in names}))
            for name in names:
                os.replace(temps[name], out / name)
            _fsync_dir(out)
            if ours is not None:
                for name in set(ours) - set(names):
                    (out / name).unlink(missing_ok=True)
                _write_record(out, {n: _identity(out / n) for n in names})
    except BaseException as err:  # (a Ctrl-C too)
        stop()
        if isinstance(err, (OSError, SafetensorError)):  # safetensors reports a full disk as its own error
            raise OutputWriteError(f"OUT = {str(out)!r}: the Hugging Face folder could not be written "
                                   f"({getattr(err, 'strerror', None) or err}); free space or choose another "
                                   "folder") from None
        raise
    return names


def _write_synced(path: Path, data: bytes) -> None:
    """``data`` into a new file ``path``, on the disk when this returns (its rename comes later)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _identity(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _earlier_export(out: Path, names: list[str]) -> dict:
    """The files of ``EXPORT_NAMES`` in ``out`` that an earlier export wrote and nobody changed since (name ->
    identity); one line, nothing changed, if one that this export writes is not such a file. A folder whose
    marker lists no files (exported before 2026-11-27, when luban began to keep the list) is judged by
    ``_legacy_export``."""
    from luban.owned import MARKER

    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        marker = None
    listed = marker.get("files") if isinstance(marker, dict) else None
    writing = marker.get("writing") if isinstance(marker, dict) else None
    present = [n for n in EXPORT_NAMES if (out / n).exists() or (out / n).is_symlink()]
    if not isinstance(listed, dict):
        listed = _legacy_export(out, present)
    ours = {}
    for name in present:
        seen = listed.get(name, False)
        if seen is None and isinstance(writing, dict) and isinstance(writing.get("was"), dict):  # a kill -9 as it
            new = writing.get("new") if isinstance(writing.get("new"), dict) else {}  # replaced it: luban's if
            try:  # it is the file that was there or the one that export put there
                now = _identity(out / name)
            except OSError:
                now = None
            seen = now if now is not None and now in (writing["was"].get(name), new.get(name)) else False
        try:
            same = seen is None or (seen is not False and not (out / name).is_symlink()
                                    and _identity(out / name) == seen)
        except OSError:
            same = False
        if same:
            ours[name] = seen
        elif name in names:
            raise bad_value("OUT", str(out), f"holds {name!r}, which luban did not write (or which was changed "
                                             "after its export); move it away or choose a new or empty folder "
                                             "(nothing was changed)")
    return ours


def _legacy_export(out: Path, present: list[str]) -> dict:
    """The record an export made before 2026-11-27 would have written, rebuilt from the files: that export
    wrote ``model.safetensors`` first, then the tokenizer files and ``generation_config.json``, and
    ``config.json`` last, each once. So ``model.safetensors`` and ``config.json`` are luban's, and another
    of ``EXPORT_NAMES`` is luban's only if it was last modified between those two (a file a user added or
    changed later, or copied in keeping an older time, is not: a re-export refuses to replace it)."""
    try:
        first, last = (out / "model.safetensors").stat().st_mtime_ns, (out / "config.json").stat().st_mtime_ns
    except OSError:
        first, last = 1, 0  # not an export that finished: nothing between
    listed = {}
    for name in present:
        try:
            if (out / name).is_symlink():
                continue
            identity = _identity(out / name)
        except OSError:
            continue
        if name in ("model.safetensors", "config.json") or first <= identity[1] <= last:
            listed[name] = identity
    return listed


def _write_record(out: Path, files: dict, writing: dict | None = None) -> None:
    from luban.data.atomic import write_bytes
    from luban.owned import MARKER

    record = {"luban": "hf-export", "files": files, **({"writing": writing} if writing else {})}
    write_bytes(out / MARKER, (json.dumps(record) + "\n").encode())


# safetensors (0.7+; Rust's ``tempfile``) writes ``.tmp`` and six letters or digits beside the file it saves
SAFETENSORS_TEMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on a header (its ``MAX_HEADER_SIZE``)
# a file's time comes from the kernel's coarse clock, up to a tick (1-10 ms) behind time.time_ns(): a margin
COARSE_CLOCK_NS = 1_000_000_000


def _writing(was: dict, before: set[str], since_ns: int, new: dict | None = None) -> dict:
    """What the record says while this process writes an export: the identity of each file it is
    replacing (an earlier export's, or None; empty while it writes its temporaries) and of the
    temporary replacing it (``new``: a rename keeps size and time), who writes since when, and the
    ``.tmp*`` names that were there before (a user's)."""
    return {"was": was, "new": new or {}, "pid": os.getpid(), "since_ns": since_ns, "temporaries": sorted(before)}


def _remove_killed_temporaries(out: Path, alone: bool = False) -> list[str]:
    """Remove what an export killed while it wrote (kill -9: nothing ran) left in ``out``: its own
    temporaries (``.NAME.tmp-PID`` of one of ``EXPORT_NAMES``, by that process's PID), and safetensors'
    own, as big as the model: a file that is all of named as safetensors names it, made by then
    (modified after that export began to write), not there before it, and a safetensors file by its
    header (written first: a file killed before its header stays). Returns the names removed.

    ``alone``: this process holds the folder's lock (``_hold``), so no other export runs there and the
    one a note names was killed, whatever process has its PID now (a PID is reused); else an export
    whose PID lives is taken to run still."""
    from luban.owned import MARKER

    def runs(pid: int) -> bool:
        return pid == os.getpid() or not alone and os.path.exists(f"/proc/{pid}")

    removed = []
    for name in os.listdir(out):  # the record's own temporary (write_bytes': ..luban.tmp-PID), by a dead process
        stale = re.fullmatch(rf"\.{re.escape(MARKER)}\.tmp-(\d+)", name)
        if stale and not runs(int(stale.group(1))):
            try:
                if (out / name).is_file() and not (out / name).is_symlink():
                    (out / name).unlink()
                    removed.append(name)
            except OSError:
                pass
    try:
        writing = json.loads((out / MARKER).read_text()).get("writing")
        pid, since, kept = int(writing["pid"]), int(writing["since_ns"]), set(writing["temporaries"])
    except (OSError, ValueError, UnicodeDecodeError, RecursionError, AttributeError, KeyError, TypeError,
            OverflowError):  # (a hand-edited note: Infinity, 1e400)
        return removed
    if pid != os.getpid() and runs(pid):  # (that export still runs)
        return removed
    for name in sorted(os.listdir(out)):
        path = out / name
        try:
            own = name in {f".{n}.tmp-{pid}" for n in (*EXPORT_NAMES, MARKER)}  # (the marker's: ..luban.tmp-PID)
            if name in kept or path.is_symlink() or not path.is_file() or not own and (
                    not SAFETENSORS_TEMP.fullmatch(name) or path.stat().st_mtime_ns < since - COARSE_CLOCK_NS
                    or not _is_safetensors(path)):
                continue
            path.unlink()
            removed.append(name)
        except OSError:
            continue
    return removed


def _is_safetensors(path: Path) -> bool:
    """Whether ``path`` begins as a safetensors file: an 8-byte little-endian header length, then that
    many bytes of a JSON object naming its tensors and luban's metadata (``{"format": "pt"}``)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8 or not 2 <= (n := int.from_bytes(head, "little")) <= MAX_HEADER_BYTES:
            return False
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError, RecursionError):
            return False
    return isinstance(header, dict) and header.get("__metadata__") == {"format": "pt"}
