"""The scheduler over a Slurm whose controller goes away or answers garbage (fake ``sbatch``,
``scontrol``, ``squeue``, ``scancel`` on PATH: no Slurm needed; the clock is injected). A start
that meets an outage waits in the queue as the same attempt and is retried with a backoff; what
Slurm says that cannot be read is one line, once, never a traceback a tick.

2026-11-28: with slurmctld down every job that tried to start failed ("launch failed: sbatch ...
Unable to contact slurm controller"); an unreadable ``ExitCode`` (ValueError) or a missing
``scontrol`` (LubanError, not the RuntimeError handled) logged "observing job N failed" with a
traceback every tick, and ``scontrol`` output without a ``JobState`` ended a running job as lost."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from luban.cluster import db, launcher, policy
from luban.cluster.executors import Launch
from luban.cluster.executors import slurm as slurm_module
from luban.cluster.executors.slurm import SlurmExecutor
from luban.cluster.models import Allocation, Event, Job, Node
from luban.cluster import scheduler as scheduler_module
from luban.cluster.scheduler import Scheduler, Settings
from luban.cluster.service import create_app
from tests.cluster.fake_slurm import count, job, logged, no_tracebacks, running_job, ticks


@pytest.mark.parametrize("outage", ["down", "hang"])
def test_a_start_during_a_slurmctld_outage_waits_in_the_queue_and_is_retried_with_a_backoff(slurm, caplog, outage):
    scheduler, submit, fake, calls, t = slurm
    (fake / outage).touch()
    started, start = [], scheduler.executor.start
    scheduler.executor.start = lambda launch: started.append(launch) or start(launch)  # the tries
    j = submit()
    scheduler.guarded_tick()
    waiting = job(scheduler, j)
    assert waiting.state == "queued", (waiting.state, waiting.reason)  # not failed: the same attempt waits
    assert "waiting for the executor" in waiting.reason
    assert ("Unable to contact slurm controller" if outage == "down" else "did not answer") in waiting.reason
    assert waiting.started_at is None and waiting.nodes == [] and waiting.token_hash is None
    assert count(scheduler, Allocation) == 0 and count(scheduler, Job) == 1
    if outage == "hang":  # what a timed-out sbatch may have submitted is cancelled
        assert "scancel --name=" in calls.read_text()
    for _ in range(40):  # 20 s of ticks at 0.5 s
        t.elapse(0.5)
        scheduler.guarded_tick()
    tries = len(started)
    assert 2 <= tries <= 4, tries  # retried, with a backoff (5 s, then 10 s): not once a tick
    with scheduler.sessions() as s:  # the history says it once, not two events per retry
        history = s.scalars(select(Event.kind).where(Event.job_id == j, Event.kind.in_(("start", "wait")))).all()
    assert history.count("start") == 1 and history.count("wait") <= 2, history
    assert count(scheduler, Job) == 1 and job(scheduler, j).state == "queued"
    assert len(logged(caplog, "executor unavailable")) == 1
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(info) < 10, info  # the retries' own lines are debug-level

    for path in fake.glob(outage):
        path.unlink()
    t.elapse(600)  # past any backoff (RETRY_MAX_S)
    scheduler.guarded_tick()
    started = job(scheduler, j)
    assert started.state in ("starting", "running") and started.handle and started.nodes
    assert count(scheduler, Job) == 1
    with scheduler.sessions() as s:  # the retry that started says so
        starts = s.scalars(select(Event.message).where(Event.job_id == j, Event.kind == "start")).all()
    assert len(starts) == 2 and "a retry of a start postponed" in starts[-1], starts
    assert len(logged(caplog, "executor available again")) == 1 and scheduler.executor_outage is None
    no_tracebacks(caplog)


def test_a_running_job_rides_out_an_outage_and_a_stop_during_it_is_done_after(slurm, caplog):
    scheduler, submit, fake, calls, t = slurm
    j = running_job(scheduler, submit)
    (fake / "down").touch()
    with scheduler.sessions.begin() as s:  # `luban stop` while slurmctld is down: scancel fails too
        s.get(Job, j).requested = 1
    ticks(scheduler, t, 10)
    assert job(scheduler, j).state == "running" and job(scheduler, j).stop_reason == 0  # asked again later
    assert len(logged(caplog, "executor unavailable")) == 1 and not logged(caplog, "available again")
    (fake / "down").unlink()
    t.elapse(1)
    scheduler.guarded_tick()
    assert job(scheduler, j).stop_reason == 1 and "scancel 4242" in calls.read_text()
    (fake / "job").write_text("JobId=4242 JobState=CANCELLED ExitCode=0:15\n")
    t.elapse(1)
    scheduler.guarded_tick()
    assert job(scheduler, j).state == "stopped"
    assert len(logged(caplog, "executor available again")) == 1
    no_tracebacks(caplog)


def test_a_start_slurm_refuses_still_fails_the_attempt(slurm, caplog):
    """Not an outage: sbatch's own refusal of the job ends the attempt at once, in one line."""
    scheduler, submit, fake, calls, t = slurm
    (fake / "bin" / "sbatch").write_text('#!/bin/sh\necho "sbatch: error: Batch job submission failed: '
                                         'Invalid account or account/partition combination specified" >&2\nexit 1\n')
    j = submit()
    scheduler.guarded_tick()
    failed = job(scheduler, j)
    assert failed.state == "failed" and "Invalid account" in failed.reason and "\n" not in failed.reason
    assert getattr(scheduler, "executor_outage", None) is None and not logged(caplog, "executor unavailable")
    no_tracebacks(caplog)


@pytest.mark.parametrize("earlier", ["submitted", "cancelled", "ran"])
def test_the_retry_of_a_start_adopts_or_waits_for_what_an_earlier_try_left(tmp_path, monkeypatch, earlier):
    """A timed-out sbatch may have submitted the attempt. Its next try adopts that copy when nothing
    cancelled it (running, or ended with all exit files): the attempt runs once; a copy that was
    cancelled is waited for while Slurm lists it, then its exit files are cleared and it is
    submitted again."""
    from tests.cluster.test_executor_faults import fake_slurm

    listed = tmp_path / "listed"
    listed.write_text("76 COMPLETING\n" if earlier == "cancelled" else "76 RUNNING\n")
    calls = fake_slurm(tmp_path, monkeypatch, sbatch="echo 77", scancel="exit 0",
                       squeue=f'if [ -f {listed} ]; then cat {listed}; fi')
    run_dir = tmp_path / "runs" / "7"
    run_dir.mkdir(parents=True)
    (run_dir / "job.sbatch").write_text("# the earlier try\n")
    if earlier == "cancelled":
        (run_dir / slurm_module.CANCELLED).touch()
    if earlier != "submitted":
        launcher.write_atomic(launcher.exit_file(run_dir, 0), "137" if earlier == "cancelled" else "0")
    if earlier == "ran":
        listed.unlink()
    launch = Launch(job_id=7, name="luban-7-c", nodes=["node1"], command=["true"], env=dict(os.environ),
                    run_dir=str(run_dir), log_pattern=str(tmp_path / "rank{rank}.log"))
    executor = SlurmExecutor(state_dir=str(tmp_path))
    if earlier == "cancelled":
        with pytest.raises(RuntimeError, match="still ending"):  # executors.Unavailable: the start waits
            executor.start(launch)
        listed.unlink()
        handle = executor.start(launch)
        assert '"slurm_id": "77"' in handle and not launcher.exit_file(run_dir, 0).exists()
        assert not (run_dir / slurm_module.CANCELLED).exists()
    else:
        handle = executor.start(launch)
        assert json.loads(handle)["slurm_id"] == ("76" if earlier == "submitted" else "")
        assert "sbatch" not in calls.read_text()  # not submitted twice
        if earlier == "ran":
            assert executor.poll(handle).done and executor.poll(handle).exit_code == 0


def test_an_unreadable_exit_code_ends_the_attempt_once_in_one_line(slurm, caplog):
    scheduler, submit, fake, calls, t = slurm
    j = running_job(scheduler, submit)
    (fake / "job").write_text("JobId=4242 JobName=x JobState=FAILED ExitCode=garbage\n")
    ticks(scheduler, t, 5)
    ended = job(scheduler, j)
    assert ended.state == "failed" and ended.exit_code is None and _lost(ended)
    assert "unreadable ExitCode='garbage'" in ended.reason, ended.reason
    assert count(scheduler, Allocation) == 0
    assert len(logged(caplog, "unreadable ExitCode")) == 1, logged(caplog, "unreadable ExitCode")
    no_tracebacks(caplog)


def _lost(j: Job) -> bool:
    from luban.cluster.models import StopReason

    return bool(j.stop_reason & StopReason.LOST)


def test_a_state_that_cannot_be_read_leaves_the_job_running_and_is_said_once(slurm, caplog):
    scheduler, submit, fake, calls, t = slurm
    j = running_job(scheduler, submit)
    (fake / "job").write_text("slurm_load_jobs: something else entirely\n")
    ticks(scheduler, t, 10)
    assert job(scheduler, j).state == "running" and count(scheduler, Job) == 1
    said = logged(caplog, "could not tell its state")
    assert len(said) == 1 and "printed no JobState" in said[0]
    no_tracebacks(caplog)
    (fake / "job").unlink()
    t.elapse(1)
    scheduler.guarded_tick()
    assert len(logged(caplog, "can tell its state again")) == 1
    (fake / "job").write_text("JobId=4242 JobState=COMPLETED ExitCode=0:0\n")  # launchers wrote no exit files
    t.elapse(1)
    scheduler.guarded_tick()
    assert job(scheduler, j).state == "succeeded"
    no_tracebacks(caplog)


@pytest.mark.parametrize("command", ["sbatch", "scontrol"])
def test_a_slurm_command_that_goes_missing_is_an_outage_not_a_verdict(slurm, caplog, command):
    """2026-11-27: a ``sbatch`` gone from PATH (slurm-wlm being upgraded, a PATH or a mount that
    changed) failed every job whose start met it ("launch failed: sbatch not found"), a queue of
    hundreds in one tick; a missing ``scontrol`` was a problem per job. Now both are an outage: a
    start waits in the queue as the same attempt, a running job runs on, one line each way."""
    scheduler, submit, fake, calls, t = slurm
    running = running_job(scheduler, submit)
    tool = fake / "bin" / command
    saved = tool.read_text()
    tool.unlink()
    queued = submit() if command == "sbatch" else None
    ticks(scheduler, t, 8)
    assert job(scheduler, running).state == "running"
    if queued is not None:
        waiting = job(scheduler, queued)
        assert waiting.state == "queued" and waiting.restart_count == 0, (waiting.state, waiting.reason)
        assert "sbatch not found" in waiting.reason and "scancel" not in calls.read_text()
    said = logged(caplog, "executor unavailable")
    assert len(said) == 1 and f"{command} not found" in said[0], said
    tool.write_text(saved)
    tool.chmod(0o755)
    t.elapse(scheduler_module.RETRY_MAX_S)
    scheduler.guarded_tick()
    scheduler.guarded_tick()
    if queued is not None:
        assert job(scheduler, queued).state == "running"
    assert len(logged(caplog, "executor available again")) == 1
    assert count(scheduler, Job) == (2 if queued else 1) and not logged(caplog, "launch failed")
    no_tracebacks(caplog)


def test_suspends_that_make_room_for_starts_wait_while_starts_meet_an_outage(slurm, caplog):
    """2026-11-27: with ``sbatch`` failing but ``scancel`` answering (a partial outage), the policy
    went on suspending running jobs — preemption, each time-share quantum — for starts that were then
    postponed: one job at a time the cluster drained to idle nodes. Now a suspend that makes room
    for a start is held while starts meet the outage (the job runs on); one off a node an admin took
    down is not; the jobs that wait say what they wait for."""
    scheduler, submit, fake, calls, t = slurm
    running = running_job(scheduler, submit)
    (fake / "sbatch-down").touch()
    queued = submit()
    scheduler.guarded_tick()  # its start meets the outage
    assert job(scheduler, queued).state == "queued" and scheduler.executor_outage.starts
    now = scheduler.clock.now()
    scheduler.apply(policy.Plan(suspends=[(running, "preempted: for a start", False)],
                                waits={queued: "admitted; waiting for 1 node(s) being released"},
                                admitted={running, queued}), now)
    assert job(scheduler, running).state == "running" and "--signal=USR1" not in calls.read_text()
    assert "waiting for the executor to answer" in job(scheduler, queued).reason
    scheduler.apply(policy.Plan(suspends=[(running, "node node1 taken down by an admin", False)],
                                off_down_nodes={running}), now)
    assert job(scheduler, running).state == "suspending" and "--signal=USR1" in calls.read_text()
    no_tracebacks(caplog)


def test_a_service_started_while_slurmctld_is_down_gets_its_nodes_when_it_answers(slurm, caplog):
    """2026-11-27: ``cluster serve --executor slurm`` with slurmctld down (or ``scontrol`` missing)
    died at start-up with uvicorn's traceback, and nodes were read only then: a node added to Slurm
    later was never scheduled. Now the service starts, says so once, reads the nodes when slurmctld
    answers, and again every ``NODE_SYNC_S``."""
    scheduler, submit, fake, calls, t = slurm
    engine = db.open_checked(str(fake / "other.db"))
    fresh = Scheduler(db.sessions(engine), SlurmExecutor(state_dir=str(fake)), Settings(state_dir=str(fake)),
                      clock=t.clock())
    (fake / "down").touch()
    with TestClient(create_app(fresh.sessions, fresh, run_scheduler=False)) as http:  # the lifespan runs
        assert http.get("/api/whoami").status_code == 401  # it serves (no token given)
    assert count(fresh, Node) == 0
    assert len(logged(caplog, "executor unavailable")) == 1
    (fake / "down").unlink()
    t.elapse(scheduler_module.RETRY_MIN_S)
    fresh.guarded_tick()
    assert count(fresh, Node) == 2
    assert len(logged(caplog, "executor available again")) == 1
    (fake / "nodes").write_text("NodeName=node3 Partitions=debug AvailableFeatures=zone2\n")
    t.elapse(scheduler_module.NODE_SYNC_S - 1)
    fresh.guarded_tick()
    assert count(fresh, Node) == 2  # not yet: one reading every NODE_SYNC_S
    t.elapse(1)
    fresh.guarded_tick()
    assert count(fresh, Node) == 3
    no_tracebacks(caplog)
    engine.dispose()


def test_slurms_own_words_for_an_unreachable_controller_are_an_outage(tmp_path, monkeypatch):
    """The real client commands (no controller needed: a slurm.conf naming a port nothing listens on)."""
    from luban.cluster.executors import Unavailable
    from tests.cluster.conftest import require

    require(bool(shutil.which("sbatch")) and Path("/etc/slurm/slurm.conf").exists(), "Slurm's client commands")
    conf = tmp_path / "slurm.conf"
    conf.write_text("".join(line if not line.startswith("SlurmctldPort=") else "SlurmctldPort=9\n"
                            for line in Path("/etc/slurm/slurm.conf").read_text().splitlines(keepends=True)))
    monkeypatch.setenv("SLURM_CONF", str(conf))  # the service's (sbatch never gets the job's environment)
    launch = Launch(job_id=8, name="luban-8-cdown", nodes=["node1"], command=["true"], env=dict(os.environ),
                    run_dir=str(tmp_path / "runs" / "8"), log_pattern=str(tmp_path / "rank{rank}.log"))
    with pytest.raises(Unavailable, match="Unable to contact slurm controller"):
        SlurmExecutor(state_dir=str(tmp_path)).start(launch)


def test_a_hung_controller_costs_one_poll_a_tick_not_one_per_job(slurm, caplog):
    """Each ``scontrol`` waits ``TIMEOUT_S`` for a hung slurmctld: with N running jobs a tick took N
    timeouts (N minutes). After the first poll that meets the outage the others wait for the next tick."""
    scheduler, submit, fake, calls, t = slurm
    jobs = [submit(), submit()]
    scheduler.guarded_tick()
    scheduler.guarded_tick()
    assert [job(scheduler, j).state for j in jobs] == ["running", "running"]
    (fake / "down").touch()
    polls = calls.read_text().count("scontrol show job")
    t.elapse(1)
    scheduler.guarded_tick()
    assert calls.read_text().count("scontrol show job") - polls == 1, calls.read_text()
    assert [job(scheduler, j).state for j in jobs] == ["running", "running"]
    (fake / "down").unlink()
    t.elapse(1)
    scheduler.guarded_tick()
    assert calls.read_text().count("scontrol show job") - polls == 3  # both polled again
    no_tracebacks(caplog)


def test_a_retry_that_slurm_then_refuses_has_its_start_in_the_jobs_history(slurm, caplog):
    """A retry of a postponed start writes its "start" event once it has started (not one per retry);
    one that sbatch then refused ended with no start event for it (its nodes were in no event)."""
    scheduler, submit, fake, calls, t = slurm
    (fake / "down").touch()
    j = submit()
    scheduler.guarded_tick()
    assert job(scheduler, j).state == "queued"
    (fake / "down").unlink()
    (fake / "bin" / "sbatch").write_text('#!/bin/sh\necho "sbatch: error: Batch job submission failed: '
                                         'Invalid account or account/partition combination specified" >&2\nexit 1\n')
    t.elapse(600)
    scheduler.guarded_tick()
    assert job(scheduler, j).state == "failed"
    with scheduler.sessions() as s:
        history = s.scalars(select(Event.kind).where(Event.job_id == j).order_by(Event.id)).all()
        starts = s.scalars(select(Event.message).where(Event.job_id == j, Event.kind == "start")).all()
    assert history[-2] == "start" and history.count("start") == 2, history  # the retry's start, then its end
    assert len(starts) == 2 and "a retry of a start postponed" in starts[-1] and "node" in starts[-1], starts
    assert not scheduler._retry_tokens
    no_tracebacks(caplog)
