"""Rank program of ``test_review_1203b``: saves (synchronous and in the background) that fail on
one rank only, at each step of ``checkpoint._save``; every rank must raise the same one-line
``CheckpointWriteError`` for a storage error (none may wait in a barrier for a rank that already
gave up), a bug must show as itself where it happened, the last good checkpoint must stay whole,
and the next save must work on every rank.

``python -m tests.train.save_fail_ranks ROOT OUT``: writes ``OUT/rank<R>.json`` ({case: what this
rank raised, as "Type: message", or ``null`` where the save succeeded; case + ": newest": the
newest valid checkpoint after it}) and ends. The default group's timeout is short (``TIMEOUT``):
a rank left waiting in a synchronous save fails with gloo's timeout instead of hanging the test
(the background writer's own group keeps torch's default; ``launch``'s bound catches that one).
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

from luban.train import checkpoint

TIMEOUT = timedelta(seconds=45)
EIO = OSError(errno.EIO, os.strerror(errno.EIO))
BUG = ValueError("a bug")
# name -> {rank: (what fails there, what it raises)}; "copy" is the background copy to host memory
# (async only); torch.save fails only for the RNG file; file_entries is the fsync and checksum
CASES = {
    "prepare": {0: ("_prepare", EIO)},
    "rng": {1: ("torch.save", EIO)},
    "fsync": {1: ("file_entries", EIO)},
    "publish": {0: ("_publish", EIO)},
    "exchange": {0: ("_exchange", EIO)},
    "look": {1: ("_refuse_foreign", EIO)},
    "copy": {1: ("copy", EIO)},
    "bug": {1: ("_own_files", BUG)},
    "bug and storage": {0: ("_publish", EIO), 1: ("_own_files", BUG)},
}
ASYNC_ONLY = {"copy"}


def meta(step: int) -> dict:
    return {"step": step, "config": {"model": {}}, "world_size": dist.get_world_size()}


def broken(point: str, error: BaseException):
    """Patch ``point`` to raise ``error``; returns the undo."""
    def failing(*args, **kwargs):
        raise error

    if point == "torch.save":
        real = torch.save

        def save(obj, f, *args, **kwargs):
            if str(f).endswith(f"rng_rank{dist.get_rank()}.pt"):
                failing()
            return real(obj, f, *args, **kwargs)

        torch.save = save
        return lambda: setattr(torch, "save", real)
    owner = checkpoint.HostStager if point == "copy" else checkpoint
    real = getattr(owner, point)
    setattr(owner, point, failing)
    return lambda: setattr(owner, point, real)


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
        for name, where in CASES.items():
            if mode == "sync" and name in ASYNC_ONLY:
                continue
            step += 1
            if name == "exchange":  # a re-save of a step that has a checkpoint
                checkpoint.save(root, step, state(step), meta(step), keep=2)
            undo = broken(*where[rank]) if rank in where else (lambda: None)
            case = f"{mode} {name}"
            try:
                if mode == "sync":
                    checkpoint.save(root, step, state(step), meta(step), keep=2)
                else:
                    writer.save(step, state(step), meta(step))
                    writer.wait()
                results[case] = None
            except Exception as err:  # noqa: BLE001 - what each rank raised is the result
                results[case] = f"{type(err).__name__}: {err} everywhere={getattr(err, 'everywhere', None)}"
            finally:
                undo()
            newest = checkpoint.latest_valid(root)
            results[case + ": newest"] = newest.name if newest is not None else None
            results[case + ": step"] = step
    step += 1
    checkpoint.save(root, step, state(step), meta(step), keep=2)
    results["after"] = checkpoint.latest_valid(root).name
    results["after: step"] = step
    Path(out, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
