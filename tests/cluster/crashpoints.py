"""``kill -9`` of ``luban cluster serve`` at a chosen moment, for tests/cluster/test_crash_sweep.py.

``LUBAN_TEST_CRASH=<point>`` in a service's environment makes it SIGKILL itself, once, at that
point of the scheduler's work (the database keeps what was committed, started processes run on,
nothing is flushed: a crash). The service command is ``SERVE`` instead of conftest's ``LUBAN``.

- ``claimed``: the claim (state ``starting``, nodes allocated) is committed; nothing started yet;
- ``mid-start``: the first rank's launcher is started, the second is not;
- ``suspending``: the job has been sent SIGUSR1, the ``suspending`` state is not committed;
- ``requeue``: the attempt is ended as ``suspended`` and its next attempt added, not committed.
"""

from __future__ import annotations

import os
import signal

from tests.cluster.conftest import LUBAN

VAR = "LUBAN_TEST_CRASH"
SERVE = [*LUBAN[:2], "import tests.cluster.crashpoints as crash; crash.install(); " + LUBAN[2]]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install() -> None:
    point = os.environ.pop(VAR, None)  # not inherited by the jobs this service starts
    if not point:
        return
    from luban.cluster import launcher, scheduler, states
    from luban.cluster.executors import local

    if point == "claimed":
        def start(self, launch):
            _die()

        local.LocalExecutor.start = start
    elif point == "mid-start":
        spawn, started = launcher.spawn, []

        def spawn_then_die(argv, **popen):
            if started:
                _die()
            started.append(spawn(argv, **popen))
            return started[-1]

        launcher.spawn = spawn_then_die
    elif point == "suspending":
        suspend = local.LocalExecutor.suspend

        def suspend_then_die(self, handle):
            suspend(self, handle)
            _die()

        local.LocalExecutor.suspend = suspend_then_die
    elif point == "requeue":
        end = scheduler.Scheduler._end

        def end_then_die(self, s, job, state, *args, **kwargs):
            end(self, s, job, state, *args, **kwargs)
            if state == states.SUSPENDED:
                s.flush()
                _die()

        scheduler.Scheduler._end = end_then_die
    else:
        raise SystemExit(f"{VAR}={point!r}: unknown crash point")
