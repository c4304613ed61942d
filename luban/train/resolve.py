"""What a run's config resolves to before any model exists: the dataset (the embedded default
corpus is built on first use), the vocabulary it implies, the device. Light to import (no torch
at module level): the ``luban train --nproc`` launcher calls these before it starts any rank."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from luban.config import RunConfig
from luban.errors import LubanError, bad_value, shown
from luban.model import flops

if TYPE_CHECKING:
    import torch


def cache_dir() -> Path:
    """luban's cache (the default corpus's dataset, the planner's probe of this machine): ``$LUBAN_CACHE``,
    default ``~/.cache/luban``."""
    return Path(os.environ.get("LUBAN_CACHE", Path.home() / ".cache" / "luban"))


def dataset_path(cfg: RunConfig) -> Path:
    """The configured dataset, or the embedded default corpus (built on first use)."""
    if cfg.data.path:
        path = Path(cfg.data.path)
        if not (path / "manifest.json").is_file():
            raise bad_value("data.path", cfg.data.path, "no dataset there; build one with `luban data build`")
        return path
    from luban.data.build import ensure_default_dataset

    cache = cache_dir()
    try:
        return ensure_default_dataset(cache / "datasets" / "default-byte")
    except LubanError as err:  # the build's refusal names its --out, a flag this user never gave
        if type(err) is not LubanError or not str(err).startswith("--out = "):
            raise
        raise LubanError(f"LUBAN_CACHE = {shown(str(cache))}: the default dataset's folder "
                         f"{str(err)[len('--out = '):]}; or set data.path to a dataset") from None
    except OSError as err:  # LUBAN_CACHE a file, under /proc, unwritable: its folders cannot be made
        raise bad_value("LUBAN_CACHE", str(cache), f"a folder luban can write its cache into ({err.strerror or err}); "
                        "or set data.path to a dataset") from None


def checkpoint_model(cfg: RunConfig, resume: str | None) -> tuple[RunConfig, str | None]:
    """A resumed run whose config gives no ``[model]`` key takes the model of the checkpoint it
    resumes (``auto``: the newest in ``run.dir``; else the folder named), so that a model from
    ``luban import`` (a dozen keys) trains without copying them; returns the config and a note (None
    when unchanged). meta.json only: the ranks verify the checkpoint, and an unreadable one is
    named there (``Trainer.resume``)."""
    if not resume or cfg.model_keys:
        return cfg, None
    from luban.model.config import ModelConfig
    from luban.owned import step_dirs

    found = step_dirs(Path(cfg.run.dir) / "checkpoints") if resume == "auto" else [Path(resume)]
    meta = found[0] / "meta.json" if found else None
    if meta is None or not meta.is_file():  # none yet (a fresh start), or not a regular file: not read
        return cfg, None
    try:
        saved = json.loads(meta.read_text())["config"]["model"]
        model = ModelConfig(**saved)
    except (OSError, ValueError, KeyError, TypeError, RecursionError, LubanError):
        return cfg, None
    if cfg.data.seq_len > model.seq_len:
        raise bad_value("data.seq_len", cfg.data.seq_len, f"must be <= model.seq_len = {model.seq_len}, the model of "
                        f"the checkpoint --resume names ({found[0]})")
    note = f"[model]: the checkpoint's ({found[0]}): {model.name or model.arch}, {flops.param_count(model):,} parameters"
    return cfg.replace(model=model, model_keys=frozenset(saved)), note


def fit_vocab(cfg: RunConfig) -> tuple[RunConfig, str | None]:
    """A vocabulary the config did not set (it came from the preset) grows to the dataset's
    tokenizer vocabulary, so a BPE dataset trains on any preset; returns the config and a note
    (None when unchanged). An explicit ``model.vocab`` is kept (``Trainer`` names it if too small)."""
    if not cfg.data.path or "vocab" in cfg.model_keys:
        return cfg, None
    from luban.data.manifest import load_manifest

    vocab = load_manifest(dataset_path(cfg))["tokenizer"]["vocab_size"]
    if not isinstance(vocab, int) or vocab <= cfg.model.vocab:
        return cfg, None
    note = (f"model.vocab = {vocab}: the dataset's tokenizer vocabulary ({cfg.data.path}); the preset's "
            f"{cfg.model.vocab} is smaller (set model.vocab to choose another)")
    return cfg.replace(model=cfg.model.replace(vocab=vocab)), note


def pick_device(choice: str) -> torch.device:
    import torch

    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise bad_value("run.device", choice, "no CUDA device here; use cpu or auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
