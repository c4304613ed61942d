"""``luban data build``: tokenise documents into a few large packed shards per split.

Each input file is one document, tokenised and ended with the tokenizer's EOS id. Documents
are assigned to the validation split by a seeded permutation (``split_documents``), then
streamed into ``train-NNNNN.bin`` / ``val-NNNNN.bin`` shards of about ``shard_size_mb`` each
(a document is never split across shards).

A build is a transaction. Every argument and the destination are checked before anything is
written (a folder holding files luban did not write, a symbolic link, a mount point are refused,
untouched). The new dataset is built in a hidden sibling ``.NAME.building-PID`` (the old folder's
mode and group, its marker locked while the build runs) — shards, tokenizer, then the checksummed
manifest — and swapped in with one atomic ``renameat2(RENAME_EXCHANGE)``, after which the old
copy is deleted, manifest first and marker last. A kill at any moment therefore leaves, at NAME,
the old dataset or the new one, complete and verifiable; what a killed build left beside it (its
stage, the old copy it was deleting) is removed by the next build, once its PID is not running
here and its marker is not locked (a live build in another container or on another NFS client).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import math
import os
import re
import stat
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from luban import interrupt
from luban.data.atomic import _fsync_dir
from luban.data.corpus import (DEFAULT_MAX_BYTES, cap_files, collect_files,
                               default_corpus_files, file_size, read_text, stdlib_dir)
from luban.data.manifest import FORMAT, MANIFEST, SHARD_NAME, open_dataset, write_manifest
from luban.data.shards import (DEFAULT_CHUNK_TOKENS, FORMAT_VERSION, MAX_BUILD_CHUNK_TOKENS, ShardWriter,
                               dtype_for_vocab)
from luban.data.tokenizer import BPE_FILE, MAX_BPE_VOCAB, MIN_BPE_VOCAB, BpeTokenizer, ByteTokenizer
from luban import owned, schema
from luban.errors import LubanError, OutputWriteError, bad_value

SPLITS = ("train", "val")
MAX_SHARD_MB = 1 << 14  # 16 GiB per shard: far above any sensible size, far below int overflow
MAX_INPUT_BYTES = 1 << 50  # 1 PiB of text: a cap beyond any corpus one machine tokenises
DEFAULT_SHARD_MB = 256.0
DEFAULT_VAL_FRACTION = 0.01
DEFAULT_BPE_VOCAB = 4096
_ENCODE_BATCH_BYTES = 8 << 20


def split_documents(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of the validation documents.

    ``round(val_fraction * n_docs)`` documents, at least one when ``val_fraction > 0`` and at
    most ``n_docs - 1``, chosen as the first entries of ``default_rng(seed).permutation``.
    """
    n_val = round(val_fraction * n_docs)
    if val_fraction > 0:
        n_val = min(max(n_val, 1), n_docs - 1)
    is_val = np.zeros(n_docs, dtype=bool)
    is_val[np.random.default_rng(seed).permutation(n_docs)[:n_val]] = True
    return is_val


class _SplitWriter:
    """Rolls one split's documents over ``split-00000.bin``, ``split-00001.bin``, ..."""

    def __init__(self, out_dir: Path, split: str, dtype, shard_bytes: int, chunk_tokens: int):
        self.out_dir, self.split, self.dtype = out_dir, split, dtype
        self.shard_bytes, self.chunk_tokens = shard_bytes, chunk_tokens
        self.shards: list[dict] = []
        self._writer: ShardWriter | None = None

    def add_document(self, ids: np.ndarray) -> None:
        if self._writer is None:
            path = self.out_dir / f"{self.split}-{len(self.shards):05d}.bin"
            self._writer = ShardWriter(path, self.dtype, self.chunk_tokens)
        self._writer.add_document(ids)
        if self._writer.tokens * self.dtype.itemsize >= self.shard_bytes:
            self._commit()

    def _commit(self) -> None:
        self.shards.append(asdict(self._writer.close()))
        self._writer = None

    def close(self) -> dict:
        if self._writer is not None:
            self._commit()
        return {"tokens": sum(s["tokens"] for s in self.shards),
                "documents": sum(s["documents"] for s in self.shards), "shards": self.shards}

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()


OPTIONS = {  # build_dataset's options, declared once: `luban data build` takes the same as its flags
    "out": schema.path("new-dir"),
    "tokenizer": schema.choice("byte", "bpe"),
    "vocab_size": schema.integer(MIN_BPE_VOCAB, MAX_BPE_VOCAB),
    "shard_size_mb": schema.number(0, MAX_SHARD_MB, open_lo=True),
    "val_fraction": schema.number(0, 1, open_hi=True),
    "seed": schema.integer(*schema.SEED),
    "max_bytes": schema.integer(1, MAX_INPUT_BYTES),
    # not the 2**32 - 1 a shard's header can store (and a reader accepts): a chunk is read whole on its first
    # read, so a build makes none larger than MAX_BUILD_CHUNK_TOKENS (2**24 tokens, 32-64 MiB; shards.py says why)
    "chunk_tokens": schema.integer(1, MAX_BUILD_CHUNK_TOKENS),
}


def _check_options(**options) -> None:
    """Every argument, before anything on disk is touched."""
    for key, value in options.items():
        if value is not None:
            schema.check("--" + key.replace("_", "-"), value, OPTIONS[key])
    if options["vocab_size"] is not None and options["tokenizer"] != "bpe":
        raise bad_value("--vocab-size", options["vocab_size"], "only with --tokenizer bpe (byte has 257)")


# the temporaries luban writes into a dataset folder: ``AtomicFile``'s ``.NAME.tmp-PID`` of a dataset file, and
# ``owned.mark``'s ``.luban.tmp-PID``; a user's ``.notes.tmp-1`` is not one (a rebuild deleted it, to 2026-11-28)
TEMP_NAME = re.compile(r"\.(.+)\.tmp-\d+")


def dataset_file(path: Path) -> bool:
    """One of the files a luban dataset folder holds: manifest, tokenizer, shards, marker, and luban's own
    temporaries of those (``TEMP_NAME``); a file, by name (a user's folder named ``manifest.json`` is not
    luban's, nor what it holds)."""
    temp = TEMP_NAME.fullmatch(path.name)
    names = (temp.group(1), "." + temp.group(1)) if temp else (path.name,)  # ".luban.tmp-PID": the marker's
    return path.is_file() and any(n in (MANIFEST, BPE_FILE, owned.MARKER) or SHARD_NAME.match(n) for n in names)


def check_output(out_dir: Path) -> None:
    """Refuse a destination luban must not overwrite (``luban.owned``: absent, empty, or luban's own
    dataset); a dataset is replaced whole, so even luban's own folder must hold nothing else."""
    _check_swappable(out_dir)
    owned.check(out_dir, "dataset", "--out")
    _refuse_foreign(out_dir, "a rebuild replaces the dataset folder whole: move it out or choose a new or empty "
                             "folder (nothing was changed)")


def _foreign(folder: Path) -> list[str]:
    """The names in ``folder`` that are not a dataset's files (a user's), sorted; none for no folder."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if not dataset_file(p))


def _refuse_foreign(out_dir: Path, then: str) -> None:
    foreign = _foreign(out_dir)
    if foreign:
        raise bad_value("--out", str(out_dir), f"holds {foreign[0]!r}, which luban did not write; {then}")


def _check_swappable(out_dir: Path) -> None:
    """A build renames its stage onto ``out_dir`` (``_swap_in``), so ``out_dir`` must be a folder of its own
    name: not the current folder, ``..`` or ``/`` (no name to rename onto), not a symbolic link (the
    rename would replace the link, not the folder it points to), and not a mount point (a rename onto one
    fails EBUSY: it was a traceback after the whole build, 2026-11-28)."""
    if not str(out_dir).strip() or out_dir.name in ("", ".."):
        raise bad_value("--out", str(out_dir), "a folder for the dataset (not the current folder, '..' or '/')")
    if out_dir.is_symlink():
        raise bad_value("--out", str(out_dir), "a folder, not a symbolic link: name the folder it points to "
                                                "(nothing was changed)")
    if out_dir.is_dir() and _not_renamable(out_dir):
        raise bad_value("--out", str(out_dir), f"a folder this user may replace: it is another user's in "
                                                f"{str(out_dir.parent)!r}, a folder with the sticky bit (as /tmp), "
                                                "where only a folder's owner may rename it; ask its owner to rebuild "
                                                "it, or choose another folder (nothing was changed)")
    if out_dir.is_dir() and _is_mount_point(out_dir):
        raise bad_value("--out", str(out_dir), "a folder that is not a mount point: a build renames the new dataset "
                                                f"onto the folder's name; choose a folder inside it, e.g. "
                                                f"{str(out_dir / 'ds')!r} (nothing was changed)")


def _not_renamable(folder: Path) -> bool:
    """Whether the sticky bit of ``folder``'s parent keeps this user from renaming it (rename(2), EPERM: the
    parent is sticky and this user owns neither it nor the folder and is not root); it was a traceback after
    the whole build (2026-11-28)."""
    try:
        parent, own = folder.parent.stat(), folder.stat()
    except OSError:
        return False
    uid = os.geteuid()
    return bool(parent.st_mode & stat.S_ISVTX) and uid != 0 and uid not in (parent.st_uid, own.st_uid)


MOUNTINFO = Path("/proc/self/mountinfo")  # proc(5): field 5 is the mount point, with space, tab, newline, \\ as octal


def _is_mount_point(folder: Path) -> bool:
    """Whether ``folder`` is a mount point: ``os.path.ismount`` (another device than its parent), or, on Linux, a
    mount point of this process's mount table (a bind mount of a folder of the same file system, which
    ``ismount`` does not see)."""
    if os.path.ismount(folder):
        return True
    try:
        table = MOUNTINFO.read_bytes()
    except OSError:
        return False
    here = os.fsencode(os.path.realpath(folder))
    unescape = re.compile(rb"\\([0-7]{3})")
    return any(unescape.sub(lambda m: bytes([int(m.group(1), 8)]), line.split(b" ")[4]) == here
               for line in table.splitlines() if line.count(b" ") >= 4)


# the storage refused a write (full, over quota, read-only, failing, file too large): exit 74, not a traceback
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG)


def _inherit(stage: Path, out_dir: Path) -> None:
    """Give a new stage the mode and group of the folder it will replace (a team's setgid folder, a private 0700
    one), before any file is made in it, so its files get that group as they would in the old folder; a rebuild
    made it a plain 0755 folder of the builder's group (to 2026-11-28). The owner keeps full access to it."""
    try:
        old = out_dir.stat()
    except OSError:  # none yet: umask's mode
        return
    try:
        if old.st_gid != stage.stat().st_gid:
            os.chown(stage, -1, old.st_gid)
        os.chmod(stage, stat.S_IMODE(old.st_mode) | stat.S_IRWXU)
    except OSError:  # a group this user is not in: the new folder keeps the defaults
        pass


def _make_parents(folder: Path) -> list[Path]:
    """``folder.mkdir(parents=True, exist_ok=True)``; returns the folders it made, outermost first."""
    missing = []
    for f in (folder, *folder.parents):
        if os.path.lexists(f):
            break
        missing.append(f)
    folder.mkdir(parents=True, exist_ok=True)
    return missing[::-1]


def _unmake(made: list[Path]) -> None:
    """Remove the parent folders a failed build made (``_make_parents``), innermost first, each only if
    still empty: a refused or failed build leaves nothing behind (an empty ``a/b/`` stayed, to 2026-11-28)."""
    for f in reversed(made):
        try:
            f.rmdir()
        except OSError:  # something else was put there meanwhile: kept, as everything outside luban's
            return


def _staging(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.building-{os.getpid()}"


def _remove(stage: Path) -> None:
    """Delete a stage (``_delete``); a file a native call was still writing into it can make one pass fail."""
    for _ in range(3):
        try:
            if _delete(stage):
                return  # a user's files are in it: kept
        except OSError:
            pass
        if not os.path.lexists(stage):
            return


def _delete(folder: Path) -> list[str]:
    """Delete a dataset folder of luban's (a stage, a dead build's, the old copy a swap put aside) so that a
    kill part-way leaves one the next build still knows as luban's and removes (``_dead_siblings``): marked
    first (an old copy built before the marker), then the manifest (a part-deleted copy is never taken for a
    complete one by ``recover``), the other files, the marker last. ``shutil.rmtree`` deleted in the
    directory's order: a kill after the marker and the manifest were gone left the shards, and no later
    build removed them (2026-11-28). Only a dataset's files go (``dataset_file``): what else is there (a
    user's file put into ``--out`` while a rebuild ran, 2026-12-03: deleted with the old copy) stays, with
    the folder; returns its names."""
    try:
        owned.mark(folder, "dataset")
    except OSError:  # a full disk: deleted unmarked (a stage is marked first thing, so only an old copy)
        pass
    (folder / MANIFEST).unlink(missing_ok=True)
    kept = []
    with os.scandir(folder) as entries:
        for entry in list(entries):
            if entry.name == owned.MARKER:
                continue
            if dataset_file(Path(entry.path)):
                os.unlink(entry.path)
            else:
                kept.append(entry.name)
    (folder / owned.MARKER).unlink(missing_ok=True)
    if not kept:
        os.rmdir(folder)
    return sorted(kept)


def _swap_in(staging: Path, out_dir: Path) -> None:
    """Make ``staging`` the dataset at ``out_dir`` in one step: rename when there is none, else
    exchange the two paths atomically (Linux renameat2 RENAME_EXCHANGE) and delete the old one.
    A kill at any moment leaves the old dataset or the new one at ``out_dir``, never neither. A file
    of the user's that appeared in ``out_dir`` during the build refuses the swap (exit 2, the new
    dataset is not kept); one that appears in the instant before the swap stays in the old copy's
    folder, which is then kept as ``NAME.kept-TIME`` beside it and named in a warning."""
    _refuse_foreign(out_dir, "it appeared during the build: the new dataset was not swapped in; move it out, "
                             "then build again (the dataset already there is kept)")
    if not out_dir.exists():
        try:
            os.rename(staging, out_dir)
            _fsync_dir(out_dir.parent)
            return
        except OSError as err:  # a build racing this one swapped its dataset in meanwhile: replace it
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    if _exchange(staging, out_dir):
        old = staging  # now the old dataset
    else:  # no renameat2: two renames; recover() finds the new one if a crash falls between
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.rename(out_dir, old)
        os.rename(staging, out_dir)
    kept = _delete(old)
    if kept:  # under a name of its own, in sight: a hidden stage name is the next build's of that PID
        aside = _free_name(out_dir.parent, f"{out_dir.name}.kept-{time.strftime('%Y%m%d-%H%M%S')}")
        os.rename(old, aside)
        print(f"luban: warning: --out = {str(out_dir)!r}: {kept[0]!r}, which luban did not write, appeared in it "
              f"during the build; it is kept in {str(aside)!r}", file=sys.stderr, flush=True)
    _fsync_dir(out_dir.parent)


def _free_name(parent: Path, name: str) -> Path:
    """``parent / name``, or ``name~2``, ``name~3``, ... : the first that does not exist."""
    path, k = parent / name, 2
    while os.path.lexists(path):
        path, k = parent / f"{name}~{k}", k + 1
    return path


def _exchange(a: Path, b: Path) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _dead_siblings(out_dir: Path) -> list[Path]:
    """The staging (``.NAME.building-PID``) and swapped-out (``.NAME.old-PID``) folders of builds
    of ``out_dir`` that died: by name, and only if luban's by content (marked as a dataset, or empty: a
    build killed between its mkdir and its marker). A user's folder of the same name is not luban's; a
    live build's stage is its own, even once complete (it is about to be swapped in)."""
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.(building|old)-\d+")
    try:
        found = [p for p in out_dir.parent.iterdir() if pattern.fullmatch(p.name)]
    except OSError:
        return []
    return [p for p in found if p.is_dir() and not p.is_symlink()
            and owned.owner(p) in ("empty", "dataset")
            and _ended(int(p.name.rsplit("-", 1)[-1])) and not _held(p)]


def _ended(pid: int) -> bool:
    """Whether the build of process ``pid`` is over: no such process, or this one (which has no stage yet:
    one by its PID is a dead process's whose PID it was given)."""
    return pid == os.getpid() or not Path(f"/proc/{pid}").exists()


def _hold(stage: Path) -> int:
    """Lock the stage's marker for as long as this build runs (``flock``, which the kernel gives back when the
    process dies). A build in another PID namespace (a container), or on another machine over NFS, is not in
    this machine's /proc: its live stage was removed from under it, a traceback (2026-11-28). Returns the fd."""
    fd = os.open(stage / owned.MARKER, os.O_RDWR)  # written: NFS locks a file exclusively only when open for writing
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:  # no locks here (ENOLCK: NFS mounted nolock): the stage is known live by its PID alone
        pass
    return fd


def _held(stage: Path) -> bool:
    """Whether a live build holds ``stage``'s marker locked (``_hold``); a marker that cannot be opened or locked
    for another reason counts as held (nothing is removed that is not shown dead); no marker: not held."""
    try:
        fd = os.open(stage / owned.MARKER, os.O_RDWR if os.access(stage / owned.MARKER, os.W_OK) else os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


# what a build racing this one into the same folder leaves: a sibling it removed, an out_dir it put back
RACED_ERRNOS = (errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY)


def _age(sibling: Path) -> float:
    """A sibling's modification time; one that a build racing this one removed meanwhile is the oldest."""
    try:
        return sibling.stat().st_mtime
    except FileNotFoundError:
        return -math.inf


def recover(out_dir: Path) -> None:
    """After a crash between the two renames of the fallback swap, put the newest complete copy
    back at ``out_dir``; remove staging folders of builds that died (luban's own: ``_dead_siblings``)."""
    siblings = sorted(_dead_siblings(out_dir), key=_age)
    for sibling in reversed(siblings):
        if not out_dir.exists() and (sibling / MANIFEST).is_file():
            try:
                os.rename(sibling, out_dir)
            except OSError as err:
                if err.errno not in RACED_ERRNOS:
                    raise
    for sibling in _dead_siblings(out_dir):
        _remove(sibling)


def build_dataset(inputs=None, out_dir=".", *, tokenizer: str = "byte",
                  vocab_size: int | None = None, shard_size_mb: float = DEFAULT_SHARD_MB,
                  val_fraction: float = DEFAULT_VAL_FRACTION, seed: int = 0,
                  max_bytes: int | None = None,
                  chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> dict:
    """Tokenise ``inputs`` (files/folders; None or empty: the default corpus) into ``out_dir``.

    ``max_bytes`` caps the input (default: ``DEFAULT_MAX_BYTES`` for the default corpus,
    unlimited for explicit inputs). Returns the manifest that was written.
    """
    _check_options(out=str(out_dir), tokenizer=tokenizer, vocab_size=vocab_size, shard_size_mb=shard_size_mb, val_fraction=val_fraction,
                   seed=seed, max_bytes=max_bytes, chunk_tokens=chunk_tokens)
    final_dir = Path(out_dir)
    check_output(final_dir)
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if inputs:
        files = cap_files(collect_files(inputs, exclude=final_dir), max_bytes)
        source = {"kind": "files", "max_bytes": max_bytes}
    else:
        max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
        files = default_corpus_files(max_bytes)
        source = {"kind": "default-corpus", "root": str(stdlib_dir()), "max_bytes": max_bytes}
    source.update(files=len(files), bytes=sum(file_size(f) for f in files))
    recover(final_dir) if final_dir.parent.is_dir() else None  # luban's own copies only: checked or not
    out_dir = _staging(final_dir)  # everything is written here, then swapped in (_swap_in)
    made: list[Path] = []  # the parent folders this build made: removed again if it fails
    try:  # root passes os.access everywhere: /proc/x is refused only here
        made = _make_parents(final_dir.parent)
        out_dir.mkdir()  # exists: a folder of that name recover() did not remove is not luban's
        _inherit(out_dir, final_dir)
    except OSError as err:
        _unmake(made)
        if err.errno == errno.ENAMETOOLONG and len(os.fsencode(final_dir.name)) < len(os.fsencode(out_dir.name)):
            raise bad_value("--out", str(final_dir), "a shorter folder name: a build stages the dataset beside it as "
                                                      f"'.NAME.building-PID', here {len(os.fsencode(out_dir.name))} "
                                                      "bytes, which is too long for the file system (nothing was "
                                                      "changed)") from None
        if final_dir.is_dir() and err.errno in (errno.EACCES, errno.EPERM):  # writable itself, its parent not
            raise bad_value("--out", str(final_dir), f"a folder in a writable folder: a build stages the dataset beside "
                                                      f"it, in {str(final_dir.parent)!r}, then renames it into place "
                                                      f"({err.strerror}); choose a folder inside it, e.g. "
                                                      f"{str(final_dir / 'ds')!r} (nothing was changed)") from None
        raise bad_value("--out", str(final_dir), f"{OPTIONS['out'].allowed} ({err.strerror})") from None
    stage, lock = out_dir, None
    # a forced exit (luban.interrupt) removes the stage, also one that comes while this except removes it
    with interrupt.on_abort(lambda: _remove(stage)):
        try:  # Ctrl-C: this except removes the stage
            owned.mark(out_dir, "dataset")
            lock = _hold(out_dir)
            manifest = _build_into(out_dir, files, source, tokenizer, vocab_size, shard_size_mb, val_fraction,
                                   seed, chunk_tokens)
            with interrupt.critical():
                _swap_in(out_dir, final_dir)
        except BaseException as err:
            _remove(out_dir)
            _unmake(made)
            if isinstance(err, OSError) and err.errno in STORAGE_ERRNOS:
                raise OutputWriteError(f"--out = {str(final_dir)!r}: the dataset could not be written "
                                       f"({err.strerror}); free space or choose another folder (a dataset already "
                                       "there is kept)") from None
            raise
        finally:
            if lock is not None:
                os.close(lock)
    return manifest


def _build_into(out_dir: Path, files, source, tokenizer, vocab_size, shard_size_mb, val_fraction, seed,
                chunk_tokens) -> dict:
    is_val = split_documents(len(files), val_fraction, seed)
    if tokenizer == "bpe":
        train_texts = (read_text(f) for f, val in zip(files, is_val) if not val)
        tok = BpeTokenizer.train(train_texts, vocab_size or DEFAULT_BPE_VOCAB)
        tok.save(out_dir / BPE_FILE)
    else:
        tok = ByteTokenizer()
    dtype = dtype_for_vocab(tok.vocab_size)
    shard_bytes = int(shard_size_mb * (1 << 20))
    writers = {s: _SplitWriter(out_dir, s, dtype, shard_bytes, chunk_tokens) for s in SPLITS}
    try:
        for batch in _batches(files):
            try:
                texts = [read_text(files[i]) for i in batch]
                for i, ids in zip(batch, tok.encode_batch(texts)):
                    writers["val" if is_val[i] else "train"].add_document(_document(ids, tok.eos_id, dtype))
            except MemoryError:
                texts = None  # what it held goes before the message is made
                raise _too_big(max((files[i] for i in batch), key=file_size)) from None
        splits = {s: w.close() for s, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "dtype": dtype.name,
        "chunk_tokens": chunk_tokens, "tokenizer": tok.manifest_entry(), "source": source,
        "val_fraction": val_fraction, "seed": seed, "splits": splits,
    }
    return write_manifest(out_dir, manifest)


def _too_big(path: Path) -> LubanError:
    """A document that does not fit in this machine's memory (each file is one document, read and
    tokenised whole: several times its size at the peak). A tokenizer's native code that runs out
    aborts the process instead, which no message can follow."""
    return bad_value("INPUTS", str(path), f"a file this machine can tokenise ({file_size(path)} bytes ran out of "
                                          "memory: each file is one document, read and tokenised whole); split it "
                                          "into smaller files (the dataset already there is kept)")


def _document(ids: np.ndarray, eos_id: int, dtype: np.dtype) -> np.ndarray:
    """A document's ids then its end-of-document id, in the shard's token type: a 2 GB line is 4 GB of
    uint16 here, not the 16 GB of int64 that ``np.append`` made of it."""
    doc = np.empty(len(ids) + 1, dtype)
    doc[:-1] = ids
    doc[-1] = eos_id
    return doc


def _batches(files: list[Path]):
    """Yield lists of file indices of about ``_ENCODE_BATCH_BYTES`` each (for encode_batch)."""
    batch, size = [], 0
    for i, path in enumerate(files):
        batch.append(i)
        size += file_size(path)
        if size >= _ENCODE_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def ensure_default_dataset(out_dir, tokenizer: str = "byte",
                           max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Build the default corpus into ``out_dir`` unless a valid build of it is already there.

    "Valid" means the manifest loads, names the same tokenizer kind and corpus cap, and every
    shard passes the open-time checks (size, header CRC, chunk-CRC table CRC; format version 1: the
    index CRC). Concurrent callers (for
    example several ranks) serialise on a lock file, so only one of them builds.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:  # beside it: the build swaps the folder
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            manifest, _ = open_dataset(out_dir)
            source = manifest.get("source", {})
            if (manifest["tokenizer"]["kind"] == tokenizer and source.get("kind") == "default-corpus"
                    and source.get("max_bytes") == max_bytes):
                return out_dir
        except LubanError:
            pass  # an unusable copy is rebuilt (swapped in whole) if it is luban's own (check_output)
        build_dataset(None, out_dir, tokenizer=tokenizer, max_bytes=max_bytes)
    return out_dir
