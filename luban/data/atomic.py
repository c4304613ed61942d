"""Crash-safe file writes: write a hidden temp file next to the target, fsync, then rename.

A reader therefore sees either the old file or the complete new one, never half a file; a
crash leaves at most a hidden ``.NAME.tmp-PID`` file, which no manifest names.
"""

from __future__ import annotations

import os
from pathlib import Path

TEMP_GLOB = ".*.tmp-*"


class AtomicFile:
    """A binary file that appears under ``path`` only when ``commit()`` is called."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.temp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.file = open(self.temp, "wb")

    def commit(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.temp, self.path)
        _fsync_dir(self.path.parent)

    def abort(self) -> None:
        self.file.close()
        self.temp.unlink(missing_ok=True)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.commit()
        except BaseException:  # a full disk at the fsync, a Ctrl-C inside it: no temp left behind
            self.abort()
            raise


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Atomically replace ``path`` with ``data``."""
    with AtomicFile(path) as out:
        out.file.write(data)


def create_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Atomically create ``path`` with ``data``; ``FileExistsError`` if anything is there already:
    a user's file is never replaced. The complete, fsynced temp file (``AtomicFile``'s hidden
    name) is hard-linked into place, which fails on an existing name, then its temp name is
    removed. Where the filesystem has no hard links, an exclusive create of the final name stands
    in (a crash may then leave it partial)."""
    path = Path(path)
    staged = AtomicFile(path)
    try:
        staged.file.write(data)
        staged.file.flush()
        os.fsync(staged.file.fileno())
        staged.file.close()
        try:
            os.link(staged.temp, path)
        except FileExistsError:
            raise
        except OSError:  # no hard links here (some FUSE and SMB mounts)
            with open(path, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    finally:
        staged.abort()  # closes (again: a no-op) and removes the temp name
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
