"""What a run's config resolves to before any model exists: the dataset (the embedded default
corpus is built on first use), the vocabulary it implies, the device. Light to import (no torch
at module level): the ``luban train --nproc`` launcher calls these before it starts any rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from luban.config import RunConfig
from luban.errors import bad_value

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
    except OSError as err:  # LUBAN_CACHE a file, under /proc, unwritable: its folders cannot be made
        raise bad_value("LUBAN_CACHE", str(cache), f"a folder luban can write its cache into ({err.strerror or err}); "
                        "or set data.path to a dataset") from None


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
