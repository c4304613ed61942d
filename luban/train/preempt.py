"""Preemption: turn SIGUSR1/SIGTERM/SIGINT into "finish this step, checkpoint, exit 75".

The HAI platform's contract (seed 000): the scheduler signals a job, the job saves a
checkpoint and exits, and is resumed later. The first SIGUSR1, SIGTERM or SIGINT sets a flag
that the trainer checks after each step; a second SIGINT exits at once with code 130.
Ranks agree through an all-reduce (MAX), so every rank saves the same step. It runs on the host
(``any_rank``: a CPU tensor over a gloo group, made once beside an NCCL one), never on the GPU:
an NCCL all-reduce and ``.item()`` every step waited for the GPU to finish the step, so the host
could not queue the next step's kernels while it ran.

The handlers are installed by ``install()`` as the first thing ``python -m luban train`` does
(``luban/__main__.py``), before torch is imported, and ``parallel.launch`` starts ranks with
these signals blocked until then: a signal at any moment of start-up is recorded, never the
default action that would kill a rank (rc -10) or a launcher without its ranks. A signal that
arrives before the first step ends the run with 75 and nothing new to save: at the first step's
check, or ``START_GRACE_S`` after the signal if the start-up is still running then (the process
ends itself: a start-up of minutes kept a ``timeout`` or a ``kill`` waiting). Once the command has
its exit code, ``settle()`` ignores the signals: CPython's finalisation puts Python-level handlers
back to the default action, so a SIGUSR1 landing while a finished rank shuts down (seconds with
torch) would otherwise kill it (rc -10, reported as 138) after it had saved and finished.
``leave()`` then ends the process without C++ static destructors: with torch loaded, those tear
down gloo/store threads that are still joinable and abort (std::terminate, rc 134), even after
``destroy_process_group`` — seen in CI on ranks that suspended before their first step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from luban.errors import EXIT_INTERRUPTED, EXIT_SUSPENDED

# a suspend signal during start-up (before the first step's check: nothing to save yet) gives the
# start-up this long to reach that check; then the process ends with 75 itself. A start-up can take
# minutes (a big model built, a dataset built, a checkpoint read): it kept a `timeout` or a `kill`
# waiting for all of it, or forever. What a kill -9 leaves there is cleaned up by the next start
# (a dataset's stage, a marker's temporary), so this exit leaves no more.
START_GRACE_S = 10.0
# (A second SIGTERM does not end the process, as a second SIGINT does: under Slurm a rank gets each
# SIGTERM twice, from slurmstepd, which signals every process of the step, and from luban's launcher.)


class SuspendFlag:
    """Installs the handlers on creation; ``requested`` turns true on the first signal."""

    started = False  # set by the trainer at its first step's check (``start_up_over``)
    _watchdog: threading.Thread | None = None

    def __init__(self):
        self.requested = False
        self.reason = ""
        self._sigints = 0
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            self._sigints += 1
            if self._sigints > 1:  # a second Ctrl-C: now, without the step's end or a checkpoint
                _say("luban: interrupted")
                os._exit(EXIT_INTERRUPTED)
        self.requested = True
        self.reason = signal.Signals(signum).name
        if not self.started and self._watchdog is None:
            self._watchdog = threading.Thread(target=self._end_start_up, name="luban-start-up-grace", daemon=True)
            self._watchdog.start()

    def start_up_over(self) -> None:
        """The first step's check is reached: from now on a signal suspends at the end of a step."""
        self.started = True

    def _end_start_up(self) -> None:
        time.sleep(START_GRACE_S)
        if not self.started:
            if os.environ.get("RANK", "0") == "0":  # one line for the job, not one per rank
                _say(f"luban: suspended on {self.reason} during start-up, which had not ended {START_GRACE_S:g} s "
                     f"later; nothing to save; exit {EXIT_SUSPENDED} (resume with --resume auto)")
            os._exit(EXIT_SUSPENDED)

    def request(self, reason: str) -> None:
        """Suspend at the end of this step for a cause other than a signal (a closed output pipe)."""
        self.requested, self.reason = True, self.reason or reason

    def agreed(self) -> bool:
        """True on every rank as soon as any rank was signalled (collective: every rank calls it
        at the same point of each step)."""
        return any_rank(self.requested)


def suspended_in_start_up() -> bool:
    """Whether a suspend signal came before this process's first step (its start-up is ending with 75):
    a rank that then loses its peer (the other rank's grace ended first) ends with 75 too, not 1."""
    return _FLAG is not None and _FLAG.requested and not _FLAG.started


def start_up_over() -> None:
    """This process's start-up is over (the trainer's first step's check; a launcher once its ranks
    run, which answer the signals from then on): no grace timer for a later signal."""
    if _FLAG is not None:
        _FLAG.start_up_over()


def _say(line: str) -> None:
    """One line on stderr from a signal handler or a thread (no buffered stream: it may be mid-write)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank: an all-reduce (MAX) of a CPU tensor over
    ``host_group``, which waits for the other ranks' hosts but never for a device. Collective."""
    import torch
    import torch.distributed as dist

    group = host_group()
    if group is False:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value[0])


_HOST_GROUP: tuple | None = None  # (the default group it was made for, a gloo group over its ranks)


def host_group():
    """The process group for all-reduces of host (CPU) values: ``None`` (the default group) where
    it runs gloo, else a gloo group over the same ranks, made at the first call (collective, so
    made at the same call on every rank) and remade for a new default group; ``False`` where there
    is no other rank to agree with (no process group, or a group of one)."""
    global _HOST_GROUP
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    if "gloo" in dist.get_backend():  # "gloo", or "cpu:gloo,cuda:nccl": CPU tensors go to gloo
        return None
    if _HOST_GROUP is None or _HOST_GROUP[0] is not dist.group.WORLD:
        _HOST_GROUP = (dist.group.WORLD, dist.new_group(backend="gloo"))
    return _HOST_GROUP[1]


_FLAG: SuspendFlag | None = None
HANDLED = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def early_signal() -> str | None:
    """The signal recorded before any work (by ``install``'s handlers), if one came."""
    return _FLAG.reason if _FLAG is not None and _FLAG.requested else None


def install() -> SuspendFlag:
    """The process's one flag: handlers installed on the first call, then unblocked (idempotent)."""
    global _FLAG
    if _FLAG is None:
        _FLAG = SuspendFlag()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)  # pending signals are delivered now, to us
    return _FLAG


def settle() -> None:
    """The exit code is decided: a late signal changes nothing, so ignore it until the process ends
    (SIG_IGN survives interpreter finalisation, which resets Python handlers to SIG_DFL). For the
    process entries that handle these signals: ``luban`` itself and the cluster's node launcher."""
    for sig in HANDLED:
        signal.signal(sig, signal.SIG_IGN)


def leave(code: int) -> None:
    """End a finished ``luban train``/``demo`` process with ``code``. Once torch is loaded, flush
    and ``os._exit``: everything that must outlive the command (checkpoint writer, loaders, process
    groups) has been closed by then, and what remains are C++ destructors that can only abort.
    Without torch (usage errors, the pre-flight checks) it returns and Python exits normally."""
    if "torch" not in sys.modules:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
