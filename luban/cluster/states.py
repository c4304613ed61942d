"""The job lifecycle: one state machine for the service, the scheduler and the simulator.

An *attempt* (one row of ``jobs``) moves through::

    queued ──► starting ──► running ──► suspending ──► suspended ─┐ (the chain goes on as a
       │          │            │             │                    │  new attempt: queued)
       ▼          ▼            ▼             ▼                    │
    stopped    succeeded | failed | stopped | suspended           ▼
                                                          next attempt: queued

and ``starting ──► queued`` for a start the executor could not make for an outage (the same
attempt waits in the queue; ``Scheduler._unclaim``).

``move`` is the only way a state changes (it refuses any other edge), ``FINAL`` states have no
way out, and ``requeue`` is the one rule for the attempt after a suspend: a job that yielded
its time slice goes to the back of its priority (its place becomes the requeue time); a job
suspended for a higher priority, by its user, or after a lost launcher keeps its place.
"""

from __future__ import annotations

import enum


class JobState(str, enum.Enum):
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    SUSPENDING = "suspending"
    SUSPENDED = "suspended"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value


S = JobState
# the same, as the plain strings stored in the database and compared in SQL
QUEUED, STARTING, RUNNING, SUSPENDING, SUSPENDED, SUCCEEDED, FAILED, STOPPED = (s.value for s in JobState)
ACTIVE = (S.STARTING.value, S.RUNNING.value, S.SUSPENDING.value)   # holds nodes
LIVE = (S.QUEUED.value, *ACTIVE)                                    # not ended
FINAL = (S.SUSPENDED.value, S.SUCCEEDED.value, S.FAILED.value, S.STOPPED.value)
_ENDS = {S.SUSPENDED, S.SUCCEEDED, S.FAILED, S.STOPPED}

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.QUEUED: frozenset({S.STARTING, S.STOPPED}),
    # starting: the launch may fail, be lost (service crash before launch: suspended, requeued),
    # be stopped, or be asked to suspend before the executor reports it running; a start that
    # met an executor outage goes back to the queue as the same attempt (Scheduler._unclaim)
    S.STARTING: frozenset({S.QUEUED, S.RUNNING, S.SUSPENDING} | _ENDS),
    S.RUNNING: frozenset({S.SUSPENDING} | _ENDS),
    S.SUSPENDING: frozenset(_ENDS),
    **{s: frozenset() for s in _ENDS},
}


class IllegalTransition(RuntimeError):
    pass


def check(old: str, new: str) -> JobState:
    """``new`` as a JobState if ``old -> new`` is an edge of the machine; else IllegalTransition."""
    old_s, new_s = JobState(old), JobState(new)
    if new_s not in TRANSITIONS[old_s]:
        raise IllegalTransition(f"job state {old_s.value} -> {new_s.value} is not allowed")
    return new_s


def move(job, new: str) -> None:
    """Set ``job.state`` (any object with a ``state`` string) along an edge of the machine."""
    job.state = check(job.state, new).value


def requeue(place: float, requeued_at: float, time_share: bool) -> tuple[str, float]:
    """The next attempt after a suspend: (its state, its place in the queue)."""
    return S.QUEUED.value, (requeued_at if time_share else place)
