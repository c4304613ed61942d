"""``ModelConfig``: the single description of a decoder-only transformer.

The same object builds the network (``luban.model.transformer``), feeds the FLOPs and
parameter formulas (``luban.model.flops``) used by the trainer's MFU and by the planner.
Schema (TOML ``[model]`` or JSON; every key optional when ``preset`` is given):

==================  =========================================================  =============
key                 meaning                                                    default
==================  =========================================================  =============
preset              start from a named preset (``luban.model.presets``)        none
arch                ``gpt2`` or ``llama`` (sets the defaults of the next keys)  ``gpt2``
hidden              model width h                                              768
layers              transformer blocks l                                       12
heads               attention heads a                                          12
kv_heads            key/value heads (grouped-query attention when < heads)      heads
head_dim            per-head width                                             hidden/heads
ffn_hidden          MLP inner width                                            4h (gpt2)
vocab               vocabulary size V                                          50257
seq_len             maximum sequence length s                                  1024
tie_embeddings      LM head shares the token embedding                         gpt2: true
norm                ``layernorm`` or ``rmsnorm``                                gpt2: layernorm
norm_eps            normaliser epsilon                                         1e-5
activation          ``gelu`` (tanh approx., GPT-2) or ``swiglu``                gpt2: gelu
position            ``learned`` or ``rope``                                     gpt2: learned
rope_theta          RoPE base                                                  10000
bias                biases in linear layers                                    gpt2: true
dropout             dropout probability                                        0.0
init_std            std of the normal initialisation                           0.02
==================  =========================================================  =============
"""

from __future__ import annotations

import math

import dataclasses
from dataclasses import dataclass, field

from luban.errors import LubanError, bad_value

ARCH_DEFAULTS = {
    "gpt2": dict(norm="layernorm", activation="gelu", position="learned", bias=True, tie_embeddings=True),
    "llama": dict(norm="rmsnorm", activation="swiglu", position="rope", bias=False, tie_embeddings=False),
}
# A derived key is recomputed when a key it depends on is overridden (unless also given).
DERIVED = {"head_dim": ("hidden", "heads"), "kv_heads": ("heads",), "ffn_hidden": ("hidden", "activation")}
CHOICES = {
    "arch": tuple(ARCH_DEFAULTS),
    "norm": ("layernorm", "rmsnorm"),
    "activation": ("gelu", "swiglu"),
    "position": ("learned", "rope"),
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "gpt2"
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    kv_heads: int = 0  # 0: same as heads
    head_dim: int = 0  # 0: hidden // heads
    ffn_hidden: int = 0  # 0: 4*hidden (gelu) or the Llama rule (swiglu)
    vocab: int = 50257
    seq_len: int = 1024
    tie_embeddings: bool = True
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    activation: str = "gelu"
    position: str = "learned"
    rope_theta: float = 10000.0
    bias: bool = True
    dropout: float = 0.0
    init_std: float = 0.02
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        if self.head_dim == 0 and self.heads > 0 and self.hidden % self.heads:
            raise bad_value("model.heads", self.heads, f"must divide hidden = {self.hidden}")
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.head_dim == 0 and self.heads > 0:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.ffn_hidden == 0:
            object.__setattr__(self, "ffn_hidden", default_ffn(self.hidden, self.activation))
        self.validate()

    @classmethod
    def from_dict(cls, raw: dict, section: str = "model") -> "ModelConfig":
        """Build from a TOML/JSON table; ``preset`` and ``arch`` fill in unspecified keys."""
        from luban.model.presets import get_preset

        raw = dict(raw)
        known = {f.name for f in dataclasses.fields(cls)} | {"preset"}
        for key in raw:
            if key not in known:
                raise LubanError(f"{section}.{key}: unknown key; allowed: {', '.join(sorted(known))}")
        base: dict = {}
        if "preset" in raw:
            base = dataclasses.asdict(get_preset(raw.pop("preset")))
            if "arch" in raw and raw["arch"] != base["arch"]:
                base = {k: v for k, v in base.items() if k not in ARCH_DEFAULTS["gpt2"]}
        arch = raw.get("arch", base.get("arch", "gpt2"))
        if not isinstance(arch, str) or arch not in ARCH_DEFAULTS:
            raise bad_value(f"{section}.arch", arch, f"one of {', '.join(ARCH_DEFAULTS)}")
        values = {**ARCH_DEFAULTS[arch], **base, **raw}
        if base and "name" not in raw:
            values["name"] = base["name"] if set(raw) <= {"name"} else f"{base['name']}-custom"
        for key, sources in DERIVED.items():  # re-derive what the overrides change
            if key not in raw and any(src in raw for src in sources):
                values[key] = 0
        for f in dataclasses.fields(cls):
            if f.name in values:
                values[f.name] = _coerce(f"{section}.{f.name}", values[f.name], f.type)
        return cls(**values)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    def validate(self, section: str = "model") -> None:
        for key in ("hidden", "layers", "heads", "vocab", "seq_len", "kv_heads", "head_dim", "ffn_hidden"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise bad_value(f"{section}.{key}", value, "must be a positive integer")
            if value > MAX_SIZE[key]:  # beyond any model the planner studies (seed 003's 128T: h ~ 160k)
                raise bad_value(f"{section}.{key}", value, f"at most {MAX_SIZE[key]}")
        for key in ("norm_eps", "init_std", "rope_theta", "dropout"):
            if not math.isfinite(getattr(self, key)):
                raise bad_value(f"{section}.{key}", getattr(self, key), "a finite number")
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise bad_value(f"{section}.{key}", getattr(self, key), f"one of {', '.join(allowed)}")
        if self.heads % self.kv_heads:
            raise bad_value(f"{section}.kv_heads", self.kv_heads, f"must divide heads = {self.heads}")
        if self.position == "rope" and self.head_dim % 2:
            raise bad_value(f"{section}.head_dim", self.head_dim, "must be even for rope")
        if not 0.0 <= self.dropout < 1.0:
            raise bad_value(f"{section}.dropout", self.dropout, "must be in [0, 1)")
        if self.norm_eps <= 0 or self.init_std <= 0 or self.rope_theta <= 0:
            raise LubanError(f"{section}: norm_eps, init_std and rope_theta must be positive")


MAX_SIZE = {"hidden": 1 << 20, "layers": 1 << 16, "heads": 1 << 14, "kv_heads": 1 << 14, "head_dim": 1 << 14,
            "vocab": 1 << 24, "seq_len": 1 << 24, "ffn_hidden": 1 << 22}


def default_ffn(hidden: int, activation: str) -> int:
    """4h for GELU; for SwiGLU the Llama rule 2/3·4h rounded up to a multiple of 256."""
    if activation == "swiglu":
        return 256 * ((int(8 * hidden / 3) + 255) // 256)
    return 4 * hidden


def _coerce(key: str, value, typ):
    """Check a TOML/JSON value against the field type; ints are accepted for floats."""
    typ = {"int": int, "float": float, "bool": bool, "str": str}.get(typ, typ)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, bool) or not isinstance(value, typ):
        raise bad_value(key, value, f"must be of type {typ.__name__}")
    return value
