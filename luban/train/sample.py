"""Load the weights of any luban checkpoint into one process, and generate text from them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from luban.errors import LubanError
from luban.model.config import ModelConfig
from luban.model.transformer import Transformer, build_model
from luban.train import checkpoint


def checkpoint_dir(path: str) -> Path:
    """A checkpoint directory, or a run directory (its newest valid checkpoint)."""
    p = Path(path)
    if (p / "checkpoints").is_dir():
        found = checkpoint.latest_valid(p / "checkpoints")
        if found is None:
            raise LubanError(f"CHECKPOINT = {path!r}: the run has no valid checkpoint")
        return found
    if not (p / "meta.json").is_file():
        raise LubanError(f"CHECKPOINT = {path!r}: not a checkpoint directory (no meta.json) nor a run directory")
    problem = checkpoint.verify(p)
    if problem:
        raise LubanError(f"CHECKPOINT = {path!r}: not valid: {problem}")
    return p


def load_model(path: str) -> tuple[Transformer, dict]:
    """Rebuild the model of a checkpoint written under any layout; returns (model, meta)."""
    ckpt = checkpoint_dir(path)
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
        cfg = ModelConfig.from_dict(meta["config"]["model"])
    except LubanError as err:
        raise LubanError(f"{ckpt / 'meta.json'}: {err}") from None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
        raise LubanError(f"CHECKPOINT = {path!r}: meta.json has no readable model config "
                         f"({err})".replace("\n", " ")) from None
    check_host_memory(path, cfg)
    model = build_model(cfg)
    state = {"model": model.state_dict()}
    try:
        dcp.load(state, checkpoint_id=str(ckpt))
    except (Exception, dcp.api.CheckpointException) as err:  # noqa: BLE001 - a damaged or foreign checkpoint,
        # whatever the library raises (its CheckpointException derives from BaseException, not Exception)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise LubanError(f"CHECKPOINT = {path!r}: its weights cannot be read ({first})") from None
    model.load_state_dict(state["model"])
    return model.eval(), meta


IMPORT_COPIES = 2  # float32 copies an import holds at its peak: the converted tensors and luban's state of them


def check_host_memory(path: str, cfg: ModelConfig, key: str = "CHECKPOINT", file_bytes: int = 0) -> None:
    """The model is built here in float32, in host memory: one that cannot fit (a checkpoint trained on a
    cluster, read on a laptop) is refused in one line, not failed in the allocator or killed by the kernel.
    ``file_bytes`` (a Hugging Face folder ``luban import`` reads, ``key`` = ``FOLDER``): its weight files, read
    whole, beside ``IMPORT_COPIES`` float32 copies (measured 2026-12-04: a bf16 folder's import peaked at
    2.25x the model's float32 size, an fp32 one's at 1.65x; the check asked for 1x and the kernel killed it)."""
    from luban.model.flops import param_count
    from luban.train.memcheck import GIB, mem_available

    params, available = param_count(cfg), mem_available()
    need = (IMPORT_COPIES * 4 * params + file_bytes) if file_bytes else 4 * params
    if os.environ.get("LUBAN_SKIP_MEMORY_CHECK") or available is None or need <= available:
        return
    how = "to import (its weight files, then float32 copies)" if file_bytes else "in float32"
    raise LubanError(f"{key} = {path!r}: its model ({cfg.name}, {params:,} parameters) needs "
                     f"{need / GIB:.1f} GiB of host memory {how}, but {available / GIB:.1f} GiB is "
                     "available; read it on a machine with more memory")


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int, temperature: float = 0.8,
             top_k: int = 40, seed: int = 0) -> list[int]:
    """Autoregressive sampling with temperature and top-k (greedy when temperature is 0).
    ``FloatingPointError`` if the model computes a NaN or infinite logit."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-model.cfg.seq_len:]])
        logits = model(context)[0, -1].float()
        if not torch.isfinite(logits).all():  # finite weights whose logits overflow: a diverged run
            raise FloatingPointError("the model's logits are not finite numbers")
        if temperature <= 0:
            ids.append(int(logits.argmax()))
            continue
        # shifted first: the likeliest token's logit is 0 and the others at most 0, so a low temperature
        # cannot overflow them to inf (finite logits of 6e35 over 0.001 did: NaN probabilities, a crash)
        logits = (logits - logits.max()) / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=gen)))
    return ids
