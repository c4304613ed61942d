"""The service's clock: wall-clock time (seconds since the epoch) that moves like a monotonic clock.

Times the platform stores (``started_at``, ``ended_at``, ``suspend_deadline``, ``place``, events,
samples) are seconds since the epoch, so they mean something to people and survive a restart;
but the scheduler also subtracts them — a time limit, a suspend deadline, the launch grace, the
time-sharing quantum, the node-hours charged. A step of the wall clock (an NTP step, an admin's
``date -s``) made those differences jump: a step forward of a day killed every job with a time
limit and every job being suspended at once and charged a day of node-hours; a step back left
time limits and deadlines unreached and samples unwritten for as long as the step.

``Clock.now()`` is the wall clock read once, when the clock is made (the service's start), then
advanced by ``time.monotonic()``: within one service's life every difference of two times is
true elapsed time, whatever the wall clock does meanwhile. A step is taken up at the next start.
``Clock.from_wall`` carries a wall-clock time read elsewhere (an exit file's modification time,
written by the launcher after the step) into this clock.
"""

from __future__ import annotations

import time
from typing import Callable


STEP_MIN = 1.0  # seconds: a smaller difference of the wall clock from this one is not a step


class Clock:
    def __init__(self, wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic):
        self._wall, self._mono = wall, mono
        self._wall0, self._mono0 = wall(), mono()

    def now(self) -> float:
        """Seconds since the epoch as of the clock's start, plus true elapsed time since then."""
        return self._wall0 + (self._mono() - self._mono0)

    def step(self) -> float:
        """How far the wall clock has been stepped since this clock started: 0 for less than
        ``STEP_MIN`` (the two clocks' reads differ by microseconds; NTP slews both alike)."""
        step = self._wall() - self.now()
        return step if abs(step) >= STEP_MIN else 0.0

    def from_wall(self, t: float) -> float:
        """A wall-clock time read now (an exit file's mtime) on this clock's scale."""
        return t - self.step()


CLOCK = Clock()  # the process's clock: the scheduler's and the API's (service.py) unless a test gives its own


def now() -> float:
    return CLOCK.now()
