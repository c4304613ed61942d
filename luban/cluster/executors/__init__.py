"""Executors start job ranks on nodes, deliver the suspend signal, kill, and report exits.

The scheduler speaks to them through ``Executor``; ``local`` runs everything on this machine
(several virtual nodes for testing), ``slurm`` goes through a real Slurm controller.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from luban.errors import bad_value


@dataclasses.dataclass
class NodeInfo:
    name: str
    node_group: str = "default"
    gpus: int = 0
    labels: dict = dataclasses.field(default_factory=dict)
    addr: str = "127.0.0.1"
    # why the executor starts no new job there now, in one line (Slurm: drained, down, not responding ...;
    # SlurmExecutor.discover), None where it does. What already runs there runs on (as Slurm's drain)
    unavailable: str | None = None


@dataclasses.dataclass
class Launch:
    """Everything needed to start one job attempt: one rank per node, ranks in node order."""

    job_id: int
    name: str  # unique across services sharing an executor: luban-<job id>-<chain id>
    nodes: list[str]
    command: list[str]
    env: dict[str, str]
    run_dir: str
    log_pattern: str  # contains {rank}
    workdir: str | None = None
    run_as: str | None = None  # OS account the command runs as (None: the service's own)
    hide: tuple[str, ...] = ()  # directories covered in the job's namespaces (jobguard; non-root service)
    max_log: int | None = None  # bytes of each rank's log (launcher --max-log; None: joblog.MAX_LOG)


@dataclasses.dataclass
class Status:
    """``done`` with the job's exit code (75 = suspended), or still running (``started`` false
    while the executor has not started it yet); ``lost`` when the executor cannot find it.
    ``ended_at``: when it ended, where the executor knows (its exit files' time), so an attempt that
    ended while the service was down is charged until its end, not until the service saw it.
    ``unavailable`` / ``problem``: why the executor could not tell (an outage / anything else, one
    line each); with ``done`` false the job is as it was, with ``done`` the attempt ended as said
    and ``problem`` tells what could not be read (the scheduler puts it in the reason)."""

    done: bool
    exit_code: int | None = None
    lost: bool = False
    started: bool = True
    ended_at: float | None = None
    unavailable: str | None = None  # the executor could not ask (Slurm's controller unreachable): why, in one line
    problem: str | None = None  # what it could not read (a missing command, output it cannot parse), in one line
    held: str | None = None  # not started, and held where it runs (Slurm's Reason=JobHeldAdmin/JobHeldUser):
                             # that reason; it would never start (the scheduler cancels it there and holds the job)
    held_by_admin: bool = False  # that hold is an admin's (only an admin releases it), not the job's user's


class Unavailable(RuntimeError):
    """The executor cannot reach what runs the jobs now: a Slurm command that timed out or could not
    reach slurmctld. Not a verdict on the job: nothing of what was asked is left running (a start
    that met it cancelled what it may have submitted, or its next try makes sure), so the scheduler
    keeps the job as it was — a start goes back to the queue, the same attempt, and is retried
    with a backoff. Any other exception from ``start`` is the executor refusing the job: the
    attempt fails."""


class StartDeferred(RuntimeError):
    """This attempt's start must wait for what an earlier try of it left (a copy Slurm still lists
    as ending, or one being cancelled): not an outage, and nothing of it was submitted. The scheduler
    puts the attempt back in the queue as it was and asks again after its own backoff; other starts
    go on."""


def combine(codes: list[int]) -> int:
    """One exit code for all ranks: the first failure, else 75 if any rank suspended, else 0."""
    failures = [c for c in codes if c not in (0, 75)]
    if failures:
        return failures[0]
    return 75 if 75 in codes else 0


class Executor(Protocol):
    """Each call may raise ``Unavailable`` (an outage: asked again later, the job as it was); ``start``
    raising anything else fails the attempt."""

    def check(self) -> None: ...
    """Before a service starts: what the executor runs is there (a LubanError names what is not)."""
    def discover(self) -> list[NodeInfo]: ...
    def lingering(self, launch: Launch) -> bool: ...
    """Whether a copy of this attempt an earlier try submitted is still listed (a start would be
    ``StartDeferred``): asked before a deferred attempt is scheduled again."""
    def began(self, handle: str) -> float | None: ...
    """When the attempt's job began on its nodes (wall clock), where the executor knows; asked only
    of a copy a retry adopted, which is timed and charged from then, not from the retry."""
    def cancel_tries(self, launch: Launch) -> None: ...
    """Cancel what earlier tries of this queued attempt that met an outage may have submitted after
    all, for an attempt that is not starting now (held, or no longer admitted); its next start adopts
    none of it. Asked only of an attempt whose start met an outage."""
    def start(self, launch: Launch) -> str: ...
    def poll(self, handle: str) -> Status: ...
    def suspend(self, handle: str) -> None: ...
    def kill(self, handle: str) -> None: ...
    def find(self, launch: Launch) -> str | None: ...
    """After a service crash between starting a launch and recording its handle: the handle of
    the copy that did start (found by the launch's name/tag, not by a pid), to adopt it; None if
    nothing of it started (what started partially is killed). Never starts anything."""


def make(kind: str, **options) -> Executor:
    """``local`` or ``slurm`` with its options."""
    if kind == "local":
        from luban.cluster.executors.local import LocalExecutor

        return LocalExecutor(**options)
    if kind == "slurm":
        from luban.cluster.executors.slurm import SlurmExecutor

        return SlurmExecutor(**options)
    raise bad_value("executor", kind, "local or slurm")
