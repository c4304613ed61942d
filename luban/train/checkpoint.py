"""Exact, atomic checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of ``<run>/checkpoints/step_0000100/``:
  ``.metadata``, ``*.distcp``  model + optimizer (+ loss scaler), global parameter names, so
                               the same files load under any parallel layout (DCP reshards);
  ``meta.json``                step, data-loader position, resolved config, layout, world size;
  ``rng_rank{R}.pt``           each rank's CPU/CUDA RNG state (restored when the world size matches);
  ``manifest.json``            CRC32 and size of every file above — written last.

A save goes to ``.tmp-step_0000100`` and is renamed into place only once every rank has
written and the manifest is on disk, so a crash or kill during a save never touches the
previous checkpoint; a directory is valid only if its manifest's checksums match. Each step of a
save ends with the ranks sharing its outcome (``_agree``): a step that fails on one rank (a full
disk on one node, EIO from rank 0's rename) raises that rank's error on every rank, never leaves
the others waiting in a barrier.
``latest_valid`` finds the newest valid one for ``--resume auto``; the last K *valid* ones are kept
(``_prune``: a damaged or foreign folder never counts, nor is removed in place of a good one).

Asynchronous saves (``AsyncCheckpointer``, ``[train] async_checkpoint``): the training thread
blocks only to capture what is small or changes during forward/backward (RNG states, meta with
the loader position and step, the loss scaler, optimizer hyperparameters: plain Python values)
and to hand the state's tensors to a background thread. That thread copies them into host
buffers kept from save to save (pinned, on a side stream that first waits for the training
stream, where an accelerator exists) while the next step's forward and backward run: those
write only gradients, activations and MoE load counters, never a parameter, an optimizer state
or the router bias. The engine's next state-changing call (``Engine.step`` before the optimizer
and the router-bias update, ``load_state_dict``) waits for the copy (``wait_staged``, the
engine's ``before_update`` hook); the stall a save reports is the capture plus that wait.
Then the same thread runs the same ``_save`` as the synchronous path (DCP files, RNG, manifest
with CRC32, fsync, atomic rename, retention) over a dedicated gloo process group, so its
collectives never interleave with training's. Written here rather than with ``dcp.async_save``
because the manifest, the rename and retention must follow the DCP write inside the same
background job, and a failure must surface on every rank at the next collective point (next
save, suspend, end) as the sync path's ``CheckpointWriteError``. At most one save is in flight:
the next one waits.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import shutil
import sys
import warnings
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from luban.data.order import ORDER_ALLOWED, known_order
from luban.errors import CheckpointWriteError, LubanError, shown
from luban.config import MAX_SAMPLES, MAX_STEPS, check_resume
from luban.owned import STEP_DIR, step_dirs  # the checkpoint folders, newest first (torch-free: the launcher reads them too)

# DCP warns on every single-process save/load; that is the intended mode for one rank.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _quiet_dcp_records(record: logging.LogRecord) -> bool:
    """DCP logs, on the *root* logger and with a full traceback, each failed attempt to read a
    checkpoint's metadata (``state_dict_loader``: "Global metadata is not found..."); with no
    logging configured Python's last-resort handler prints them to stderr. luban turns the failed
    load into its own one-line error, so those records are dropped (the root logger only)."""
    return not (record.name == "root" and "torch/distributed/checkpoint" in record.pathname.replace("\\", "/"))


if _quiet_dcp_records not in logging.getLogger().filters:
    logging.getLogger().addFilter(_quiet_dcp_records)


def step_dir(root: Path, step: int) -> Path:
    """The folder of step ``step``'s checkpoint (the name ``luban.owned.STEP_DIR`` reads back)."""
    return root / f"step_{step:07d}"


CHUNK = 16 << 20


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


HOLD_ENV = "LUBAN_TEST_HOLD_CHECKPOINT_WRITE"  # tests only: a background write waits here (see _test_hold)
HOLD_STEP_ENV = "LUBAN_TEST_HOLD_CHECKPOINT_STEP"


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


def file_entries(ckpt: Path, names) -> dict:
    """``{name: {bytes, crc32}}`` of the files ``names`` in ``ckpt``, each fsynced first."""
    files = {}
    for name in names:
        with open(ckpt / name, "rb") as fh:
            os.fsync(fh.fileno())
        files[name] = {"bytes": (ckpt / name).stat().st_size, "crc32": file_crc32(ckpt / name)}
    return files


def _own_files(ckpt: Path, group=None) -> list[str]:
    """The files this rank wrote into ``ckpt``: its DCP data files (``__RANK_N.distcp``, RANK within the
    save's group) and its RNG state. Which they are only spreads the checksum reads over the ranks
    (``write_manifest`` reads any file no rank reported)."""
    mine = re.compile(rf"^__{dist.get_rank(group) if _is_dist() else 0}_\d+\.distcp$")
    return sorted(f.name for f in ckpt.iterdir() if mine.match(f.name) or f.name == f"rng_rank{_rank()}.pt")


def write_manifest(ckpt: Path, known: dict | None = None) -> None:
    """manifest.json: every file's size and CRC32; ``known``: the entries the ranks computed for the
    files they wrote (``_save``), so that one rank does not read the whole checkpoint back."""
    known = known or {}
    names = [f.name for f in sorted(ckpt.iterdir()) if f.is_file() and f.name != "manifest.json"]
    unreported = file_entries(ckpt, [n for n in names if n not in known])
    files = {n: known[n] if n in known else unreported[n] for n in names}
    tmp = ckpt / "manifest.json.tmp"
    tmp.write_text(json.dumps({"files": files}, indent=1))
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    tmp.rename(ckpt / "manifest.json")
    _fsync_dir(ckpt)


def verify(ckpt: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """``None`` if every file matches the manifest, else the reason it does not. ``share`` = (i, n): the
    CRC32 reads of the files whose place in the manifest's sorted names is i modulo n only (the sizes
    and the structure are checked whole): ``verify_everywhere`` gives each rank one share."""
    manifest = ckpt / "manifest.json"
    if not manifest.is_file():
        return "no manifest.json (save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
        if not isinstance(files, dict) or not all(
                isinstance(name, str) and "/" not in name and isinstance(e, dict)
                and isinstance(e.get("bytes"), int) and isinstance(e.get("crc32"), int) for name, e in files.items()):
            raise ValueError(files)
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return "manifest.json is not valid"
    for name in ("meta.json", ".metadata"):  # every checkpoint has them: a manifest without them is not one's
        if name not in files:
            return f"manifest.json does not list {name}"
    try:  # whatever the folder holds that a load would read must be covered by the manifest
        loadable = sorted(f.name for f in ckpt.iterdir() if _LOADABLE.match(f.name))
    except OSError as err:
        return f"the folder cannot be listed ({err.strerror or err})"
    for name in loadable:
        if name not in files:
            return f"manifest.json does not list {name}"
    if not any(name.endswith(".distcp") for name in files):
        return "manifest.json lists no .distcp file (the weights)"
    for place, (name, entry) in enumerate(sorted(files.items())):
        f = ckpt / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != entry["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, manifest says {entry['bytes']}"
        if place % share[1] == share[0] and file_crc32(f) != entry["crc32"]:
            return f"{name} fails its CRC32 check"
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except (OSError, ValueError, RecursionError) as err:
        return f"meta.json is not valid JSON ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
    problem = meta_problem(meta) or _step_problem(ckpt, meta)
    if problem:
        return problem
    for rank in range(meta["world_size"]):  # every rank of the run that wrote it saved its RNG state
        if f"rng_rank{rank}.pt" not in files:
            return f"manifest.json does not list rng_rank{rank}.pt (meta.json world_size = {meta['world_size']})"
    return None


# files a load reads: DCP's metadata and data files, the RNG states, meta.json
_LOADABLE = re.compile(r"^(meta\.json|\.metadata|.*\.distcp|rng_rank\d+\.pt)$")


def _step_problem(ckpt: Path, meta: dict) -> str | None:
    """A ``step_NNNNNNN`` folder's meta.json names that step (a folder of another name may hold any:
    a user's copy); one that names another was edited, and would resume at a step retention and
    ``--resume auto`` order by the folder's."""
    named = STEP_DIR.fullmatch(ckpt.name)
    if named and int(named.group(1)) != meta["step"]:
        return f"meta.json step = {meta['step']}: {int(named.group(1))}, the step its folder {ckpt.name} names (edited or damaged)"
    return None


def _whole(value, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def meta_problem(meta, training: bool = False) -> str | None:
    """``None`` if ``meta`` (a parsed meta.json) has the structure every reader relies on, else the
    first field that does not, as ``meta.json <field> = <value>: <what is allowed>``.

    Required: ``step`` (>= 0), ``config`` with a ``model`` table, ``world_size`` (>= 1); the rest
    (written by ``luban train``, absent from an imported checkpoint) must have its type when
    present. ``training``: ``luban train --resume`` also needs the loader position and ``[train]``,
    except from an imported checkpoint (``source``, no ``loader``: ``imported``), whose weights alone
    start a run."""
    if not isinstance(meta, dict):
        return f"meta.json = {shown(meta)}: a JSON object with step, config, world_size"
    training = training and not imported(meta)
    missing = object()

    def field(name, ok, allowed, required=False, where=meta, prefix=""):
        value = where.get(name, missing)
        if value is missing:
            return f"meta.json has no {prefix}{name}: {allowed}" if required else None
        return None if ok(value) else f"meta.json {prefix}{name} = {shown(value)}: {allowed}"

    table = lambda v: isinstance(v, dict)  # noqa: E731
    table_or_null = lambda v: v is None or isinstance(v, dict)  # noqa: E731
    checks = [
        field("step", lambda v: _whole(v, 0) and v <= MAX_STEPS, f"a whole number from 0 to {MAX_STEPS}", True),
        field("config", table, "a table with the run's [model] (and [train]) settings", True),
        field("world_size", lambda v: _whole(v, 1), "a whole number >= 1", True),
        field("loader", table, "a table with the data loader's position (consumed_samples)", training),
        field("layout", table, "a table (the parallel layout)"),
        field("dataset", lambda v: v is None or isinstance(v, str), "a path (text) or null"),
        field("dataset_checksum", lambda v: v is None or isinstance(v, str), "the dataset manifest's checksum (text) or null"),
        field("tokenizer", table_or_null, "a table (the tokenizer's identity) or null"),
        field("peak", table_or_null, "a table or null"),
        field("hf_extra", table_or_null, "a table or null"),
        field("source", lambda v: isinstance(v, str), "a path (text)"),
    ]
    problem = next((c for c in checks if c), None)
    if problem:
        return problem
    config = meta["config"]
    problem = (field("model", table, "a table (the model's settings)", True, config, "config.")
               or field("train", table, "a table (the [train] settings)", training, config, "config."))
    if problem:
        return problem
    if "loader" in meta:  # order_version: absent before order versions (version 1); resuming needs a known one
        return (field("consumed_samples", lambda v: _whole(v, 0) and v <= MAX_SAMPLES,
                      f"a whole number from 0 to {MAX_SAMPLES} (train.steps x train.global_batch at most)",
                      True, meta["loader"], "loader.")
                or (field("order_version", known_order, ORDER_ALLOWED, False, meta["loader"], "loader.")
                    if training else None))
    return None


def imported(meta: dict) -> bool:
    """A checkpoint ``luban import`` wrote (weights and model config, no optimizer, loader or
    [train]), as opposed to one a run saved."""
    return "source" in meta and "loader" not in meta


def read_meta(ckpt: Path, key: str, value: str, training: bool = False) -> dict:
    """meta.json of ``ckpt`` with its structure checked (``meta_problem``), else a one-line
    ``LubanError`` naming ``key = value`` (the flag or argument that named the checkpoint)."""
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise LubanError(f"{key} = {value!r}: meta.json cannot be read "
                         f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    problem = meta_problem(meta, training) or _step_problem(ckpt, meta)
    if problem:
        raise LubanError(f"{key} = {value!r}: {problem}")
    return meta


def verify_everywhere(ckpt: Path) -> str | None:
    """Collective where a process group exists: ``verify`` with the CRC32 reads split over the ranks
    (a resume of N ranks read the whole checkpoint N times: a 1 TB checkpoint on 64 ranks, 64 TB
    from the shared file system); every rank gets the same answer, the first rank's problem."""
    if not _is_dist():
        problem = verify(ckpt)
    else:
        try:  # every rank reaches the gather, whatever its share raised (one rank's error must not hang the rest)
            mine = verify(ckpt, share=(dist.get_rank(), dist.get_world_size()))
        except OSError as err:
            mine = f"a file cannot be read ({err.strerror or err})"
        answers = [None] * dist.get_world_size()
        dist.all_gather_object(answers, mine)
        problem = next((a for a in answers if a), None)
    if problem is None:
        _VERIFIED[_verified_key(ckpt)] = True  # retention need not read it again (_prune)
    return problem


def latest_valid(root: Path) -> Path | None:
    """Collective (``verify_everywhere``): the newest checkpoint under ``root`` that verifies."""
    for ckpt in step_dirs(root):
        problem = verify_everywhere(ckpt)
        if problem is None:
            return ckpt
        if _rank() == 0:
            print(f"luban: skipping checkpoint {ckpt}: {problem}", flush=True)
    return None


def resolve(resume: str, root: Path) -> Path | None:
    """``--resume``: ``auto`` (newest valid, or none), or a checkpoint directory. Collective where a
    process group exists (``verify_everywhere``)."""
    if resume == "auto":
        return latest_valid(root)
    try:
        check_resume(resume)
    except LubanError as err:
        raise everywhere(err) from None
    path = Path(resume)
    problem = verify_everywhere(path)
    if problem:
        raise everywhere(LubanError(f"--resume = {resume!r}: checkpoint is not valid: {problem}"))
    return path


def everywhere(err: LubanError) -> LubanError:
    """``err``, marked as raised alike on every rank (the shared file system's or a collective's
    answer): rank 0 alone prints it (``LubanError.everywhere``)."""
    err.everywhere = _is_dist()
    return err


_STORAGE = (OSError, dcp.api.CheckpointException)  # the storage's answer (CheckpointException: DCP's, per rank)


def save(root: Path, step: int, state: dict, meta: dict, keep: int) -> Path:
    """Collective: every rank calls it with its own ``state``; returns the final directory.

    A storage error (disk full, read-only, permission) is one line and exit code 74
    (``CheckpointWriteError``); the half-written ``.tmp-`` directory is removed and the previous
    checkpoint is untouched."""
    try:
        return _save(root, step, state, meta, keep, rng_state())
    except _STORAGE as err:
        raise _write_error(root, step, err) from None
    except KeyboardInterrupt:  # (one DCP wrapped as its error: ``_agree`` unwraps it; it was exit 74)
        _drop_tmp(root, step)
        raise


def _drop_tmp(root: Path, step: int) -> None:
    """Rank 0: the half-written folder of a save that failed goes."""
    if _rank() == 0:
        _remove_own(root / f".tmp-{step_dir(root, step).name}")


def _interrupted(err: BaseException) -> bool:
    """Whether ``err`` is a Ctrl-C's: one came (``luban.interrupt``: the native file writer turns the
    ``KeyboardInterrupt`` raised in its callback into "unexpected pos" RuntimeErrors, which DCP then
    wraps), or DCP's ``CheckpointException`` wraps one."""
    from luban import interrupt

    if interrupt.interrupted():
        return True
    failures = getattr(err, "failures", None)
    if not isinstance(err, dcp.api.CheckpointException) or not isinstance(failures, dict):
        return False
    found = [x for f in failures.values() for x in (f if isinstance(f, tuple) else (f,))]
    return any(isinstance(x, BaseException) and not isinstance(x, Exception) for x in found)


def _write_error(root: Path, step: int, err: BaseException) -> CheckpointWriteError:
    """The error every rank raises alike (``_agree``); rank 0 removes the half-written folder."""
    _drop_tmp(root, step)
    error = everywhere(CheckpointWriteError(
        f"checkpoint step {step} could not be written under {root}: {_storage_error(err)}; the previous "
        "checkpoint is intact — free space or fix the folder, then resume with --resume auto"))
    error.cause = _storage_error(err)  # for a caller whose remedy is another (``luban import``: import again)
    return error


def rng_state() -> dict:
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


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


# what a save writes into a checkpoint folder (DCP's data and metadata files, the RNG states, meta.json,
# the manifest; the test hook's marker): a folder holding anything else is not removed (_remove_own)
_WRITTEN = re.compile(r"^(meta\.json|manifest\.json|\.metadata|__\d+_\d+\.distcp|rng_rank\d+\.pt)(\.tmp.*)?$")


def _foreign(folder: Path) -> str | None:
    """The first entry of a checkpoint folder that no save writes (a user's file), else None."""
    try:
        return next((p.name for p in sorted(folder.iterdir()) if not (_WRITTEN.match(p.name) and p.is_file()
                                                                      and not p.is_symlink())), None)
    except OSError:
        return None


def _real_dir(path: Path) -> bool:
    """A folder, not a link to one: the only kind of entry under a run's checkpoints that luban moves or removes."""
    return path.is_dir() and not path.is_symlink()


REMOVING = ".removing-"  # a checkpoint folder being removed: hidden from step_dirs before its first file goes


def _remove_own(folder: Path) -> bool:
    """Remove a checkpoint folder luban wrote; one holding a file it did not write is kept (False).
    It is first renamed to ``.removing-NAME`` (atomic), so a kill -9 during the removal leaves no
    half-removed ``step_NNNNNNN`` (one without its manifest was no longer luban's to remove, and
    stayed for good) but a hidden folder the next save's ``_sweep`` finishes."""
    if not _real_dir(folder):
        return not os.path.lexists(folder)  # nothing there; a link or a file is not luban's folder
    if _foreign(folder) is not None:
        return False
    doomed = folder if folder.name.startswith(REMOVING) else folder.with_name(REMOVING + folder.name)
    if doomed != folder:
        try:
            _remove_own(doomed)  # one a killed removal left under that name
            folder.rename(doomed)
        except OSError:  # a foreign folder of that name, or a read-only root: removed where it is
            doomed = folder
    try:  # the manifest first: what a kill then leaves fails verification wherever it is
        (doomed / "manifest.json").unlink(missing_ok=True)
    except OSError:
        pass
    shutil.rmtree(doomed, ignore_errors=True)
    return True


# renameat2(2)'s RENAME_EXCHANGE (linux/fs.h; Linux 3.15, glibc 2.28): two paths swapped in one step
_RENAME_EXCHANGE, _AT_FDCWD = 2, -100
# this system or filesystem has none; EPERM: a seccomp filter that predates renameat2 (older
# container runtimes) answers so — treated as a filesystem without the swap (``_replace``'s fallback)
_NO_EXCHANGE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the folders ``a`` and ``b`` atomically; False (nothing moved) where the system cannot."""
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if call(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(b))


def _replace(tmp: Path, final: Path) -> None:
    """``tmp`` (a whole new checkpoint) becomes ``final``. A re-save of the same step swaps the two
    in one step (``_exchange``; the old one, now at ``tmp``, is then removed), so no kill leaves the
    step without its checkpoint. Where the filesystem cannot swap (NFS, FUSE), the step keeps the
    checkpoint it has if that one verifies (the same step of the same run: the state it holds is
    the one just saved again) and the new one goes; two renames, with a moment between them when
    the step has no checkpoint, only replace one that is damaged."""
    if not final.exists():
        tmp.rename(final)
    elif _exchange(tmp, final):
        _remove_own(tmp)
    elif _verifies(final):
        _remove_own(tmp)
    else:
        aside = final.with_name(REMOVING + final.name)
        final.rename(aside)
        try:
            tmp.rename(final)
        except OSError:
            aside.rename(final)  # the previous checkpoint back in its place (the save's error follows)
            raise


def _sweep(root: Path, final: Path) -> None:
    """What a killed save or removal left (rank 0, after ``final`` is in place): ``.removing-*``
    folders, and the ``.tmp-step_N`` of a save below ``final``'s step (saves run one at a time, so
    that one can only have been killed) — each only if it holds luban's files alone. A whole
    ``.tmp-step_N`` (its manifest written, killed before the rename) whose ``step_N`` is absent is
    kept: it is that step's only copy. ``--resume auto`` does not adopt it (it resumes from the
    newest ``step_*``); the resumed run's own save of step N replaces it."""
    below = int(STEP_DIR.match(final.name).group(1))
    for path in root.iterdir():
        removing = path.name.startswith(REMOVING)
        name = path.name.removeprefix(REMOVING)
        step = STEP_DIR.match(name.removeprefix(".tmp-")) if removing or name.startswith(".tmp-") else None
        if not (step and _real_dir(path) and (removing or int(step.group(1)) < below)):
            continue  # only the names luban gives (a user's ".removing-notes" stays)
        if not removing and (path / "manifest.json").is_file() and not (root / step.group(0)).exists():
            continue  # a save killed after its manifest, before its rename: whole, its step's only copy, kept
        _remove_own(path)


def _agree(group, part) -> list:
    """Run this rank's ``part`` of a save, then learn every rank's outcome (one collective, in place of
    a barrier); returns every rank's result, in rank order. A part that failed on one rank raises on
    every rank: a storage error (or a refusal of a user's file) as the first failing rank's, word for
    word, named with that rank; a bug as its own error where it happened, elsewhere as a
    ``RuntimeError`` naming it. A rank failing alone used to leave the others waiting in the save's
    next barrier until gloo's timeout (30 min) while it waited in its own next collective (async:
    ``wait``'s all-reduce): a hang, and the ranks that got out named another error."""
    err = value = None
    try:
        value = part()
    except BaseException as e:  # noqa: BLE001 - shared first (CheckpointException is a BaseException)
        err = KeyboardInterrupt() if _interrupted(e) else e
    if not _is_dist():
        if err is not None:
            raise err
        return [value]
    mine = None if err is None else _failure(err)
    told = [None] * dist.get_world_size(group)
    dist.all_gather_object(told, (value, mine), group=group)
    failures = [(rank, failure) for rank, (_, failure) in enumerate(told) if failure is not None]
    if not failures:
        return [result for result, _ in told]
    bugs = [(rank, failure) for rank, failure in failures if failure["kind"] == "bug"]
    if mine is not None and mine["kind"] == "bug":
        raise err  # a bug (or an interrupt), not the storage: its own traceback, here
    if bugs:
        rank, failure = bugs[0]
        raise RuntimeError(f"the checkpoint save failed on rank {rank}: {failure['text']}") from err
    rank, failure = failures[0]  # the first rank that failed speaks for all
    if failure["kind"] == "refused":  # a folder holding a user's file: the same refusal everywhere
        raise everywhere(CheckpointWriteError(failure["text"]))
    raise OSError(failure["errno"] or 0, f"{failure['text']} (rank {failure.get('rank', rank)})") from err


def _failure(err: BaseException) -> dict:
    """What the other ranks learn of this rank's failure (plain values: it is pickled to them)."""
    if isinstance(err, CheckpointWriteError):
        return {"kind": "refused", "text": str(err)}
    if isinstance(err, _STORAGE):
        failed = getattr(err, "failures", None)  # DCP names the ranks whose write failed
        where = {"rank": min(failed)} if isinstance(failed, dict) and failed else {}
        return {"kind": "storage", "errno": getattr(err, "errno", None), "text": _storage_error(err), **where}
    return {"kind": "bug", "text": f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"}


def _refuse_foreign(root: Path, step: int, folders: tuple[Path, ...]) -> None:
    """tmp (left by a save that was killed), final (re-saved) and aside: every rank looks before rank 0
    touches any, so all of them stop alike when one holds a file luban did not write, or is itself a
    file or a link (a re-save swapped a user's file named ``step_N`` into ``.tmp-step_N``, where it
    then failed every later save of that step with "File exists")."""
    def what(folder: Path) -> str | None:
        if folder.is_symlink():
            return "is a link"
        if os.path.lexists(folder) and not folder.is_dir():
            return "is a file"
        name = _foreign(folder)
        return None if name is None else f"holds {name!r}"

    foreign = next(((folder.name, found) for folder in folders if (found := what(folder)) is not None), None)
    if foreign is not None:
        raise CheckpointWriteError(f"checkpoint step {step} could not be written under {root}: {foreign[0]} "
                                   f"{foreign[1]}, which luban did not write; move it away, then resume with "
                                   "--resume auto (the previous checkpoint is intact)")


def _prepare(root: Path, tmp: Path, final: Path, aside: Path) -> None:
    """Rank 0, before any rank writes: an empty ``tmp``."""
    root.mkdir(parents=True, exist_ok=True)
    _remove_own(tmp)
    if final.exists():
        _remove_own(aside)  # a leftover of an earlier re-save: its step has a checkpoint
    tmp.mkdir()


def _publish(root: Path, tmp: Path, final: Path, meta: dict, known: list[dict], keep: int) -> None:
    """Rank 0, once every rank's files are written: manifest, rename into place, clean-up."""
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    write_manifest(tmp, {name: entry for entries in known for name, entry in entries.items()})
    _replace(tmp, final)  # a re-save of the same step (suspend right after a periodic save) too
    try:
        _fsync_dir(root)
    except OSError as err:
        raise OSError(err.errno, f"{err.strerror}, syncing the folder once {final.name} was in place (it may "
                                 "not survive a power loss)") from err
    _VERIFIED[_verified_key(final)] = True  # its CRC32s were just taken from what was written
    try:  # the checkpoint is saved: what fails now is the removal of older folders, not the save
        _sweep(root, final)
        _prune(root, final, keep)
    except OSError as err:
        print(f"luban: warning: checkpoint {final.name} is saved, but older checkpoints under {root} could "
              f"not be cleaned up ({_storage_error(err)}); the next save tries again", file=sys.stderr, flush=True)


def _save(root: Path, step: int, state: dict, meta: dict, keep: int, rng: dict, group=None,
          background: bool = False, failed: BaseException | None = None) -> Path:
    """Each step ends in ``_agree``: all ranks go on together, or all raise the same error.
    ``failed``: what went wrong on this rank before (the background copy), raised at the first step."""
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}"
    aside = final.with_name(REMOVING + final.name)  # where a re-save without an atomic swap moves the old one
    rank0 = _rank() == 0

    def look() -> None:
        if failed is not None:
            raise failed
        _refuse_foreign(root, step, (tmp, final, aside))

    def prepare() -> None:
        if rank0:
            _prepare(root, tmp, final, aside)

    def write() -> dict:
        dcp.save(state, checkpoint_id=str(tmp), process_group=group)
        torch.save(rng, tmp / f"rng_rank{_rank()}.pt")
        # each rank fsyncs and checksums the files it wrote (one rank read the whole checkpoint back
        # at every save); an fsync that fails fails the save: another rank's fsync cannot flush them
        return file_entries(tmp, _own_files(tmp, group))

    def publish() -> None:
        if background:
            _test_hold(tmp, step)
        if rank0:
            _publish(root, tmp, final, meta, known, keep)

    _agree(group, look)
    _agree(group, prepare)
    known = _agree(group, write)
    _agree(group, publish)
    return final


# (folder, its manifest's inode, size and mtime) -> whether ``verify`` passed: each checkpoint is read
# back at most once per process for retention (one this process wrote or resumed from: never)
_VERIFIED: dict[tuple, bool] = {}


def _verified_key(ckpt: Path) -> tuple:
    try:
        st = (ckpt / "manifest.json").stat()
        return str(ckpt.resolve()), st.st_ino, st.st_size, st.st_mtime_ns
    except OSError:
        return str(ckpt), None


def _verifies(ckpt: Path) -> bool:
    key = _verified_key(ckpt)
    if key not in _VERIFIED:
        try:
            _VERIFIED[key] = verify(ckpt) is None
        except OSError:
            _VERIFIED[key] = False
    return _VERIFIED[key]


def _prune(root: Path, final: Path, keep: int) -> None:
    """Retention (``train.keep_checkpoints`` = ``keep``): ``final``, just written, and the ``keep - 1``
    newest *valid* checkpoints older than it stay; of those older still, the ones luban wrote go.
    Only valid checkpoints count, so a damaged one (skipped by ``--resume auto``) or a user's empty
    ``step_NNNNNNN`` folder never makes the last good one go. A checkpoint numbered above ``final``
    (one ``--resume auto`` skipped as damaged, or a user's folder) is neither counted nor removed: a
    later save of that step replaces it only if luban wrote it (``_save``'s check). A folder without a
    manifest or holding a file a save never writes is not luban's checkpoint and stays; a damaged one
    between the kept ones stays too (the window moves past it as valid ones are written)."""
    number = lambda p: int(STEP_DIR.match(p.name).group(1))  # noqa: E731
    older = [p for p in step_dirs(root) if number(p) < number(final)]
    kept = 1
    for place, ckpt in enumerate(older):
        if kept >= max(keep, 1):
            for old in older[place:]:
                if (old / "manifest.json").is_file():
                    _remove_own(old)  # one holding a user's file is kept
            return
        kept += _verifies(ckpt)


def _test_hold(tmp: Path, step: int) -> None:
    """Test hook: with ``LUBAN_TEST_HOLD_CHECKPOINT_WRITE=DIR`` a background write (of step
    ``LUBAN_TEST_HOLD_CHECKPOINT_STEP`` only, if set), its DCP files on disk but no manifest yet,
    creates ``DIR/held`` and waits until ``DIR/release`` exists."""
    hold = os.environ.get(HOLD_ENV)
    if not hold or os.environ.get(HOLD_STEP_ENV, str(step)) != str(step):
        return
    (Path(hold) / "held").write_text(str(tmp))
    while not (Path(hold) / "release").exists():
        time.sleep(0.05)


@dataclass
class SaveRecord:
    """One save as metrics.jsonl reports it: ``stall_s`` training was blocked (for an asynchronous
    save: the capture plus the wait for the copy at the next state-changing call, that wait alone
    ``wait_s``), ``write_s`` the write took (for an asynchronous save: the background job, copy included)."""
    step: int
    stall_s: float
    write_s: float | None = None
    asynchronous: bool = False
    wait_s: float = 0.0

    def to_dict(self) -> dict:
        return {"step": self.step, "stall_s": self.stall_s, "wait_s": self.wait_s, "write_s": self.write_s,
                "async": self.asynchronous}


STAGE_DELAY_ENV = "LUBAN_TEST_SLOW_CHECKPOINT_STAGING"  # tests only: seconds the copy sleeps before starting


class HostStager:
    """Copies a state dict's tensors into host buffers kept from save to save.

    ``plan`` (training thread) builds the staged state dict: the same nesting, every tensor
    replaced by its host buffer (a DTensor by a DTensor over a host copy of its local shard),
    every other value deep-copied now; ``copy`` (any thread) fills the buffers. Buffers are
    reused while a tensor keeps its key, shape and dtype; the caller must not plan again before
    the previous copy and its write are done (``AsyncCheckpointer`` keeps one save in flight)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.stream = torch.cuda.Stream() if pin else None

    def plan(self, state: dict) -> tuple[dict, list[tuple[torch.Tensor, torch.Tensor]]]:
        import copy

        from torch.distributed.tensor import DTensor

        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        used: set[tuple] = set()

        def buffer(key: tuple, src: torch.Tensor) -> torch.Tensor:
            buf = self.buffers.get(key)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=self.pin)
                self.buffers[key] = buf
            used.add(key)
            pairs.append((buf, src.detach()))
            return buf

        def walk(key: tuple, value):
            if isinstance(value, DTensor):
                local = buffer(key, value.to_local())
                return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                          shape=value.shape, stride=value.stride())
            if isinstance(value, torch.Tensor):
                return buffer(key, value)
            if isinstance(value, dict):
                return {k: walk(key + (k,), v) for k, v in value.items()}
            if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
                return type(value)(walk(key + (i,), v) for i, v in enumerate(value))
            return copy.deepcopy(value)

        staged = walk((), state)
        for key in set(self.buffers) - used:  # tensors gone since the last save
            del self.buffers[key]
        return staged, pairs

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], ready=None) -> None:
        """Fill the buffers; on an accelerator, on the side stream after ``ready`` (an event recorded
        on the training stream at capture), and return once the copies are done."""
        if self.stream is None:
            with torch.no_grad():
                for dst, src in pairs:
                    dst.copy_(src)
            return
        with torch.no_grad(), torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        self.stream.synchronize()


class AsyncCheckpointer:
    """Saves in the background; ``save`` and ``wait`` are collective (all ranks call them at the same step).

    ``save`` waits for the previous save (at most one in flight), captures the small state and
    returns while a thread copies the tensors to host memory and then writes them. Before the
    state changes again (the next optimizer step), training calls ``wait_staged``. ``wait`` joins
    the write; a failed write raises ``CheckpointWriteError`` on every rank (the ranks agree
    through an all-reduce)."""

    def __init__(self, root: Path, keep: int):
        self.root, self.keep = root, keep
        self.stager = HostStager(pin=torch.cuda.is_available())
        # the writer's collectives go over their own group so they never interleave with training's
        self.group = dist.new_group(backend="gloo") if _is_dist() else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="luban-checkpoint")
        self.pending: tuple[Future, SaveRecord, Path] | None = None
        self.staging: tuple[threading.Event, SaveRecord] | None = None  # copy not yet waited for
        self.finished: list[SaveRecord] = []  # writes done, their records complete once staging was waited for
        self._lock = threading.Lock()

    def save(self, step: int, state: dict, meta: dict) -> SaveRecord:
        t0 = time.perf_counter()
        self.wait()
        staged, pairs = self.stager.plan(state)
        meta = json.loads(json.dumps(meta))  # now: the loader position and step go on changing
        rng = rng_state()
        ready = None
        if self.stager.stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
        record = SaveRecord(step, 0.0, asynchronous=True)
        copied = threading.Event()
        final = step_dir(self.root, step)
        self.pending = (self.pool.submit(self._job, step, staged, pairs, ready, copied, meta, rng, record),
                        record, final)
        self.staging = (copied, record)
        record.stall_s = time.perf_counter() - t0
        return record

    def _job(self, step, staged, pairs, ready, copied, meta, rng, record) -> Path:
        t0 = time.perf_counter()
        failed = None
        try:
            delay = float(os.environ.get(STAGE_DELAY_ENV, 0) or 0)
            if delay:
                time.sleep(delay)
            self.stager.copy(pairs, ready)
        except Exception as err:  # noqa: BLE001 - raised on every rank by _save's first step
            failed = err
        finally:
            copied.set()  # on failure too: training must not wait forever; the write below fails
        path = _save(self.root, step, staged, meta, self.keep, rng, self.group, background=True, failed=failed)
        record.write_s = time.perf_counter() - t0
        with self._lock:
            self.finished.append(record)
        return path

    def wait_staged(self) -> None:
        """Block until the save in flight has copied the state (call before changing it); the
        time blocked is added to that save's stall."""
        if self.staging is None:
            return
        copied, record = self.staging
        if not copied.is_set():
            t0 = time.perf_counter()
            copied.wait()
            waited = time.perf_counter() - t0
            record.stall_s += waited
            record.wait_s += waited
        self.staging = None

    def wait(self) -> Path | None:
        """Join the write in flight (if any); its directory, or ``CheckpointWriteError`` on every rank."""
        self.wait_staged()
        if self.pending is None:
            return None
        future, record, final = self.pending
        self.pending = None
        err = future.exception()
        failed = torch.tensor([int(err is not None)])
        if _is_dist():
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        if err is not None and not isinstance(err, _STORAGE):
            raise err
        if failed.item():
            raise _write_error(self.root, record.step, err or OSError(0, "the write failed on another rank"))
        return final

    def drain(self) -> list[SaveRecord]:
        """Writes finished since the last call whose stall is final (this rank's view; for metrics only)."""
        staging = self.staging[1] if self.staging is not None else None
        with self._lock:
            done = [r for r in self.finished if r is not staging]
            self.finished = [r for r in self.finished if r is staging]
        return done

    def close(self) -> None:
        """Without waiting for a write in flight (an error path); ``wait`` first to keep it."""
        self.pool.shutdown(wait=False)
        self.stager.buffers.clear()


def load(ckpt: Path, state: dict, key: str = "--resume", value: str | None = None, rng: bool = True) -> dict:
    """Collective: fill ``state`` (this rank's tensors, any layout) in place; return meta.json.

    RNG states come back (``rng``) when the checkpoint was written by the same world size. A checkpoint
    whose files cannot be read (damaged or foreign, whatever the library raises) is a one-line
    ``LubanError`` naming ``key = value`` (``value`` defaults to the folder)."""
    value = str(ckpt) if value is None else value
    meta = read_meta(ckpt, key, value)
    try:
        dcp.load(state, checkpoint_id=str(ckpt))
    except (Exception, dcp.api.CheckpointException) as err:  # noqa: BLE001 - CheckpointException is a BaseException
        raise LubanError(f"{key} = {value!r}: its weights and optimizer state cannot be read "
                         f"({_first_failure(err)})") from None
    world = dist.get_world_size() if _is_dist() else 1
    rng_file = ckpt / f"rng_rank{_rank()}.pt"
    if rng and meta.get("world_size") == world and rng_file.is_file():
        try:
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        except Exception as err:  # noqa: BLE001 - a damaged or foreign file: the unpickler raises anything
            raise LubanError(f"{key} = {value!r}: {rng_file.name} cannot be read as RNG states "
                             f"({_first_line(err)})") from None
    return meta


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0][:200] if text else type(err).__name__).replace("\n", " ")


def _first_failure(err: BaseException) -> str:
    """The first rank's own exception behind DCP's ``CheckpointException`` ("ranks: dict_keys([0])"
    says nothing), as ``TypeName: first line``."""
    failures = getattr(err, "failures", None)  # {rank: exception (or (exception, traceback))}
    for failure in (failures.values() if isinstance(failures, dict) else []):
        inner = next((x for x in (failure if isinstance(failure, tuple) else (failure,))
                      if isinstance(x, BaseException)), None)
        if inner is not None:
            err = inner
            break
    return f"{type(err).__name__}: {_first_line(err)}" if str(err).strip() else type(err).__name__
