"""The scheduler loop: observe executors, ask the policy, apply its plan to the database.

Every tick: (1) read exits and move jobs on (a suspended attempt is requeued as the next
attempt of its chain), enforce suspend deadlines, stop and suspend requests; (2) build a
``policy.Snapshot`` from the database and call ``policy.plan``; (3) start and suspend jobs as
planned. A start is one transaction that locks the owner's quota row, recounts its use and
inserts node allocations (primary key per node), so concurrent schedulers or submissions can
never exceed a quota or share a node. Every decision goes to the ``events`` table.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import secrets
import threading
import time
from pathlib import Path

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from luban import jobenv
from luban.cluster import clock as clocks
from luban.cluster import launcher, policy, states
from luban.cluster.executors import Executor, Launch, StartDeferred, Status, Unavailable
from luban.cluster.models import ACTIVE, LIVE, Allocation, Event, Job, Node, Quota, Sample, StopReason, User, UserGroup
from luban.errors import LubanError
from luban.parallel.launch import free_port  # below the ephemeral range: an outgoing connection can take a port there

log = logging.getLogger("luban.cluster")
LAUNCH_GRACE = 60.0  # seconds a claimed job may go without an executor handle
RETRY_MIN_S, RETRY_MAX_S = 5.0, 300.0  # starts while the executor is unavailable: first retry, longest wait
GONE = "gone"  # a node's state once the executor no longer reports it (sync_nodes): kept, not scheduled
# a node's state while the executor starts no new job there (Slurm drained, down, not responding: its
# NodeInfo.unavailable, kept in Node.unavailable): not scheduled, its jobs left to the executor (a drain
# lets them run on, a node down ends them); up again when it does
UNAVAILABLE = "unavailable"
# seconds between readings of the executor's nodes: a node added to Slurm is seen without a restart, and a
# drain or resume in Slurm is followed within this (one `scontrol show node`; each running job costs a
# `scontrol show job` a tick)
NODE_SYNC_S = 30.0
MAX_REPORTED = 1000  # distinct executor problems remembered (each logged once)
# a queued attempt with any of these requested is not started: not in the policy's snapshot, and
# refused by the claim (a hold or stop that lands between a tick's snapshot and its start)
NOT_STARTED = int(StopReason.USER_STOP | StopReason.ADMIN_STOP | StopReason.HOLD)
POSTPONED = "start postponed"  # the "wait" event of a start that met an outage (_unclaim): a copy may be left


@dataclasses.dataclass
class Settings:
    state_dir: str
    url: str = "http://127.0.0.1:8765"   # what jobs use to reach the service
    tick: float = 1.0                     # seconds between scheduling ticks
    quantum: float = 3600.0               # time-sharing quantum (policy rule 2)
    suspend_timeout: float = 600.0        # seconds a job has to checkpoint before it is killed
    sample_every: float = 10.0            # seconds between occupancy samples
    run_jobs_as: str = "service"          # "user": each user's OS account (root only, cluster/accounts.py);
                                          # "namespace": the service's account in namespaces (jobguard.py)
    secret_dirs: tuple[str, ...] = ()     # covered in each job's namespaces (state dir, database folder)
    on_shutdown: str = "keep"             # keep: jobs run on, adopted on restart; kill: end them all first
    max_log: int | None = None            # bytes of each rank's log (--max-log; None: joblog.MAX_LOG)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return secrets.token_urlsafe(24)


def record(session: Session, kind: str, message: str, job_id: int | None = None, quiet: bool = False) -> None:
    """A decision: into the events table, and a line of the service log (``quiet``: debug level)."""
    session.add(Event(t=clocks.now(), job_id=job_id, kind=kind, message=message))
    log.log(logging.DEBUG if quiet else logging.INFO, "%s job=%s %s", kind, job_id, message)


def follow_executor(s: Session, node: Node, unavailable: str | None) -> None:
    """The executor's word on a node (``NodeInfo.unavailable``) into its row: an ``up`` node the executor
    starts no new job on is ``UNAVAILABLE`` — the one state the policy schedules is ``up``, so it is
    not scheduled, and what runs there is the executor's to keep (drained) or end (down) — and ``up``
    again once it does; an admin's ``drain`` or ``down`` stays as the admin set it, the executor's
    reason kept beside it. A change is a "node" event."""
    if unavailable != node.unavailable:
        record(s, "node", f"{node.name} takes no new job: {unavailable}" if unavailable else
               f"{node.name}: the executor starts jobs there again (was: {node.unavailable})")
    node.unavailable = unavailable
    if node.state == "up" and unavailable:
        node.state = UNAVAILABLE
    elif node.state == UNAVAILABLE and not unavailable:
        node.state = "up"


def start_message(nodes, why: str) -> str:
    return f"on {','.join(nodes)}: {why}"


def one_line(err: BaseException | str, limit: int = 300) -> str:
    return " ".join(str(err).split())[:limit]


@dataclasses.dataclass
class ExecutorOutage:
    """The executor cannot reach what runs the jobs (``executors.Unavailable``) since ``since``
    (the scheduler's clock). Starts wait until ``retry_at``; each start that meets the outage
    doubles ``delay`` (``RETRY_MIN_S`` .. ``RETRY_MAX_S``). ``starts``: a start met it, so only a
    start that succeeds ends it (a poll that reached slurmctld does not prove sbatch works)."""

    since: float
    cause: str
    retry_at: float = 0.0
    delay: float = RETRY_MIN_S
    starts: bool = False


def charged_until(job: Job, ended_at: float | None, now: float) -> float:
    """An ended attempt's ``ended_at``: the executor's end time (an attempt that ended while the
    service was down is not charged node-hours for the downtime), kept between its start and
    ``now`` (the scheduler's clock) — an exit file's time comes from a node's clock, which may be
    skewed or stepped."""
    if ended_at is None:
        return now
    return min(now, max(ended_at, job.started_at if job.started_at is not None else ended_at))


def job_tag(job: Job) -> str:
    """The attempt's tag: its Slurm job name and LUBAN_JOB_TAG of all its processes (luban.procs)."""
    return f"luban-{job.id}-{job.chain_id}"


class Scheduler:
    def __init__(self, sessions: sessionmaker, executor: Executor, settings: Settings,
                 clock: clocks.Clock | None = None):
        self.sessions, self.executor, self.settings = sessions, executor, settings
        # every time the scheduler stores or compares: steps of the wall clock change no duration (clock.py)
        self.clock = clock or clocks.CLOCK
        self.last_sample = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.outage_since: float | None = None  # when the database became unavailable to the ticks (None: it is not)
        self.executor_outage: ExecutorOutage | None = None  # the executor's (None: it answers)
        self.reported: dict[str, int] = {}  # executor problems logged (once each) and still seen: text -> job id
        self.unavailable_answers = 0  # answers that met an outage, ever (observe stops polling at one)
        self._tick_unavailable = 0  # unavailable_answers when this tick began (more since: this tick met one)
        self._reached = False  # this tick the executor answered a poll
        # the token of an attempt whose start met an outage, and when it was first claimed: its retry
        # reuses the token, so that a copy the earlier try's sbatch submitted after all, adopted by the
        # retry, holds the attempt's token (and is timed from when it began, no earlier than that claim)
        self._retry_tokens: dict[int, tuple[str, float]] = {}
        self._retried: dict[int, float] = {}  # attempts a retry started: job id -> the first claim's time
        # attempts whose start waits for what an earlier try of theirs left (StartDeferred): job id ->
        # (when to ask again, the backoff, why); out of the policy's view meanwhile, other starts go on
        self._deferred: dict[int, tuple[float, float, str]] = {}
        self._next_node_sync: float | None = None  # when the ticks read the executor's nodes again (None: now)
        self._node_sync_delay = RETRY_MIN_S  # after a reading that failed: doubles up to NODE_SYNC_S
        self._node_problem: str | None = None  # the last reading's failure, said once
        self._uncancelled: set[int] = set()  # queued attempts whose earlier try's copy could not be cancelled (said once)
        # queued attempts whose start met an outage, their copy not cancelled yet (None: read from the events first)
        self._tried: set[int] | None = None

    # -- nodes -------------------------------------------------------------------------------
    def sync_nodes(self) -> None:
        """Add or refresh the executor's nodes; an admin's drain stays in force. A node the executor
        starts no new job on (drained or down in Slurm) is ``UNAVAILABLE`` until it does again
        (``follow_executor``). A node the executor no longer reports (removed from Slurm) is ``gone``:
        kept, not scheduled, ``up`` again if it comes back (an empty answer marks nothing gone: it is
        more likely a glitch than a cluster removed)."""
        infos = self.executor.discover()  # before the transaction: a slow slurmctld holds no database lock
        with self.sessions.begin() as s:
            # every row in one SELECT: read every NODE_SYNC_S, one query per node cost a 2000-node cluster
            # seconds of the scheduler's thread on PostgreSQL (test_review_1202.py)
            known = {node.name: node for node in s.scalars(select(Node))}
            for info in infos:
                node = known.get(info.name) or Node(name=info.name, state="up")
                node.node_group, node.gpus, node.labels, node.addr = info.node_group, info.gpus, info.labels, info.addr
                if node.state == GONE:
                    node.state = "up"
                    log.warning("node %s is reported by the executor again: scheduled again", node.name)
                follow_executor(s, node, info.unavailable)
                s.add(node)
            reported = {info.name for info in infos}
            for node in known.values() if reported else ():
                if node.name in reported:
                    continue
                if node.state in ("up", UNAVAILABLE):
                    node.state = GONE
                    log.warning("node %s is no longer reported by the executor: not scheduled (kept as %s)",
                                node.name, GONE)
                if node.unavailable:  # the executor says nothing of it now (an admin's drain kept Slurm's why)
                    record(s, "node", f"{node.name} is no longer reported by the executor (was: {node.unavailable})")
                node.unavailable = None
        self._next_node_sync = self.clock.now() + NODE_SYNC_S

    def refresh_nodes(self, now: float) -> None:
        """The ticks' reading of the nodes, every ``NODE_SYNC_S``; after one that failed, again after a
        backoff (``RETRY_MIN_S`` doubling to ``NODE_SYNC_S``, counted from when the failure was known:
        a hung slurmctld's timeout is not spent every tick). A service started while slurmctld could
        not be reached gets its nodes once it can, and a node added to Slurm is scheduled without a
        restart. An outage is the outage's lines; unreadable output is one line until read again."""
        if self._next_node_sync is not None and now < self._next_node_sync:
            return
        try:
            self.sync_nodes()
        except (RuntimeError, LubanError) as err:  # Unavailable included
            self._next_node_sync = self.clock.now() + self._node_sync_delay
            self._node_sync_delay = min(self._node_sync_delay * 2, NODE_SYNC_S)
            if isinstance(err, Unavailable):
                self._executor_unavailable(err)
            elif self._node_problem != one_line(err):
                self._node_problem = one_line(err)
                log.warning("the executor's nodes could not be read: %s (asked again later)", self._node_problem)
            return
        self._node_sync_delay = RETRY_MIN_S
        if self._node_problem is not None:
            log.warning("the executor's nodes can be read again (was: %s)", self._node_problem)
            self._node_problem = None
        self._executor_reached()

    # -- the loop ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="luban-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=30)

    def kill_all(self, timeout: float = 30.0) -> int:
        """Service shutdown with ``on_shutdown = kill``: every active attempt is stopped (ADMIN_STOP)
        and killed; returns once the executor reports none running (or after ``timeout``)."""
        with self.sessions.begin() as s:
            jobs = s.scalars(select(Job).where(Job.state.in_(ACTIVE), Job.handle.is_not(None))).all()
            for job in jobs:
                job.requested |= StopReason.ADMIN_STOP
                job.stop_reason |= StopReason.ADMIN_STOP
                record(s, "kill", "service shutting down (--on-shutdown kill)", job.id)
            handles = [job.handle for job in jobs]
        for handle in handles:
            try:
                self.executor.kill(handle)
            except (RuntimeError, LubanError) as err:  # Unavailable included: said in one line, not a traceback
                log.warning("could not kill %s at shutdown: %s", handle, one_line(err))
        deadline = time.monotonic() + timeout
        while handles and time.monotonic() < deadline:
            handles = [h for h in handles if not self.executor.poll(h).done]
            time.sleep(0.1)
        self.observe(self.clock.now())  # record the ends now, not at the next start
        return len(handles)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.guarded_tick()
            self._stop.wait(self.settings.tick)

    def guarded_tick(self) -> None:
        """One tick that never raises. A database outage is two lines in the service log, when it
        starts and when it ends, not a traceback every tick (5 a second at --tick 0.2); any other
        failure is a bug: its traceback is logged."""
        try:
            self.tick()
        except OperationalError as err:
            self._outage_began(err)
            return
        except Exception:  # keep scheduling; the traceback goes to the service log
            log.exception("scheduling tick failed")
            return
        self._outage_ended()

    def _outage_began(self, err: OperationalError) -> None:
        """The first tick that fails for the database says so, in one line; the next ones say nothing."""
        if self.outage_since is None:
            self.outage_since = time.monotonic()
            cause = " ".join(str(getattr(err, "orig", err)).split())[:300]
            log.warning("database unavailable: scheduling paused until it is back (%s)", cause)

    def _outage_ended(self) -> None:
        """The first tick that succeeds after an outage says so, in one line."""
        if self.outage_since is not None:
            log.warning("database available again after %.0fs: scheduling resumed",
                        time.monotonic() - self.outage_since)
            self.outage_since = None

    def _executor_unavailable(self, err: BaseException | str, start: bool = False) -> None:
        """The executor could not reach what runs the jobs: the first time, one warning; a start that
        met it is retried after the backoff, which doubles with each such start."""
        now = self.clock.now()
        self.unavailable_answers += 1
        if self.executor_outage is None:
            self.executor_outage = ExecutorOutage(since=now, cause=one_line(err))
            log.warning("executor unavailable: jobs keep their state, starts wait and are retried with a "
                        "backoff (%s)", self.executor_outage.cause)
        outage = self.executor_outage
        if start:  # the reason of the jobs that wait names what their start met
            outage.cause = one_line(err)
            outage.starts = True
            outage.retry_at = now + outage.delay
            outage.delay = min(outage.delay * 2, RETRY_MAX_S)

    def _executor_reached(self, start: bool = False) -> None:
        """The executor answered: an outage ends, in one line — one a start met, with a start; any
        other at the end of a tick in which the executor answered and nothing met the outage
        (``tick``: a poll that answered and a kill that did not are still an outage)."""
        outage = self.executor_outage
        if outage is None or (outage.starts and not start):
            return
        if not start:
            self._reached = True
            return
        self._outage_over()

    def _outage_over(self, line: str = "executor available again after %.0fs: starts resumed") -> None:
        """The outage ends, in one log line (``line``: its seconds as ``%.0f``)."""
        log.warning(line, self.clock.now() - self.executor_outage.since)
        self.executor_outage = None

    def _met_outage_this_tick(self) -> bool:
        return self.unavailable_answers > self._tick_unavailable

    def starts_wait(self, now: float) -> bool:
        """Starts wait for the executor: an outage met a start and its retry time has not come."""
        outage = self.executor_outage
        return outage is not None and outage.starts and now < outage.retry_at

    def _waiting_reason(self) -> str:
        return f"waiting for the executor to answer: {self.executor_outage.cause} (the start is retried)"

    def _report(self, status: Status, job_id: int, seen: set[str]) -> None:
        """An executor's answer about a job: an outage goes to the outage's two lines; a problem it
        could not read past (a missing command, unparseable output) is one line the first time it
        is seen, not one a tick."""
        if status.unavailable:
            self._executor_unavailable(status.unavailable)
        elif status.problem is None:
            self._executor_reached()  # noted; the outage ends at the end of the tick (tick)
        if status.problem and not status.done:
            self._problem(status.problem, job_id, seen)

    def _problem(self, problem: str, job_id: int, seen: set[str]) -> None:
        """One line the first time a problem is seen; ``observe`` says when a pass no longer sees it."""
        seen.add(problem)
        if problem not in self.reported:
            if len(self.reported) >= MAX_REPORTED:
                self.reported.clear()
            self.reported[problem] = job_id
            log.warning("job %s: the executor could not tell its state: %s; it stays as it was until it can",
                        job_id, problem)

    def _end_outage(self) -> None:
        outage = self.executor_outage
        if outage is not None and self._reached and not self._met_outage_this_tick() and not outage.starts:
            self._outage_over()

    def tick(self) -> policy.Plan:
        now = self.clock.now()
        self._tick_unavailable, self._reached = self.unavailable_answers, False  # what the executor does this tick
        self.observe(now)
        if not self._met_outage_this_tick():  # a hung slurmctld costs one timeout a tick, not two
            self.refresh_nodes(now)
        self._recheck_deferred(now)
        with self.sessions() as s:
            snap = self.snapshot(s, now)
        result = policy.plan(snap)
        self.apply(result, now)
        self._end_outage()
        if now - self.last_sample >= self.settings.sample_every:
            self.sample(now)
        return result

    # -- (1) observe -------------------------------------------------------------------------
    def observe(self, now: float) -> None:
        with self.sessions() as s:
            ids = s.scalars(select(Job.id).where(Job.state.in_(ACTIVE))).all()
            queued_stops = s.scalars(select(Job.id).where(Job.state == states.QUEUED, Job.requested.op("&")(
                int(StopReason.USER_STOP | StopReason.ADMIN_STOP)) != 0)).all()
            queued_held = s.scalars(select(Job.id).where(Job.state == states.QUEUED, Job.requested.op("&")(
                int(StopReason.HOLD)) != 0)).all()
        before = self.unavailable_answers
        for job_id in queued_stops:
            if self.unavailable_answers > before:  # one Slurm timeout a tick, as for the polls below
                break
            with self.sessions.begin() as s:
                job = s.get(Job, job_id)
                if job.state == states.QUEUED:
                    if not self._cancel_earlier_try(s, job):
                        continue  # the executor cannot be asked now: stopped once it can
                    self._end(s, job, states.STOPPED, None, job.requested, "stopped while queued")
        self._cancel_tries(queued_held, "held while queued")
        seen: set[str] = set()
        for n, job_id in enumerate(ids):
            if self.unavailable_answers > before:  # a hung slurmctld costs one TIMEOUT_S a tick, not one a job
                log.debug("executor unavailable: %d job(s) not polled this tick", len(ids) - n)
                return  # (nor is a problem of theirs taken as gone)
            try:
                if job_id in self._retried:
                    self._time_adopted(job_id)
                with self.sessions.begin() as s:
                    job = s.get(Job, job_id, with_for_update=True)
                    if job.state in ACTIVE:
                        self._observe_one(s, job, now, seen)
            except OperationalError:
                raise  # the database, not this job: the tick ends here (guarded_tick logs the outage once)
            except Unavailable as err:  # rolled back, the job as it was: asked again next tick
                self._executor_unavailable(err)
            except LubanError as err:  # the executor's one line (a missing Slurm command): the same, said once
                self._problem(one_line(err), job_id, seen)
            except Exception:  # one job's executor trouble must not stop the others; retried next tick
                log.exception("observing job %s failed", job_id)
        for problem in [p for p in self.reported if p not in seen]:  # a whole pass without it: gone
            log.warning("job %s: the executor can tell its state again (was: %s)", self.reported.pop(problem),
                        problem)

    def _recheck_deferred(self, now: float) -> None:
        """A deferred attempt stays out of the policy's view until its retry is due *and* the copy it
        waits for is no longer listed (``Executor.lingering``): back in view while it still was, it was
        admitted again and the policy preempted running jobs for a start that was deferred again, every
        backoff, for as long as the copy stayed stuck. One ``squeue`` per due attempt; an outage stops
        the round (asked again next tick)."""
        for job_id in [i for i, (retry_at, _, _) in self._deferred.items() if retry_at <= now]:
            if self._met_outage_this_tick():
                return
            with self.sessions() as s:
                launch = self._tagged(s.get(Job, job_id))
            try:
                lingering = self.executor.lingering(launch)
            except Unavailable as err:
                self._executor_unavailable(err)
                return
            except (RuntimeError, LubanError):  # cannot tell: asked again after the backoff
                lingering = True
            if lingering:
                self._defer(job_id)
            else:
                del self._deferred[job_id]  # in view again: the policy starts it when its turn comes

    def _defer(self, job_id: int, why: str | None = None) -> None:
        """Keep a deferred attempt out of the policy's view for its backoff (``RETRY_MIN_S`` at first,
        doubling to ``RETRY_MAX_S``); ``why``: its reason (kept when None)."""
        _, delay, before = self._deferred.get(job_id, (0.0, RETRY_MIN_S / 2, ""))
        delay = min(delay * 2, RETRY_MAX_S)
        self._deferred[job_id] = (self.clock.now() + delay, delay, why or before)

    def _time_adopted(self, job_id: int) -> None:
        """An attempt a retry started may be a copy an earlier try submitted after all (adopted): it is
        timed and charged from when its ranks began (``Executor.began``), kept between the attempt's
        first claim and the retry's claim. Its own transaction, forgotten once committed: a kill that
        later meets an outage does not roll it back."""
        with self.sessions.begin() as s:
            job = s.get(Job, job_id, with_for_update=True)
            if job.state not in ACTIVE or job.handle is None:
                return
            began = self.executor.began(job.handle)
            if began is None:  # not begun yet (or not a copy): asked again next tick
                return
            job.started_at = max(self._retried[job_id], min(job.started_at, self.clock.from_wall(began)))
        del self._retried[job_id]

    def _cancel_tries(self, ids: list[int], why: str) -> None:
        """Queued attempts among ``ids`` that are not starting now (held; or no longer admitted) whose
        start met an outage, and whose copy is not cancelled yet: what that start may have submitted
        after all (a timed-out ``sbatch``'s copy nothing could cancel) is cancelled once the executor
        can be asked (``Executor.cancel_tries``; while starts wait for an outage, at their retries), and
        a ``cancel`` event says so. Before, nothing asked until the attempt started again, which a held
        one never did: the copy ran on in Slurm, outside the job's state (a held, then stopped job went
        on running there), on nodes luban gave to others. The next start is a fresh one (a new token)
        that waits for the copy to leave Slurm."""
        if self._tried is None:  # after a start of the service: from the events, once
            self._tried = self._tried_in_history()
        wanted = sorted(self._tried.intersection(ids))
        if not wanted or self._met_outage_this_tick() or self.starts_wait(self.clock.now()):
            return
        for job_id in wanted:
            with self.sessions.begin() as s:
                job = s.get(Job, job_id, with_for_update=True)
                if job.state != states.QUEUED:
                    self._tried.discard(job_id)
                    continue
                try:
                    self.executor.cancel_tries(self._tagged(job))
                except Unavailable as err:  # asked again once it answers; one timeout a tick
                    self._executor_unavailable(err)
                    return
                except (RuntimeError, LubanError) as err:  # asked again next tick; said once
                    if job_id not in self._uncancelled:
                        self._uncancelled.add(job_id)
                        log.warning("job %s: %s; what an earlier try submitted could not be cancelled: %s",
                                    job_id, why, one_line(err))
                    continue
                self._uncancelled.discard(job_id)
                self._tried.discard(job_id)
                self._retry_tokens.pop(job_id, None)  # that try is over: its token runs nothing any more
                record(s, "cancel", f"{why}: what its postponed start may have submitted is cancelled", job_id)

    def _tried_in_history(self) -> set[int]:
        """Queued attempts whose latest "start postponed" is later than their latest ``cancel``: what a
        service that stopped before cancelling their copies leaves (``_cancel_tries``); one query, at
        the first tick that asks."""
        with self.sessions() as s:
            queued = select(Job.id).where(Job.state == states.QUEUED)
            latest = dict(s.execute(select(Event.job_id, func.max(Event.id)).where(
                Event.job_id.in_(queued), Event.kind == "wait", Event.message.startswith(POSTPONED)).group_by(
                Event.job_id)).all())
            cancelled = dict(s.execute(select(Event.job_id, func.max(Event.id)).where(
                Event.job_id.in_(queued), Event.kind == "cancel").group_by(Event.job_id)).all())
        return {i for i, last in latest.items() if last > cancelled.get(i, 0)}

    def _cancel_earlier_try(self, s: Session, job: Job) -> bool:
        """A queued attempt being stopped whose start met an outage: what that try may have submitted
        (a timed-out sbatch that nothing could cancel) is found by its tag and killed, so nothing of
        a stopped job runs on. False while the executor cannot be asked (the stop waits)."""
        tried = s.scalar(select(Event.id).where(Event.job_id == job.id, Event.kind == "wait",
                                                Event.message.startswith(POSTPONED)).limit(1))
        if tried is None:
            return True
        try:
            handle = self.executor.find(self._tagged(job))
            if handle is not None and not self.executor.poll(handle).done:
                self.executor.kill(handle)
                record(s, "kill", "stopped while queued: the copy an earlier try submitted is cancelled", job.id)
        except Unavailable as err:
            self._executor_unavailable(err)
            return False
        except (RuntimeError, LubanError) as err:
            log.warning("job %s: stopped while queued; what an earlier try submitted could not be "
                        "checked: %s", job.id, one_line(err))
        return True

    def _observe_one(self, s: Session, job: Job, now: float, seen: set[str] | None = None) -> None:
        if job.handle is None:  # being launched, or the service died between claim and recording the launch
            if now - job.started_at > LAUNCH_GRACE:
                # exactly once: adopt the copy that started (found by its tag), or requeue if none did
                handle = self.executor.find(self.launch_of(job, {}))
                if handle is not None:
                    job.handle = handle
                    record(s, "adopt", "found running after a service restart; adopted", job.id)
                else:  # it never ran: charged nothing (the nodes were held only by the crash)
                    self._end(s, job, states.SUSPENDED, None, StopReason.LOST, "never launched; requeued",
                              ended_at=job.started_at, on_service_clock=True)
            return
        status = self.executor.poll(job.handle)
        self._report(status, job.id, seen if seen is not None else set())
        if status.done:
            self._finish(s, job, status.exit_code, status.lost, status.ended_at, status.problem)
            return
        if job.state == states.STARTING and status.started:
            states.move(job, states.RUNNING)
        stop = job.requested & (StopReason.USER_STOP | StopReason.ADMIN_STOP)
        if stop and not job.stop_reason & stop:
            job.stop_reason |= stop
            self.executor.kill(job.handle)
            record(s, "kill", f"stop requested ({StopReason(stop).name})", job.id)
        elif job.state == states.STARTING and status.held:
            self._held_by_executor(s, job, status.held, status.held_by_admin)
        elif job.state == states.STARTING and not status.started and (why := self._not_starting_there(s, job)):
            self._placed_where_nothing_starts(s, job, why)
        elif (job.state == states.RUNNING and job.spec.get("time_limit") and not job.stop_reason & StopReason.TIME_LIMIT
              and now - job.started_at > job.spec["time_limit"]):
            job.stop_reason |= StopReason.TIME_LIMIT
            self.executor.kill(job.handle)
            record(s, "kill", f"time limit of {job.spec['time_limit']}s reached", job.id)
        elif job.state == states.RUNNING and job.requested & StopReason.USER_SUSPEND:
            self._suspend(s, job, StopReason.USER_SUSPEND, "suspend requested by the user", now)
        elif job.state == states.SUSPENDING and job.acked and not job.stop_reason & StopReason.SUSPEND_TIMEOUT:
            if job.suspend_deadline is not None:
                job.suspend_deadline = None
                self.executor.kill(job.handle)
                record(s, "kill", "job acknowledged the suspend (go_suspend): released", job.id)
        elif job.state == states.SUSPENDING and job.suspend_deadline is not None and now > job.suspend_deadline:
            job.stop_reason |= StopReason.SUSPEND_TIMEOUT
            job.suspend_deadline = None
            self.executor.kill(job.handle)
            record(s, "kill", f"no acknowledgement within {self.settings.suspend_timeout:g}s: killed", job.id)

    def _held_by_executor(self, s: Session, job: Job, reason: str, by_admin: bool) -> None:
        """An attempt whose copy the executor holds before it started (Slurm: ``scontrol hold``, Reason
        ``JobHeldAdmin``/``JobHeldUser``) would hold its nodes in ``starting`` for as long as the hold
        lasts. The hold is taken as meant — this job is not to start now — and moved to luban, which
        decides where jobs run: the copy is cancelled there, the attempt ends (charged nothing: it never
        ran; its nodes freed) and its requeued attempt is held as by ``luban hold`` (an admin's hold
        for an admin's there, ``JobHeldAdmin``: only an admin releases it), so ``luban release`` lets it
        start again."""
        self.executor.kill(job.handle)  # a pending copy: cancelled before it ran anything
        hold = StopReason.HOLD | (StopReason.ADMIN_HOLD if by_admin else 0)
        why = (f"held in the executor before it started (Reason={reason}): cancelled there and requeued held; "
               f"`luban release` ({'an admin' if by_admin else 'its user or an admin'}) lets it start")
        self._end(s, job, states.SUSPENDED, None, 0, why, ended_at=job.started_at, on_service_clock=True,
                  hold=int(hold))

    @staticmethod
    def _not_starting_there(s: Session, job: Job) -> str | None:
        """Why the executor starts no job on one of ``job``'s nodes (``Node.unavailable``, its last
        reading: drained or down in Slurm), in one line; None where it starts jobs on all of them."""
        held = s.execute(select(Node.name, Node.unavailable).where(
            Node.name.in_(job.nodes or ()), Node.unavailable.is_not(None)).order_by(Node.name)).all()
        return "; ".join(f"{name}: {why}" for name, why in held) or None

    def _placed_where_nothing_starts(self, s: Session, job: Job, why: str) -> None:
        """An attempt placed on a node just before the executor stopped starting jobs there (Slurm
        drained it between two readings, ``NODE_SYNC_S``): Slurm keeps it pending (``ReqNodeNotAvail``)
        for as long as the drain lasts, holding its other nodes in ``starting``. Once a reading says
        so, its copy is cancelled there and the attempt ends, charged nothing (it never ran), its
        requeued attempt keeping its place: the policy places it on nodes that start jobs."""
        self.executor.kill(job.handle)  # a pending copy: cancelled before it ran anything
        self._end(s, job, states.SUSPENDED, None, 0, f"not started: the executor starts no job on its node(s) "
                  f"({why}): cancelled there and requeued", ended_at=job.started_at, on_service_clock=True)

    def _finish(self, s: Session, job: Job, code: int | None, lost: bool, ended_at: float | None = None,
                problem: str | None = None) -> None:
        stop = job.requested & (StopReason.USER_STOP | StopReason.ADMIN_STOP)
        end = functools.partial(self._end, ended_at=ended_at)
        if job.stop_reason & StopReason.TIME_LIMIT:
            end(s, job, states.FAILED, code, job.stop_reason,
                f"time limit of {job.spec['time_limit']}s reached: killed (exit code {code})")
        elif stop:
            end(s, job, states.STOPPED, code, job.stop_reason | stop, f"stopped on request, exit code {code}")
        elif code == 75 or (job.state == states.SUSPENDING and code != 0):
            end(s, job, states.SUSPENDED, code, job.stop_reason, f"suspended with exit code {code}; requeued")
        elif code == 0:
            end(s, job, states.SUCCEEDED, 0, job.stop_reason, "exit code 0")
        elif lost:
            end(s, job, states.FAILED, None, job.stop_reason | StopReason.LOST,
                f"lost: {problem}" if problem else "lost: launcher gone, no exit code")
        else:
            end(s, job, states.FAILED, code, job.stop_reason | StopReason.NONZERO_EXIT, f"exit code {code}")

    def _end(self, s: Session, job: Job, state: str, code: int | None, reasons: int, message: str,
             ended_at: float | None = None, on_service_clock: bool = False, hold: int = 0) -> None:
        """Close an attempt, free its nodes; a suspended attempt is requeued as the next one.
        ``ended_at``: when it ended as the executor reports it (None: now), a wall-clock time
        unless ``on_service_clock``. ``hold``: the requeued attempt's hold requests (HOLD, ADMIN_HOLD)."""
        why = job.reason if job.state == states.SUSPENDING else None  # the suspend's cause (_suspend)
        states.move(job, state)
        job.exit_code, job.stop_reason = code, int(reasons)
        job.reason = f"{message} ({why})" if why else message  # the reason column says how it ended
        now = self.clock.now()
        if ended_at is not None and not on_service_clock:  # an exit file's mtime: the wall clock's, step and all
            ended_at = self.clock.from_wall(ended_at)
        job.ended_at, job.token_hash, job.suspend_deadline = charged_until(job, ended_at, now), None, None
        self._retry_tokens.pop(job.id, None)
        self._retried.pop(job.id, None)
        self._deferred.pop(job.id, None)
        if self._tried is not None:
            self._tried.discard(job.id)
        s.execute(Allocation.__table__.delete().where(Allocation.job_id == job.id))
        record(s, state, message, job.id)
        if state == states.SUSPENDED:
            next_state, place = states.requeue(job.place, now, bool(job.stop_reason & StopReason.TIME_SHARE))
            nxt = Job(chain_id=job.chain_id, first_id=job.first_id, restart_count=job.restart_count + 1,
                      whole_life_state=job.whole_life_state, user=job.user, group=job.group, owner=job.owner,
                      name=job.name, spec=job.spec, priority=job.priority, node_group=job.node_group,
                      nnodes=job.nnodes, state=next_state, chain_submitted_at=job.chain_submitted_at,
                      place=place,
                      queued_at=now, nodes=[], requested=hold, stop_reason=0, reason=f"requeued: {job.reason}")
            s.add(nxt)
            s.flush()
            record(s, "requeue", f"attempt {nxt.restart_count} of chain {job.chain_id} (was job {job.id})", nxt.id)
            if hold:
                record(s, "hold", f"as its previous attempt's was in the executor ({message})", nxt.id)

    def _suspend(self, s: Session, job: Job, why: StopReason, message: str, now: float) -> None:
        states.move(job, states.SUSPENDING)
        job.stop_reason |= why
        job.reason = message
        job.suspend_deadline = now + self.settings.suspend_timeout
        self.executor.suspend(job.handle)
        record(s, "suspend", message, job.id)

    # -- (2) snapshot ------------------------------------------------------------------------
    def snapshot(self, s: Session, now: float) -> policy.Snapshot:
        nodes = [policy.NodeView(n.name, n.node_group, (n.labels or {}).get("zone", "default"), n.state == "up",
                                 n.state == "down", n.state == GONE)
                 for n in s.scalars(select(Node))]
        jobs = [policy.JobView(j.id, j.user, j.owner, j.priority, j.node_group, j.nnodes, j.state,
                               j.place, j.started_at if j.state != states.QUEUED else j.queued_at,
                               tuple(j.nodes or ()))
                for j in s.scalars(select(Job).where(Job.state.in_(LIVE)))
                if not (j.state == states.QUEUED and (j.requested & NOT_STARTED or j.id in self._deferred))]
        quota = {(q.owner, q.node_group, q.priority): q.nodes for q in s.scalars(select(Quota))}
        return policy.Snapshot(now, nodes, jobs, quota, self.settings.quantum)

    # -- (3) apply ---------------------------------------------------------------------------
    def apply(self, result: policy.Plan, now: float) -> None:
        outage = self.executor_outage
        held = 0
        for job_id, why, time_share in result.suspends:
            if outage is not None and outage.starts and job_id not in result.off_down_nodes:
                held += 1  # it makes room for a start, and starts meet an outage: it runs on meanwhile
                continue  # (else, one quantum or preemption at a time, the outage drained the cluster)
            try:
                with self.sessions.begin() as s:
                    job = s.get(Job, job_id, with_for_update=True)
                    if job.state == states.RUNNING:
                        flag = StopReason.TIME_SHARE if time_share else StopReason.PREEMPTED
                        self._suspend(s, job, flag, why, now)
            except OperationalError:
                raise  # the database, not this job: the tick ends here (guarded_tick logs the outage once)
            except Unavailable as err:  # rolled back: the policy asks again next tick
                self._executor_unavailable(err)
            except Exception:  # rolled back: the policy asks again next tick
                log.exception("suspending job %s failed", job_id)
        if held:
            log.debug("executor unavailable: %d suspend(s) for starts held until a start succeeds", held)
        outage = self.executor_outage
        if outage is not None and outage.starts and not result.starts and now >= outage.retry_at:
            outage.starts = False  # nothing left to retry: the next answer of the executor ends the outage
            if not self._met_outage_this_tick():  # nothing met it this tick, and no start waits: with no job
                # to poll nothing would ever end it, and a later outage would get no line and the old backoff
                self._outage_over("executor outage over for the scheduler after %.0fs: no start waits for it any more")
        postponed = []
        for job_id, nodes, why in result.starts:
            if self.starts_wait(self.clock.now()):  # a start met the outage (this tick, or its retry is not due)
                postponed.append(job_id)
            else:
                self.launch(job_id, nodes, why)
        if postponed:
            reason = self._waiting_reason()
            with self.sessions.begin() as s:
                for job in s.scalars(select(Job).where(Job.id.in_(postponed), Job.state == states.QUEUED)):
                    if job.reason != reason:
                        job.reason = reason
                        record(s, "wait", reason, job.id, quiet=True)
        if result.waits:
            waits = result.waits
            if held and self.executor_outage is not None:  # not "waiting for nodes being released": none is
                reason = self._waiting_reason()
                waits = {i: reason if i in result.admitted else why for i, why in waits.items()}
            with self.sessions.begin() as s:
                for job in s.scalars(select(Job).where(Job.id.in_(list(waits)))):
                    if job.reason != waits[job.id]:
                        job.reason = waits[job.id]
                        record(s, "wait", job.reason, job.id, quiet=bool(held))
            self._cancel_tries(sorted(set(result.waits) - result.admitted), "not admitted")

    def claim(self, job_id: int, nodes: tuple[str, ...], why: str, quiet: bool = False) -> tuple[Job, str] | None:
        """The start transaction: quota row locked and recounted, nodes inserted; None if refused. The
        retry of a start that was postponed writes its "start" event once it has started (``launch``):
        an outage or a stuck earlier copy of hours is not two events per retry in the job's history."""
        retry = job_id in self._retry_tokens
        token = self._retry_tokens[job_id][0] if retry else new_token()
        try:
            with self.sessions.begin() as s:
                job = s.get(Job, job_id)
                quota = s.get(Quota, (job.owner, job.node_group, job.priority), with_for_update=True)
                held = s.scalar(select(func.coalesce(func.sum(Job.nnodes), 0)).where(
                    Job.owner == job.owner, Job.node_group == job.node_group,
                    Job.priority == job.priority, Job.state.in_(ACTIVE)))
                if quota is None or held + job.nnodes > quota.nodes:
                    record(s, "refuse", f"quota re-check failed: {held} + {job.nnodes} > "
                                        f"{quota.nodes if quota else 0}", job_id)
                    return None
                claimed = s.execute(update(Job).where(Job.id == job_id, Job.state == states.QUEUED,
                                                      Job.requested.op("&")(NOT_STARTED) == 0).values(
                    state=states.STARTING, nodes=list(nodes), started_at=self.clock.now(), reason=why,
                    token_hash=token_hash(token)))
                if claimed.rowcount != 1:
                    return None
                s.add_all(Allocation(node=n, job_id=job_id) for n in nodes)
                if not retry:
                    record(s, "start", start_message(nodes, why), job_id, quiet=quiet)
            return job, token
        except IntegrityError:
            return None  # another scheduler took one of the nodes first

    def launch(self, job_id: int, nodes: tuple[str, ...], why: str) -> None:
        retry = self.executor_outage is not None and self.executor_outage.starts  # its lines are debug-level
        claimed = self.claim(job_id, nodes, why, quiet=retry)
        if claimed is None:
            return
        job, token = claimed
        with self.sessions() as s:
            env = self.job_env(s, job, token, nodes)
        launch = self.launch_of(job, env, nodes)
        try:
            handle = self.executor.start(launch)
        except (Unavailable, StartDeferred) as err:  # not the job: back to the queue, the same attempt, retried
            if isinstance(err, Unavailable):  # an outage: every start waits for it
                self._executor_unavailable(err, start=True)
            else:  # this attempt alone waits for what an earlier try of it left: its own backoff
                self._defer(job_id, f"waiting: {one_line(err)} (the start is retried)")
            with self.sessions.begin() as s:
                claimed_job = s.get(Job, job_id, with_for_update=True)
                self._retry_tokens.setdefault(job_id, (token, claimed_job.started_at))
                self._unclaim(s, claimed_job, quiet=retry,
                              reason=self._deferred[job_id][2] if isinstance(err, StartDeferred) else None)
            return
        except Exception as err:  # noqa: BLE001 - any other launch failure fails this attempt, not the service
            retried = self._retry_tokens.pop(job_id, None) is not None
            with self.sessions.begin() as s:
                if retried:  # the start that failed is in its history, with its nodes
                    self._retry_started(s, job_id, nodes, why)
                self._end(s, s.get(Job, job_id), states.FAILED, None, StopReason.LOST,
                          f"launch failed: {one_line(err, 500)}")
            return
        self._executor_reached(start=True)
        if self._tried is not None:  # started (or its copy adopted): nothing left to cancel
            self._tried.discard(job_id)
        retried = job_id in self._retry_tokens
        if retried:
            self._retried[job_id] = self._retry_tokens.pop(job_id)[1]
        with self.sessions.begin() as s:
            s.get(Job, job_id).handle = handle
            if retried:
                self._retry_started(s, job_id, nodes, why)

    def _retry_started(self, s: Session, job_id: int, nodes: tuple[str, ...], why: str) -> None:
        """The "start" event of a retry of a postponed start, once it has started or failed (``claim``
        writes none for a retry: one more "start" per retry of an outage of hours)."""
        record(s, "start", start_message(nodes, f"{why} (a retry of a start postponed)"), job_id)

    def _unclaim(self, s: Session, job: Job, quiet: bool = False, reason: str | None = None) -> None:
        """Undo a claim whose start met an executor outage: the attempt is queued again as it was
        (same id, same place), its nodes are freed and it is charged nothing; its reason says why
        it waits."""
        states.move(job, states.QUEUED)
        s.execute(Allocation.__table__.delete().where(Allocation.job_id == job.id))
        job.nodes, job.started_at, job.token_hash, job.handle = [], None, None, None
        if self._tried is not None:  # what this try submitted is cancelled if the attempt does not start again
            self._tried.add(job.id)
        job.reason = reason or self._waiting_reason()
        message = f"{POSTPONED}: {job.reason}"
        last = s.scalar(select(Event.message).where(Event.job_id == job.id, Event.kind.in_(("wait", "cancel")))
                        .order_by(Event.id.desc()).limit(1))
        if last != message:  # postponed again for the same reason: one event says it (after a cancel: again)
            record(s, "wait", message, job.id, quiet=quiet)

    def _tagged(self, job: Job) -> Launch:
        """The launch of a queued attempt, to find what an earlier try of it left by its tag."""
        return self.launch_of(job, {}, tuple(job.nodes or ("?",) * job.nnodes))

    def launch_of(self, job: Job, env: dict[str, str], nodes: tuple[str, ...] | None = None) -> Launch:
        """The attempt's launch; its name (the tag) and run dir are fixed by the job alone, so a
        restarted service can find what an earlier one started (``Executor.find``)."""
        spec, state = job.spec, Path(self.settings.state_dir)
        run_as = None
        if self.settings.run_jobs_as == "user":
            with self.sessions() as s:  # a user with no account: not started (it would run as the service's root)
                run_as = s.get(User, job.user).os_user or launcher.NO_ACCOUNT
        hide = self.settings.secret_dirs if self.settings.run_jobs_as == "namespace" else ()
        return Launch(job_id=job.id, name=job_tag(job), nodes=list(nodes or job.nodes), run_as=run_as, hide=hide,
                      command=[spec["command"], *spec.get("args", [])], env=env,
                      run_dir=str(state / "runs" / str(job.id)),
                      log_pattern=str(state / "logs" / job.chain_id / "rank{rank}.log"), workdir=spec.get("workdir"),
                      max_log=self.settings.max_log)

    def job_env(self, s: Session, job: Job, token: str, nodes: tuple[str, ...]) -> dict[str, str]:
        """The job's environment: the submitter's (or exactly the spec's), then luban's own variables
        (``luban.jobenv``: SDK, rendezvous, job tag) and the group's shared directories. No torchrun
        rank variables: the job's first process on each node is a launcher, not a rank."""
        first = s.get(Node, nodes[0])
        user = s.get(User, job.user)
        group = s.get(UserGroup, job.group or user.group) if (job.group or user.group) else None
        env = {**jobenv.base_environment(job.spec), **jobenv.without_own(job.spec.get("env", {})),
               "LUBAN_CLUSTER_URL": self.settings.url, "LUBAN_CLUSTER_TOKEN": token,
               "LUBAN_JOB_ID": str(job.id), "LUBAN_CHAIN_ID": job.chain_id,
               "LUBAN_RESTART_COUNT": str(job.restart_count), "LUBAN_NODES": ",".join(nodes),
               "LUBAN_WORKDIR": job.spec.get("workdir") or "",
               jobenv.NNODES: str(len(nodes)), jobenv.GPUS_PER_NODE: str(first.gpus),
               jobenv.MASTER_ADDR: first.addr, jobenv.MASTER_PORT: str(free_port())}
        if group is not None:
            env.update({k: v for k, v in (("LUBAN_GROUP", group.name), ("LUBAN_GROUP_DATA_DIR", group.data_dir),
                                          ("LUBAN_GROUP_ENV_DIR", group.env_dir)) if v})
        return env

    def sample(self, now: float) -> None:
        self.last_sample = now
        try:
            with self.sessions.begin() as s:
                # the nodes in service: up, or held by a job (drained under it, by an admin or in Slurm:
                # it runs on), so that held / nodes stays within 1
                nodes = s.scalar(select(func.count()).select_from(Node).where(
                    (Node.state == "up") | Node.name.in_(select(Allocation.node))))
                held = s.scalar(select(func.count()).select_from(Allocation))
                running = s.scalar(select(func.coalesce(func.sum(Job.nnodes), 0)).where(Job.state == states.RUNNING))
                queued = s.scalar(select(func.count()).select_from(Job).where(Job.state == states.QUEUED))
                s.merge(Sample(t=round(now, 3), nodes=nodes, held=held, running=running, queued_jobs=queued))
        except IntegrityError:
            pass  # another scheduler wrote this millisecond's sample first (merge reads, then inserts)
