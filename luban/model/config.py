"""``ModelConfig``: the single description of a decoder-only transformer.

The same object builds the network (``luban.model.transformer``), feeds the FLOPs and
parameter formulas (``luban.model.flops``) used by the trainer's MFU and by the planner.
Schema (TOML ``[model]`` or JSON; every key optional: ``from_dict`` takes the keys a table does
not give from ``preset``, ``DEFAULT_PRESET`` = tiny when none is named; the defaults below are the
constructor's, ``ModelConfig(...)``, which is GPT-2 124M's shape):

==================  =========================================================  =============
key                 meaning                                                    default
==================  =========================================================  =============
preset              start from a named preset (``luban.model.presets``)        tiny (a table)
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
qk_norm             RMSNorm on each query/key head before RoPE (Qwen3)         false
experts             routed experts per MoE layer; 0 = dense (``model.moe``)     0
experts_per_token   experts each token is routed to (top-k)                    2
expert_ffn_hidden   inner width of one expert                                  ffn_hidden
shared_experts      always-on experts (DeepSeekMoE), each expert_ffn_hidden     0
                    (needs experts > 0)
dense_layers        the first k layers keep a dense MLP (ffn_hidden)           0
                    (needs experts > 0)
router              ``softmax`` top-k, or ``sigmoid`` with DeepSeek-V3's        softmax
                    auxiliary-loss-free bias balancing
router_bias_rate    sigmoid router: bias update per step (DeepSeek-V3's gamma)  0.001
aux_loss_coef       weight of the load-balancing loss (Switch); 0 = none        0.01
capacity_factor     0 = dropless; c > 0 caps an expert at ceil(c*T*k/E) tokens  0.0
==================  =========================================================  =============
"""

from __future__ import annotations

import math

import dataclasses
from dataclasses import dataclass, field

from luban.errors import bad_value, unknown_key

ARCH_DEFAULTS = {
    "gpt2": dict(norm="layernorm", activation="gelu", position="learned", bias=True, tie_embeddings=True),
    "llama": dict(norm="rmsnorm", activation="swiglu", position="rope", bias=False, tie_embeddings=False),
}
DEFAULT_PRESET = "tiny"  # a model table's keys not given come from this preset unless `preset` names another
# A derived key is recomputed when a key it depends on is overridden (unless also given).
MOE_ONLY = ("shared_experts", "dense_layers")  # refused on a dense model (experts = 0)
DERIVED = {"head_dim": ("hidden", "heads"), "kv_heads": ("heads",), "ffn_hidden": ("hidden", "activation")}
CHOICES = {
    "arch": tuple(ARCH_DEFAULTS),
    "norm": ("layernorm", "rmsnorm"),
    "activation": ("gelu", "swiglu"),
    "position": ("learned", "rope"),
    "router": ("softmax", "sigmoid"),
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
    # the arch's parts (ARCH_DEFAULTS) unless given: None is filled in by __post_init__, so that
    # ModelConfig(arch="llama", ...) is a Llama (SwiGLU, RMSNorm, RoPE, no biases, untied), not GPT-2's parts
    tie_embeddings: bool = None
    norm: str = None
    norm_eps: float = 1e-5
    activation: str = None
    position: str = None
    rope_theta: float = 10000.0
    bias: bool = None
    dropout: float = 0.0
    init_std: float = 0.02
    qk_norm: bool = False
    experts: int = 0  # 0: dense
    experts_per_token: int = 2
    expert_ffn_hidden: int = 0  # 0: ffn_hidden
    shared_experts: int = 0
    dense_layers: int = 0
    router: str = "softmax"
    router_bias_rate: float = 0.001  # DeepSeek-V3 (Liu et al. 2024), Sec. 2.1.2: gamma
    aux_loss_coef: float = 0.01  # Switch Transformer (Fedus et al. 2021), Sec. 2.2: alpha = 1e-2
    capacity_factor: float = 0.0  # 0: dropless
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        for key, value in ARCH_DEFAULTS.get(self.arch, ARCH_DEFAULTS["gpt2"]).items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        # a width that validate() refuses anyway (<= 0, beyond MAX_SIZE) is named there, not blamed on heads
        if self.head_dim == 0 and self.heads > 0 and 0 < self.hidden <= MAX_SIZE["hidden"] and self.hidden % self.heads:
            raise bad_value("model.heads", self.heads, f"must divide hidden = {self.hidden}")
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.head_dim == 0 and self.heads > 0:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.ffn_hidden == 0:
            object.__setattr__(self, "ffn_hidden", default_ffn(self.hidden, self.activation))
        if self.expert_ffn_hidden == 0 and isinstance(self.ffn_hidden, int):
            object.__setattr__(self, "expert_ffn_hidden", self.ffn_hidden)
        self.validate()

    @classmethod
    def from_dict(cls, raw: dict, section: str = "model") -> "ModelConfig":
        """Build from a TOML/JSON table; ``preset`` (default ``DEFAULT_PRESET``) and ``arch`` fill in
        unspecified keys. The one resolution for every reader: ``luban train``'s ``[model]`` and
        ``luban plan --model FILE`` make the same model of the same table."""
        from luban.model.presets import get_preset

        raw = dict(raw)
        known = {f.name for f in dataclasses.fields(cls)} | {"preset"}
        for key in raw:
            if key not in known:
                raise unknown_key(section, key, raw[key], sorted(known))
        base = dataclasses.asdict(get_preset(raw.pop("preset", DEFAULT_PRESET)))
        if "arch" in raw and raw["arch"] != base["arch"]:
            base = {k: v for k, v in base.items() if k not in ARCH_DEFAULTS["gpt2"]}
        arch = raw.get("arch", base["arch"])
        if not isinstance(arch, str) or arch not in ARCH_DEFAULTS:
            raise bad_value(f"{section}.arch", arch, f"one of {', '.join(ARCH_DEFAULTS)}")
        values = {**ARCH_DEFAULTS[arch], **base, **raw}
        if "name" not in raw:
            values["name"] = base["name"] if set(raw) <= {"name"} else f"{base['name']}-custom"
        for key, sources in DERIVED.items():  # re-derive what the overrides change
            if key not in raw and any(src in raw for src in sources):
                values[key] = 0
        # expert_ffn_hidden is not re-derived: a preset's is its own (Mixtral's 14336 is HF's
        # intermediate_size, not "ffn_hidden"), and a run's checkpoints record the one it resolved to
        # (``Trainer._check_compatible`` compares it: re-deriving refused the resume of every run that
        # overrides hidden, 2026-12-03)
        if raw.get("experts") == 0:  # a MoE preset made dense: its MoE-only keys go with its experts
            values.update({key: 0 for key in MOE_ONLY if key not in raw})
        for f in dataclasses.fields(cls):
            if f.name in values:
                values[f.name] = _coerce(f"{section}.{f.name}", values[f.name], f.type)
        heads, hidden = values["heads"], values["hidden"]
        if ("hidden" in raw and "heads" not in raw and values["head_dim"] == 0 and heads > 0
                and 0 < hidden <= MAX_SIZE["hidden"] and hidden % heads):  # the width given is the one to name
            raise bad_value(f"{section}.hidden", hidden, f"a multiple of {section}.heads = {heads} (the preset "
                            f"{base['name']}'s): set {section}.heads too, or {section}.head_dim")
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
        for key in ("norm_eps", "init_std", "rope_theta"):
            if not getattr(self, key) > 0:
                raise bad_value(f"{section}.{key}", getattr(self, key), "must be positive")
        self._validate_moe(section)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        """Number of layers whose feed-forward is a mixture of experts."""
        return self.layers - self.dense_layers if self.moe else 0

    def _validate_moe(self, section: str) -> None:
        for key in ("experts", "shared_experts", "dense_layers"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value > MAX_SIZE[key]:
                raise bad_value(f"{section}.{key}", value, f"an integer in [0, {MAX_SIZE[key]}]")
        for key in ("experts_per_token", "expert_ffn_hidden"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_SIZE[key]:
                raise bad_value(f"{section}.{key}", value, f"an integer in [1, {MAX_SIZE[key]}]")
        for key in ("router_bias_rate", "aux_loss_coef", "capacity_factor"):
            value = getattr(self, key)
            if not math.isfinite(value) or value < 0:
                raise bad_value(f"{section}.{key}", value, "a finite number >= 0")
        if not self.moe:
            for key in MOE_ONLY:  # they would change nothing: say so rather than train a different model
                if getattr(self, key):
                    raise bad_value(f"{section}.{key}", getattr(self, key),
                                    f"needs experts > 0 (a dense model has no {key}); "
                                    f"set {section}.experts or remove {section}.{key}")
            return
        if self.experts_per_token > self.experts:
            raise bad_value(f"{section}.experts_per_token", self.experts_per_token,
                            f"at most experts = {self.experts}")
        if self.dense_layers >= self.layers:
            raise bad_value(f"{section}.dense_layers", self.dense_layers,
                            f"must be < layers = {self.layers} (use experts = 0 for a dense model)")
        if self.capacity_factor and self.capacity_factor * self.experts_per_token < 1:
            raise bad_value(f"{section}.capacity_factor", self.capacity_factor,
                            f"0 (dropless) or >= 1/experts_per_token = {1 / self.experts_per_token:g}")


MAX_SIZE = {"hidden": 1 << 20, "layers": 1 << 16, "heads": 1 << 14, "kv_heads": 1 << 14, "head_dim": 1 << 14,
            "vocab": 1 << 24, "seq_len": 1 << 24, "ffn_hidden": 1 << 22, "expert_ffn_hidden": 1 << 22,
            "experts": 1 << 16, "experts_per_token": 1 << 16, "shared_experts": 1 << 10, "dense_layers": 1 << 16}


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
