"""Rank program of ``test_review_1203b``: saves (synchronous and in the background) that fail on
one rank only, at each step of ``checkpoint._save``; every rank must raise the same one-line
``CheckpointWriteError`` (none may wait in a barrier for a rank that already gave up), the last
good checkpoint must stay whole, and the next save must work on every rank.

``python -m tests.train.save_fail_ranks ROOT OUT``: writes ``OUT/rank<R>.json`` (the message each
case raised, or ``null`` where a save succeeded) and ends. The process group's timeout is short
(``TIMEOUT``): a rank left waiting fails the case with gloo's timeout instead of hanging the test.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from luban.errors import CheckpointWriteError
from luban.train import checkpoint

TIMEOUT = timedelta(seconds=45)
# (the function of checkpoint that fails, the rank it fails on); torch.save writes the RNG states
POINTS = [("_prepare", 0), ("torch.save", 1), ("_publish", 0), ("_exchange", 0), ("_refuse_foreign", 1)]


def meta(step: int) -> dict:
    return {"step": step, "config": {"model": {}}, "world_size": dist.get_world_size()}


def failing(*args, **kwargs):
    raise OSError(errno.EIO, os.strerror(errno.EIO))


def broken(point: str):
    """Patch ``point`` to raise EIO (torch.save only for the RNG file); returns the undo."""
    if point == "torch.save":
        real = torch.save

        def save(obj, f, *args, **kwargs):
            if str(f).endswith(f"rng_rank{dist.get_rank()}.pt"):
                failing()
            return real(obj, f, *args, **kwargs)

        torch.save = save
        return lambda: setattr(torch, "save", real)
    real = getattr(checkpoint, point)
    setattr(checkpoint, point, failing)
    return lambda: setattr(checkpoint, point, real)


def main(root: str, out: str) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank, root = dist.get_rank(), Path(root)
    state = lambda step: {"w": torch.full((64,), float(step))}  # noqa: E731
    results: dict[str, str | None] = {}
    checkpoint.save(root, 1, state(1), meta(1), keep=2)
    writer = checkpoint.AsyncCheckpointer(root, keep=2)
    step = 1
    for mode in ("sync", "async"):
        for point, where in POINTS:
            step += 1
            saved = step if point == "_exchange" else None  # a re-save of a step that has a checkpoint
            if saved is not None:
                checkpoint.save(root, step, state(step), meta(step), keep=2)
            undo = broken(point) if rank == where else (lambda: None)
            case = f"{mode} {point} on rank {where}"
            try:
                if mode == "sync":
                    checkpoint.save(root, step, state(step), meta(step), keep=2)
                else:
                    writer.save(step, state(step), meta(step))
                    writer.wait()
                results[case] = None
            except CheckpointWriteError as err:
                results[case] = f"{err} everywhere={err.everywhere}"
            finally:
                undo()
            newest = checkpoint.latest_valid(root)
            results[case + ": newest"] = newest.name if newest is not None else None
    step += 1
    checkpoint.save(root, step, state(step), meta(step), keep=2)
    results["after"] = checkpoint.latest_valid(root).name
    Path(out, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
