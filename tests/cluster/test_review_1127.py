"""A hostile review (2026-11-27) of the day's Slurm changes: a Slurm command gone from PATH is an
outage, nodes are read again every NODE_SYNC_S, suspends for starts are held while starts meet an
outage, an adopted copy is timed from its ranks' pgid files. Each test failed when the review wrote it."""

from __future__ import annotations

import os

from luban.cluster import launcher
from luban.cluster import scheduler as scheduler_module
from luban.cluster.models import Job, Node
from tests.cluster.test_review_outages import _copy_listed, _submitted_then_hung
from tests.cluster.fake_slurm import DOWN, job, logged, running_job, ticks


def _set_spec(scheduler, job_id: int, **changes) -> None:
    with scheduler.sessions.begin() as s:
        j = s.get(Job, job_id)
        j.spec = {**j.spec, **changes}


def test_a_job_whose_own_path_lacks_sbatch_does_not_stall_every_start_in_the_cluster(slurm):
    """``sbatch`` ran with the job's environment, and ``subprocess`` looked it up on the job's
    PATH: a spec with its own PATH (a conda env, ``env_only``) made sbatch "not found", taken for an
    executor-wide outage: that start retried forever and every other start (and every suspend for a
    start) waited behind it. Now each Slurm command (and the batch script's ``srun``) is found on the
    service's PATH."""
    scheduler, submit, fake, calls, t = slurm
    own_path = submit()
    _set_spec(scheduler, own_path, env={"PATH": "/opt/conda/envs/train/bin"})
    other = submit()
    for _ in range(12):
        scheduler.guarded_tick()
        t.elapse(scheduler_module.RETRY_MAX_S)
    assert job(scheduler, other).state in ("starting", "running"), job(scheduler, other).reason
    assert job(scheduler, own_path).state not in ("queued",), job(scheduler, own_path).reason
    assert scheduler.executor_outage is None


def test_an_adopted_copys_start_time_survives_a_kill_that_meets_an_outage(slurm):
    """The start time of an adopted copy was moved back inside the poll's transaction and its
    entry dropped at once: when that poll's kill (its time limit, now past) met an outage, the
    transaction rolled back and the copy was timed from the retry for good. Now it is set in its own
    transaction (``Scheduler._time_adopted``), forgotten only once committed."""
    scheduler, submit, fake, calls, t = slurm
    _submitted_then_hung(fake, calls)
    j = submit()
    _set_spec(scheduler, j, time_limit=300)
    claimed_at = scheduler.clock.now()
    scheduler.guarded_tick()
    assert job(scheduler, j).state == "queued"
    run_dir = next(p.parent for p in (fake.parent / "state").rglob("job.sbatch"))
    began = claimed_at + 2
    launcher.write_atomic(launcher.pgid_file(run_dir, 0), "12345")
    os.utime(launcher.pgid_file(run_dir, 0), (began, began))
    _copy_listed(fake)
    t.elapse(600)
    scheduler.guarded_tick()  # the retry adopts the copy
    scancel = fake / "bin" / "scancel"
    saved = scancel.read_text()
    scancel.write_text(f'#!/bin/sh\necho "scancel $*" >> {calls}\n{DOWN}\n')  # slurmctld flaky for scancel
    t.elapse(1)
    scheduler.guarded_tick()  # first poll: past its limit from `began`; the kill meets the outage
    scancel.write_text(saved)
    t.elapse(1)
    scheduler.guarded_tick()
    adopted = job(scheduler, j)
    assert adopted.started_at == began, adopted.started_at - began
    assert calls.read_text().count("scancel 4242") >= 2  # killed once scancel answers


def test_polling_a_running_job_does_not_stat_every_ranks_pgid_file(slurm, monkeypatch):
    """Every poll of every running job read its ranks' pgid files (one stat per node on the
    shared state directory, each tick) for a start time only an adopted copy uses. Now
    ``Executor.began`` is asked only for attempts a retry started."""
    scheduler, submit, fake, calls, t = slurm
    running_job(scheduler, submit)
    asked = []
    real = launcher.started_at
    monkeypatch.setattr(launcher, "started_at", lambda *a: asked.append(a) or real(*a))
    ticks(scheduler, t, 5)
    assert asked == [], f"{len(asked)} reads of pgid files for a job no retry adopted"


def test_a_node_gone_from_slurm_is_not_scheduled_after_the_periodic_sync(slurm):
    """A node removed from Slurm stayed ``up``: attempts placed on it failed ("launch failed"). Now a
    node the executor no longer reports is ``gone`` (kept, not scheduled) and ``up`` again when it is
    reported again."""
    scheduler, submit, fake, calls, t = slurm
    (fake / "nodes").write_text("NodeName=node1 Partitions=debug AvailableFeatures=zone1\n")  # node2 removed
    t.elapse(scheduler_module.NODE_SYNC_S + 1)
    scheduler.guarded_tick()
    with scheduler.sessions() as s:
        node2 = s.get(Node, "node2")
        assert node2 is None or node2.state != "up", node2.state


def test_a_start_waiting_for_its_own_earlier_copy_to_end_does_not_hold_every_other_start(slurm):
    """A start whose earlier try's copy Slurm still lists as ending (stuck in COMPLETING for hours)
    raised ``Unavailable``: taken for an executor-wide outage, every other start waited behind it, and
    every suspend for a start was held. Now it is ``StartDeferred``: that attempt alone waits, out of
    the policy's view, with its own backoff."""
    scheduler, submit, fake, calls, t = slurm
    sbatch = fake / "bin" / "sbatch"
    sbatch.write_text(f'#!/bin/sh\necho "sbatch $*" >> {calls}\nif [ -f {fake}/sbatch-hang ]; then sleep 30; fi\n'
                      'echo 4242\n')
    (fake / "sbatch-hang").touch()
    stuck = submit()
    scheduler.guarded_tick()  # sbatch times out; scancel --name is taken; the copy is cancelled
    assert job(scheduler, stuck).state == "queued"
    (fake / "sbatch-hang").unlink()
    (fake / "bin" / "squeue").write_text('#!/bin/sh\necho "4242 COMPLETING"\n')  # stuck in CG
    other = submit()
    ticks(scheduler, t, 10, scheduler_module.RETRY_MAX_S)
    assert job(scheduler, stuck).state == "queued"  # rightly: its copy has not ended
    assert job(scheduler, other).state in ("starting", "running"), job(scheduler, other).reason


def test_a_gone_node_comes_back_up_and_an_empty_answer_marks_nothing_gone(slurm):
    scheduler, submit, fake, calls, t = slurm
    (fake / "nodes").write_text("NodeName=node1 Partitions=debug AvailableFeatures=zone1\n")
    t.elapse(scheduler_module.NODE_SYNC_S + 1)
    scheduler.guarded_tick()
    (fake / "nodes").write_text("")  # scontrol printed no node at all: a glitch, not a cluster removed
    t.elapse(scheduler_module.NODE_SYNC_S + 1)
    scheduler.guarded_tick()
    with scheduler.sessions() as s:
        assert (s.get(Node, "node1").state, s.get(Node, "node2").state) == ("up", scheduler_module.GONE)
    (fake / "nodes").unlink()  # both reported again
    t.elapse(scheduler_module.NODE_SYNC_S + 1)
    scheduler.guarded_tick()
    with scheduler.sessions() as s:
        assert s.get(Node, "node2").state == "up"


def test_node_readings_that_fail_back_off_and_are_said_once(slurm, caplog):
    """A hung slurmctld with no job to poll: each tick spent scontrol's whole timeout reading the nodes
    again (the retry was counted from the start of the tick), and unreadable output was a warning
    every NODE_SYNC_S. Now the readings back off from when the failure was known, and a problem is
    one line until the nodes can be read again."""
    scheduler, submit, fake, calls, t = slurm
    (fake / "nodes").write_text("garbage\n")
    scontrol = fake / "bin" / "scontrol"
    body = scontrol.read_text()
    scontrol.write_text(body.replace('cat "$D/nodes"', 'cat "$D/nodes"; exit 1'))
    ticks(scheduler, t, 30, scheduler_module.NODE_SYNC_S)
    assert len(logged(caplog, "nodes could not be read")) == 1
    scontrol.write_text(body)
    (fake / "nodes").unlink()
    t.elapse(scheduler_module.NODE_SYNC_S)
    scheduler.guarded_tick()
    assert len(logged(caplog, "nodes can be read again")) == 1
    asked = calls.read_text().count("scontrol show node")
    (fake / "hang").touch()  # slurmctld hangs: each reading takes TIMEOUT_S (1 s here, a real second)
    ticks(scheduler, t, 6)
    assert calls.read_text().count("scontrol show node") - asked <= 3, "a reading every tick"
