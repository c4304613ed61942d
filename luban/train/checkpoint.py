"""Exact, atomic checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of ``<run>/checkpoints/step_0000100/``:
  ``.metadata``, ``*.distcp``  model + optimizer (+ loss scaler), global parameter names, so
                               the same files load under any parallel layout (DCP reshards);
  ``meta.json``                step, data-loader position, resolved config, layout, world size;
  ``rng_rank{R}.pt``           each rank's CPU/CUDA RNG state (restored when the world size matches);
  ``manifest.json``            CRC32 and size of every file above — written last.

A save goes to ``.tmp-step_0000100`` and is renamed into place only once every rank has
written and the manifest is on disk, so a crash or kill during a save never touches the
previous checkpoint; a directory is valid only if its manifest's checksums match.
``latest_valid`` finds the newest valid one for ``--resume auto``; the last K are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from luban.errors import CheckpointWriteError, LubanError

# DCP warns on every single-process save/load; that is the intended mode for one rank.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

STEP_DIR = re.compile(r"^step_(\d{7,})$")
CHUNK = 16 << 20


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def _barrier() -> None:
    if _is_dist():
        dist.barrier()


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(ckpt: Path) -> None:
    files = {}
    for f in sorted(ckpt.iterdir()):
        if f.is_file() and f.name != "manifest.json":
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
            files[f.name] = {"bytes": f.stat().st_size, "crc32": file_crc32(f)}
    tmp = ckpt / "manifest.json.tmp"
    tmp.write_text(json.dumps({"files": files}, indent=1))
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    tmp.rename(ckpt / "manifest.json")
    _fsync_dir(ckpt)


def verify(ckpt: Path) -> str | None:
    """``None`` if every file matches the manifest, else the reason it does not."""
    manifest = ckpt / "manifest.json"
    if not manifest.is_file():
        return "no manifest.json (save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return "manifest.json is not valid"
    for name, entry in files.items():
        f = ckpt / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != entry["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, manifest says {entry['bytes']}"
        if file_crc32(f) != entry["crc32"]:
            return f"{name} fails its CRC32 check"
    return None


def step_dirs(root: Path) -> list[Path]:
    """Finished checkpoint directories, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)), reverse=True)


def latest_valid(root: Path) -> Path | None:
    for ckpt in step_dirs(root):
        if verify(ckpt) is None:
            return ckpt
        print(f"luban: skipping checkpoint {ckpt}: {verify(ckpt)}", flush=True)
    return None


def resolve(resume: str, root: Path) -> Path | None:
    """``--resume``: ``auto`` (newest valid, or none), or a checkpoint directory."""
    if resume == "auto":
        return latest_valid(root)
    path = Path(resume)
    if not path.is_dir():
        raise LubanError(f"--resume = {resume!r}: no such checkpoint directory (or use 'auto')")
    problem = verify(path)
    if problem:
        raise LubanError(f"--resume = {resume!r}: checkpoint is not valid: {problem}")
    return path


def save(root: Path, step: int, state: dict, meta: dict, keep: int) -> Path:
    """Collective: every rank calls it with its own ``state``; returns the final directory.

    A storage error (disk full, read-only, permission) is one line and exit code 74
    (``CheckpointWriteError``); the half-written ``.tmp-`` directory is removed and the previous
    checkpoint is untouched."""
    try:
        return _save(root, step, state, meta, keep)
    except (OSError, dcp.api.CheckpointException) as err:
        shutil.rmtree(root / f".tmp-step_{step:07d}", ignore_errors=True)
        raise CheckpointWriteError(f"checkpoint step {step} could not be written under {root}: {_storage_error(err)}; "
                                   "the previous checkpoint is intact — free space or fix the folder, then "
                                   "resume with --resume auto") from None


def _storage_error(err: BaseException) -> str:
    """The OSError behind ``err`` (DCP wraps each rank's failure), as 'No space left on device'."""
    seen = [err]
    while seen:
        e = seen.pop()
        if isinstance(e, OSError) and e.strerror:
            return e.strerror
        seen += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)  # DCP: {rank: (exception, traceback summary)}
        for failure in (failures.values() if isinstance(failures, dict) else []):
            seen += [x for x in (failure if isinstance(failure, tuple) else (failure,)) if isinstance(x, BaseException)]
    return str(err).splitlines()[0][:200]


def _save(root: Path, step: int, state: dict, meta: dict, keep: int) -> Path:
    final = root / f"step_{step:07d}"
    tmp = root / f".tmp-{final.name}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir()
    _barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, tmp / f"rng_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        write_manifest(tmp)
        if final.exists():  # re-saving the same step (e.g. suspend right after a periodic save)
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(root)
        for old in step_dirs(root)[max(keep, 1):]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load(ckpt: Path, state: dict) -> dict:
    """Collective: fill ``state`` (this rank's tensors, any layout) in place; return meta.json.

    RNG states come back when the checkpoint was written by the same world size."""
    meta = json.loads((ckpt / "meta.json").read_text())
    dcp.load(state, checkpoint_id=str(ckpt))
    world = dist.get_world_size() if _is_dist() else 1
    rng_file = ckpt / f"rng_rank{_rank()}.pt"
    if meta.get("world_size") == world and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return meta
