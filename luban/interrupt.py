"""Ctrl-C and closed pipes for every ``luban`` command but ``train``/``demo`` (those suspend
instead: ``luban.train.preempt``).

- **Ctrl-C** (SIGINT): the first one raises ``KeyboardInterrupt`` in the main thread, which
  unwinds through the commands' own clean-up (a data build removes its hidden stage, a probe
  kills its worker processes) to ``luban.cli.main``: one line, ``luban: interrupted``, exit 130.
  Python runs a signal handler only between bytecodes, so a long native call (a BPE
  ``encode_batch`` in Rust, a torch kernel) would delay that by seconds. A watchdog thread
  therefore hears every SIGINT at once through ``signal.set_wakeup_fd``; if the process has not
  ended ``GRACE_S`` after the first (or at a second Ctrl-C), it runs the clean-ups registered
  with ``on_abort`` itself, prints the same line and ends the process with ``os._exit(130)``.
  ``critical()`` marks a step that must not be cut (an atomic swap): the watchdog waits for it.
- **Closed stdout** (``luban jobs | head -1``): the write raises ``BrokenPipeError``;
  ``luban.cli.main`` points stdout at /dev/null (so the interpreter's last flush cannot fail
  again) and exits ``EXIT_PIPE`` (141, as a process killed by SIGPIPE reads in a shell), quietly.
- **SIGTERM** keeps its default action (the process ends), except inside ``sigterm_unwinds()``: a
  start-up that must not leave half a state behind (``cluster serve``) unwinds through its clean-up.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import threading
import time

from luban.errors import EXIT_INTERRUPTED

EXIT_PIPE = 128 + int(signal.SIGPIPE)
GRACE_S = 0.5
MESSAGE = "luban: interrupted\n"


class _State:
    def __init__(self):
        self.installed = False
        self.interrupted_at: float | None = None
        self.code: int | None = None  # the command's exit code, once decided
        self.announced = False
        self.lock = threading.Lock()
        self.cleanups: dict[int, object] = {}
        self.ids = itertools.count()
        self.critical = 0
        self.quiet = threading.Condition(self.lock)
        self.pending = False  # a Ctrl-C that came during a critical step, raised at its end
        self.own = 0  # inside own_handling(): the code there answers Ctrl-C itself


_STATE = _State()


def install(early: bool = False) -> None:
    """Take over SIGINT for this process (once, from the main thread, at process entry); ``early``:
    a Ctrl-C came before (``luban.cli`` records those), answered now. An inherited SIG_IGN (a
    background job of a non-interactive shell) is kept."""
    if _STATE.installed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(read), os.close(write)
        return
    _STATE.installed = True
    threading.Thread(target=_watch, args=(read,), name="luban-interrupt", daemon=True).start()
    signal.signal(signal.SIGINT, _on_sigint)
    if early:
        _STATE.interrupted_at = time.monotonic()
        raise KeyboardInterrupt


def _on_sigint(signum, frame):
    if _STATE.interrupted_at is not None or _STATE.code is not None:
        return  # the watchdog handles the rest
    _STATE.interrupted_at = time.monotonic()
    if _STATE.critical:
        _STATE.pending = True
        return
    raise KeyboardInterrupt


def _watch(fd: int) -> None:
    import select

    sigints, deadline = 0, None
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([fd], [], [], timeout)
        if ready:
            data = os.read(fd, 512)
            count = data.count(bytes([signal.SIGINT]))
            if not count:
                continue
            if _STATE.own:
                continue
            sigints += count
            if _STATE.code is not None:  # finished: exit with what was decided, at once
                os._exit(_STATE.code)
            deadline = time.monotonic() + GRACE_S if sigints == 1 else time.monotonic()
            if sigints == 1:
                continue
        if deadline is not None and time.monotonic() >= deadline:
            _abort()


def _abort() -> None:
    """Run the clean-ups, say so once, and end the process (from the watchdog thread)."""
    with _STATE.lock:
        end = time.monotonic() + 10.0  # a critical step is short (a rename); never wait forever
        while _STATE.critical and time.monotonic() < end:
            _STATE.quiet.wait(0.05)
        cleanups = list(_STATE.cleanups.values())
        _STATE.cleanups.clear()
    for cleanup in reversed(cleanups):
        with contextlib.suppress(BaseException):
            cleanup()
    code = _STATE.code if _STATE.code is not None else EXIT_INTERRUPTED
    if code == EXIT_INTERRUPTED:
        announce()
    os._exit(code)


def announce() -> None:
    """Print the one line (at most once, from whichever thread gets there first)."""
    with _STATE.lock:
        if _STATE.announced:
            return
        _STATE.announced = True
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.write(2, MESSAGE.encode())


def interrupted() -> bool:
    """Whether a Ctrl-C has come (also one that a library caught and answered itself)."""
    return _STATE.interrupted_at is not None


@contextlib.contextmanager
def own_handling():
    """A block that answers Ctrl-C itself (uvicorn's graceful shutdown in ``cluster serve``): the
    watchdog leaves it alone; afterwards a Ctrl-C it swallowed ends the command as usual."""
    _STATE.own += 1
    try:
        yield
    finally:
        _STATE.own -= 1
    if interrupted():
        raise KeyboardInterrupt


def leave(code: int) -> None:
    """End the process now with ``code``: stdio flushed, the clean-ups already done by the
    unwinding, no interpreter teardown (with torch loaded it takes seconds, during which this
    module's watchdog cannot run)."""
    _STATE.code = code
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def finished(code: int) -> None:
    """The command's exit code is decided: a later Ctrl-C changes nothing (ignored, as
    ``luban.train.preempt.settle`` does; SIG_IGN outlives the interpreter's teardown, where a
    Python handler would be reset to the default action and kill the finished process)."""
    _STATE.code = code
    if _STATE.installed:
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def on_abort(cleanup):
    """Within the block, a forced exit (``_abort``) runs ``cleanup()`` first. The block's own
    ``except``/``finally`` clean-up covers the ordinary ``KeyboardInterrupt``."""
    key = next(_STATE.ids)
    with _STATE.lock:
        _STATE.cleanups[key] = cleanup
    try:
        yield
    finally:
        with _STATE.lock:
            _STATE.cleanups.pop(key, None)


@contextlib.contextmanager
def critical():
    """A step a forced exit must not cut in two: the watchdog waits until it is done."""
    with _STATE.lock:
        _STATE.critical += 1
    try:
        yield
    finally:
        with _STATE.lock:
            _STATE.critical -= 1
            _STATE.quiet.notify_all()
            raise_now = _STATE.pending and not _STATE.critical
            _STATE.pending = _STATE.pending and not raise_now
    if raise_now:
        raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_unwinds():
    """Within the block (the main thread), SIGTERM raises ``SystemExit(143)`` instead of ending the process
    at once, so the block's own ``except``/``finally`` clean-up runs (``cluster serve``'s start-up removes a
    state folder it made but did not finish); afterwards the handler before it is back. 143 = 128 + SIGTERM,
    what a shell reads for a process SIGTERM ended."""
    def _raise(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not cut the clean-up
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def quiet(stream=None) -> None:
    """After a closed pipe: ``stream`` (stdout by default; the metrics stream, which may be stderr) goes to /dev/null so nothing can fail to flush again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, (stream or sys.stdout).fileno())
        os.close(devnull)
