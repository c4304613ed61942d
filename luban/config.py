"""The run configuration: one TOML file with sections ``[model] [data] [train] [parallel] [run]``.

``load_config(path, overrides)`` reads the file, applies ``--set section.key=value`` overrides
(values parsed as TOML literals, else taken as strings), checks every key and type, and
returns a ``RunConfig``. Mistakes raise ``LubanError`` naming the key, the value and what is
allowed. The resolved config is saved in every checkpoint. Schema: docs/training.md.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from luban import schema
from luban.errors import LubanError, bad_value, unknown_key
from luban.model.config import DEFAULT_PRESET, ModelConfig, _coerce
from luban.model.presets import get_preset
from luban.parallel.layout import MAX_GLOBAL_BATCH, ParallelLayout


@dataclass(frozen=True)
class DataConfig:
    path: str = ""  # dataset dir built by `luban data build`; "" = the embedded default corpus
    seq_len: int = 0  # 0: model.seq_len
    prefetch: int = 2
    eval_batches: int = 4


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    global_batch: int = 16  # sequences per optimizer step
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    optimizer: str = "adamw"  # adamw | sgd
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    momentum: float = 0.0
    grad_clip: float = 1.0  # 0 disables clipping
    seed: int = 0
    checkpoint_every: int = 100  # 0: only at the end
    checkpoint_every_minutes: float = 0.0  # also save when this much wall time passed since the last save; 0: off
    async_checkpoint: bool = True  # stage to host memory, write in the background (sync where unsafe)
    keep_checkpoints: int = 3
    eval_every: int = 50  # 0: never
    log_every: int = 1
    compile: str = "auto"  # torch.compile each block and the head + loss: "auto" (on CUDA) | true | false
    deterministic: bool = False  # bitwise-reproducible kernels on a GPU (slower); the CPU is always


@dataclass(frozen=True)
class RunSection:
    dir: str = "runs/demo"
    tensorboard: bool = True
    progress: str = "auto"  # auto | bar | plain | none
    device: str = "auto"  # auto | cpu | cuda
    system: str = ""  # planner system profile for --parallel auto ("" = probe this machine)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=lambda: get_preset(DEFAULT_PRESET))
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    run: RunSection = field(default_factory=RunSection)
    # [model] keys the config file or --set gave (the rest come from the preset): a vocabulary
    # the user did not choose follows the dataset's tokenizer (luban.train.resolve.fit_vocab)
    model_keys: frozenset = field(default=frozenset(), compare=False, repr=False)

    @property
    def seq_len(self) -> int:
        return self.data.seq_len or self.model.seq_len

    @property
    def seq_len_key(self) -> str:
        """The setting ``seq_len`` comes from, as an error names it."""
        return "data.seq_len" if self.data.seq_len else "model.seq_len"

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "data": dataclasses.asdict(self.data),
                "train": dataclasses.asdict(self.train), "parallel": self.parallel.to_dict(),
                "run": dataclasses.asdict(self.run)}

    def replace(self, **sections) -> "RunConfig":
        return dataclasses.replace(self, **sections)


SECTIONS = ("model", "data", "train", "parallel", "run")
CHOICES = {("train", "optimizer"): ("adamw", "sgd"), ("train", "compile"): ("auto", "true", "false"), ("run", "progress"): ("auto", "bar", "plain", "none"),
           ("run", "device"): ("auto", "cpu", "cuda")}
AUTO_OR_BOOL = {("train", "compile")}  # "auto", or a TOML boolean (kept as "true"/"false")
NON_NEGATIVE = {("train", k) for k in ("checkpoint_every", "checkpoint_every_minutes", "eval_every", "warmup_steps", "momentum", "weight_decay",
                                       "grad_clip", "seed", "min_lr")} | {("data", "seq_len"), ("data", "prefetch"),
                                                                          ("data", "eval_batches")}


# upper bounds (inclusive) and a few tighter lower ones: past these a run cannot be meant
# (steps for 3 years at 1 step/s; a global batch beyond 2^20 sequences), or a library breaks
# (torch/numpy seeds are 32-bit here: luban.schema.SEED; Adam's betas must be < 1)
MAX_STEPS = 10**8  # train.steps; so also the step a checkpoint may name (luban.train.checkpoint.meta_problem)
MAX_SAMPLES = MAX_STEPS * MAX_GLOBAL_BATCH  # so the samples a checkpoint's loader may have consumed (meta_problem)
RANGES = {("train", "steps"): (1, MAX_STEPS), ("train", "global_batch"): (1, MAX_GLOBAL_BATCH), ("train", "seed"): schema.SEED,
          ("train", "lr"): (1e-12, 10.0), ("train", "min_lr"): (0.0, 10.0), ("train", "beta1"): (0.0, 0.999999),
          ("train", "beta2"): (0.0, 0.999999999), ("train", "momentum"): (0.0, 0.999999),
          ("train", "warmup_steps"): (0, 10**8), ("train", "checkpoint_every"): (0, 10**8),
          ("train", "checkpoint_every_minutes"): (0.0, 10**6),
          ("train", "eval_every"): (0, 10**8), ("train", "log_every"): (1, 10**8), ("train", "keep_checkpoints"): (1, 10**4),
          ("train", "grad_clip"): (0.0, 1e6), ("train", "weight_decay"): (0.0, 10.0),
          ("data", "eval_batches"): (1, 10**6), ("data", "prefetch"): (0, 64), ("data", "seq_len"): (0, 1 << 24)}


PATHS = {("run", "dir"), ("data", "path")}  # looked up on the file system (check_path)


def check_resume(resume: str | None) -> None:
    """``--resume DIR`` names a folder: refused at once, before a run folder is made or a layout planned
    (``luban train --resume /typo`` made run.dir, then said so). What the folder holds is checked later
    (``luban.train.checkpoint.resolve``)."""
    if resume in (None, "auto"):
        return
    check_path("--resume", resume)
    if not Path(resume).is_dir():
        raise LubanError(f"--resume = {resume!r}: no such checkpoint directory (or use 'auto')")


def check_path(key: str, value: str) -> None:
    """A path the file system can look up: one it refuses as too long (a name over 255 bytes) is one
    line here, not an ``OSError`` (pathlib raises ENAMETOOLONG) wherever it is first used."""
    try:
        os.stat(value)
    except OSError as err:
        if err.errno == errno.ENAMETOOLONG:
            raise bad_value(key, value, f"a path the file system can take ({err.strerror})") from None
    except ValueError:  # a NUL character: named where the path is used
        pass


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _section(cls, raw: dict, name: str):
    known = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in raw.items():
        if key not in known:
            raise unknown_key(name, key, value, known)
        if (name, key) in AUTO_OR_BOOL and isinstance(value, bool):
            value = "true" if value else "false"
        value = _coerce(f"{name}.{key}", value, known[key].type)
        if (name, key) in CHOICES and value not in CHOICES[(name, key)]:
            raise bad_value(f"{name}.{key}", value, f"one of {', '.join(CHOICES[(name, key)])}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise bad_value(f"{name}.{key}", value, "a finite number")
            floor = 0 if (name, key) in NON_NEGATIVE else 1e-300
            if value < floor:
                raise bad_value(f"{name}.{key}", value, "must be >= 0" if floor == 0 else "must be positive")
            lo, hi = RANGES.get((name, key), (floor, math.inf))
            if not lo <= value <= hi:
                raise bad_value(f"{name}.{key}", value, f"from {_num(lo)} to {_num(hi)}")
        if isinstance(value, str) and (name, key) == ("run", "dir") and not value.strip():
            raise bad_value("run.dir", value, "a folder for the run (checkpoints, metrics)")
        if (name, key) in PATHS:
            check_path(f"{name}.{key}", value)
        values[key] = value
    return cls(**values)


def parse_override(item: str) -> tuple[str, str, object]:
    """``section.key=value`` -> (section, key, value); the value is a TOML literal or a bare string."""
    target, sep, text = item.partition("=")
    section, dot, key = target.strip().partition(".")
    if not sep or not dot or not key:
        raise bad_value("--set", item, "expected section.key=value, e.g. train.steps=100")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return section, key.strip(), value


def toml_value(value) -> str:
    """``value`` (a bool, number, text or list of them) as a TOML literal, the form ``parse_override``
    reads back: every TOML luban writes (a ``[parallel]`` block, a profile) goes through here."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # a TOML basic string: quote, backslash and the controls (DEL too) escaped
        return '"' + "".join(f"\\u{ord(c):04x}" if c in '"\\' or ord(c) < 0x20 or ord(c) == 0x7F else c
                             for c in value) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if value != value else "inf" if value > 0 else "-inf")
    return str(value)


def config_from_dict(raw: dict) -> RunConfig:
    for name in raw:
        if name not in SECTIONS:
            raise bad_value("section", name, f"unknown; allowed: {', '.join(SECTIONS)}")
        if not isinstance(raw[name], dict):
            raise bad_value(name, raw[name], "must be a table of keys")
    model = ModelConfig.from_dict(raw.get("model", {}))
    cfg = RunConfig(model=model,
                    data=_section(DataConfig, raw.get("data", {}), "data"),
                    train=_section(TrainConfig, raw.get("train", {}), "train"),
                    parallel=ParallelLayout.from_dict(raw.get("parallel", {})),
                    run=_section(RunSection, raw.get("run", {}), "run"),
                    model_keys=frozenset(raw.get("model", {})))
    if cfg.seq_len > cfg.model.seq_len:
        raise bad_value("data.seq_len", cfg.data.seq_len, f"must be <= model.seq_len = {cfg.model.seq_len}")
    if cfg.train.min_lr > cfg.train.lr:
        raise bad_value("train.min_lr", cfg.train.min_lr, f"must be <= train.lr = {cfg.train.lr}")
    return cfg


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise bad_value("CONFIG", str(path), "a TOML file (this is a folder)" if path.is_dir() else "no such file")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise LubanError(f"{path}: not valid TOML: {err}") from None
        except (UnicodeDecodeError, OSError) as err:
            raise bad_value("CONFIG", str(path), f"a readable UTF-8 TOML file ({type(err).__name__})") from None
        for name, table in raw.items():  # before any --set lands in it
            if name in SECTIONS and not isinstance(table, dict):
                raise bad_value(f"{path}: {name}", table, f"a table of keys ([{name}] ...)")
    from_file = {f"{name}.{key}" for name, table in raw.items() if isinstance(table, dict) for key in table}
    overridden = set()
    for item in overrides:
        section, key, value = parse_override(item)
        raw.setdefault(section, {})[key] = value
        overridden.add(f"{section}.{key}")
    try:
        return config_from_dict(raw)
    except LubanError as err:  # a value from the file: name the file
        first = str(err).split(" ", 1)[0].rstrip(":")
        if first in from_file - overridden:
            raise LubanError(f"{path}: {err}") from None
        raise
