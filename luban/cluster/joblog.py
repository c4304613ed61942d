"""A job's log, capped: the launcher reads the job's output through a pipe and writes at most
``cap`` bytes into the rank's log file (all attempts of the chain together), then one line saying
the log was cut, and drops the rest while still reading it — the job never blocks on a full pipe
and never gets SIGPIPE. Logs live in the service's state folder, beside its SQLite database: one
job flooding its output must not fill the disk under the service. The job's own files
(checkpoints) are not touched by the cap (no RLIMIT_FSIZE).
"""

from __future__ import annotations

import os
import threading

MAX_LOG = 1 << 30     # bytes of one rank's log (all attempts of its chain; `cluster serve --max-log`): far more than a
                      # training run prints, small beside a checkpoint; past it a flooding job cannot fill the state disk
MIN_LOG = 1024        # the smallest --max-log: room for luban's own start line and the cut line
READ_CHUNK = 1 << 16  # bytes read from the job's pipe at once: Linux's default pipe capacity
DRAIN_GRACE_S = 5.0   # seconds the launcher waits, once every process of the job is killed, for the pipe's last
                      # bytes; a process that could not be killed may hold it open forever (the launcher then goes on)


def cut_char(data: bytes) -> int:
    """How many bytes at the end of ``data`` begin a UTF-8 character that ends beyond it (0 to 3): a log
    read in chunks decodes each whole character once (cut, both halves were U+FFFD: CJK text garbled
    at every 1 MiB, and wherever ``luban logs -f`` read while the job was writing)."""
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the character's first
            need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
            return back if need > back else 0
    return 0


def cut_line(cap: int) -> bytes:
    """The one line that says the rest of the job's output was dropped."""
    return (f"== luban: log cut at {cap} bytes (cluster serve --max-log): the rest of this rank's output "
            "is dropped ==\n").encode()


class Pump:
    """Copies the job's output from ``read_fd`` into ``log`` (an unbuffered file opened for append)
    until every writer has closed the pipe, keeping the log at most ``cap`` bytes of output."""

    def __init__(self, read_fd: int, log, cap: int):
        self.read_fd, self.log, self.cap = read_fd, log, cap
        self.room = cap - os.fstat(log.fileno()).st_size  # the chain's earlier attempts count
        self.last = b"\n"  # the last byte written: the cut line starts a line of its own
        self.cut = False
        self._thread = threading.Thread(target=self._run, name="luban-log", daemon=True)

    def start(self) -> "Pump":
        self._thread.start()
        return self

    def join(self, timeout: float = DRAIN_GRACE_S) -> None:
        """Wait (bounded) for the pipe's end: the job's last output goes before the launcher's last line."""
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while data := os.read(self.read_fd, READ_CHUNK):
                self.take(data)
        except OSError:
            pass  # the log's file system failed: nothing more can be kept; the pipe closes with the launcher
        finally:
            os.close(self.read_fd)

    def take(self, data: bytes) -> None:
        """Write what fits under the cap; at the first byte past it, the cut line; later bytes: dropped."""
        if self.cut:
            return
        keep = data if len(data) <= self.room else data[:max(0, self.room)]
        if len(keep) < len(data):
            keep = keep[:len(keep) - cut_char(keep)]  # whole characters only: the cut line follows
        if keep:
            self._write(keep)
            self.room -= len(keep)
            self.last = keep[-1:]
        if len(keep) < len(data):
            self.cut = True
            self._write((b"" if self.last == b"\n" else b"\n") + cut_line(self.cap))

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[self.log.write(view):]
