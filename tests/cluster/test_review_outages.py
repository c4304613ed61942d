"""Review of the Slurm-outage changes: what a timed-out ``sbatch`` may have submitted (and nothing
could cancel) after all. A retry that adopts that copy must give the attempt the copy's token (its
SDK calls use it) and its nodes; a queued attempt stopped meanwhile must not leave it running."""

from __future__ import annotations

import hashlib

from luban.cluster.executors.slurm import SlurmExecutor
from luban.cluster.models import Job
from luban.cluster.scheduler import Scheduler, Settings
from luban.cluster import launcher
from tests.cluster.fake_slurm import job, logged, no_tracebacks, ticks


def _submitted_then_hung(fake, calls) -> None:
    """sbatch records the token it was given, then hangs past TIMEOUT_S (so does scancel: nothing
    cancels the copy); squeue lists nothing yet."""
    (fake / "hang").touch()
    sbatch = fake / "bin" / "sbatch"
    # the token is in the attempt's environment file (launcher --env-file; sbatch gets nothing of the job's)
    sbatch.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in --chdir=*) d="${{a#--chdir=}}";; esac; done\n'
                      f'j=$(cat "$d/{launcher.ENV_FILE}"); t=${{j#*\\"LUBAN_CLUSTER_TOKEN\\": \\"}}; t=${{t%%\\"*}}\n'
                      f'echo "sbatch-token $t" >> {calls}\n'
                      f'if [ -f {fake}/hang ]; then sleep 30; fi\necho 4242\n')


def _copy_listed(fake) -> None:
    """Slurm now lists the copy the timed-out sbatch submitted, running."""
    (fake / "hang").unlink()
    (fake / "bin" / "squeue").write_text(f'#!/bin/sh\necho "squeue $*" >> {fake}/calls.log\necho "4242 RUNNING"\n')


def test_an_adopted_copy_of_an_earlier_try_keeps_the_token_it_runs_with(slurm, caplog):
    scheduler, submit, fake, calls, t = slurm
    _submitted_then_hung(fake, calls)
    j = submit()
    scheduler.guarded_tick()
    assert job(scheduler, j).state == "queued"
    first = [line.split()[1] for line in calls.read_text().splitlines() if line.startswith("sbatch-token")]
    assert len(first) == 1
    _copy_listed(fake)
    t.elapse(600)
    scheduler.guarded_tick()
    adopted = job(scheduler, j)
    assert adopted.state in ("starting", "running") and '"slurm_id": "4242"' in adopted.handle
    assert calls.read_text().count("sbatch-token") == 1  # not submitted twice
    # the copy runs with the first try's token: the attempt's token must be that one (else every SDK call is 401)
    assert adopted.token_hash == hashlib.sha256(first[0].encode()).hexdigest()
    no_tracebacks(caplog)


def test_after_a_restart_a_copy_with_another_token_is_cancelled_not_adopted(slurm):
    """A restarted service does not know the earlier try's token: the copy it finds holds a token the
    attempt no longer has, so it is cancelled and waited for, then the attempt is submitted again."""
    scheduler, submit, fake, calls, t = slurm
    _submitted_then_hung(fake, calls)
    j = submit()
    scheduler.guarded_tick()
    _copy_listed(fake)
    fresh = Scheduler(scheduler.sessions, SlurmExecutor(state_dir=scheduler.settings.state_dir),
                      Settings(state_dir=scheduler.settings.state_dir), clock=scheduler.clock)
    t.elapse(600)
    fresh.guarded_tick()
    assert job(fresh, j).state == "queued" and "scancel --name=" in calls.read_text().split("squeue -h -n")[-1]
    (fake / "bin" / "squeue").write_text("#!/bin/sh\n:\n")  # the copy is gone
    t.elapse(600)
    fresh.guarded_tick()
    started = job(fresh, j)
    assert started.state in ("starting", "running") and calls.read_text().count("sbatch-token") == 2


def test_a_queued_attempt_stopped_after_its_start_met_an_outage_cancels_what_that_start_submitted(slurm):
    scheduler, submit, fake, calls, t = slurm
    _submitted_then_hung(fake, calls)
    j = submit()
    scheduler.guarded_tick()
    assert job(scheduler, j).state == "queued"
    _copy_listed(fake)
    with scheduler.sessions.begin() as s:  # `luban stop` while it waits for its retry
        s.get(Job, j).requested = 1
    t.elapse(1)
    scheduler.guarded_tick()
    assert job(scheduler, j).state == "stopped"
    assert "scancel 4242" in calls.read_text()  # the copy Slurm runs is cancelled, not left running



def test_an_outage_no_start_waits_for_any_more_does_not_linger_into_the_next_one(slurm, caplog):
    """A start met an outage and its job was stopped: with no job running, no Slurm command is ever
    asked again to end the outage. It lingered: a later outage got no ``executor unavailable`` line
    and its first retry waited the doubled backoff of the old one."""
    scheduler, submit, fake, calls, t = slurm
    (fake / "down").touch()
    j = submit()
    for _ in range(3):  # three tries: the backoff has doubled
        scheduler.guarded_tick()
        t.elapse(40)
    with scheduler.sessions.begin() as s:
        s.get(Job, j).requested = 1
    (fake / "down").unlink()
    ticks(scheduler, t, 5, 400)
    assert job(scheduler, j).state == "stopped"
    assert scheduler.executor_outage is None
    (fake / "down").touch()  # a new outage, hours later
    t.elapse(3600)
    submit()
    scheduler.guarded_tick()
    assert len(logged(caplog, "executor unavailable")) == 2
    assert scheduler.executor_outage.retry_at - scheduler.clock.now() <= 5.0  # the first backoff, not the old one's
    no_tracebacks(caplog)


def test_an_adopted_copy_is_timed_and_charged_from_when_it_began_not_from_the_retry(slurm):
    """2026-11-27: the copy a timed-out ``sbatch`` submitted ran through the outage, but the retry that
    adopted it started the attempt's clock anew: its time limit and its charge counted from the retry
    (a 5-minute limit let it run 15). Now from when its ranks began (their pgid files), no earlier
    than the attempt's first claim."""
    import os

    from luban.cluster import launcher

    scheduler, submit, fake, calls, t = slurm
    _submitted_then_hung(fake, calls)
    j = submit()
    with scheduler.sessions.begin() as s:
        s.get(Job, j).spec = {**s.get(Job, j).spec, "time_limit": 300}
    claimed_at = scheduler.clock.now()
    scheduler.guarded_tick()
    assert job(scheduler, j).state == "queued"
    run_dir = next(p.parent for p in (fake.parent / "state").rglob("job.sbatch"))
    began = claimed_at + 2
    launcher.write_atomic(launcher.pgid_file(run_dir, 0), "12345")  # the copy's rank began, 2 s after the claim
    os.utime(launcher.pgid_file(run_dir, 0), (began, began))
    _copy_listed(fake)
    t.elapse(600)
    scheduler.guarded_tick()  # the retry adopts the copy
    scheduler.guarded_tick()  # its first poll
    adopted = job(scheduler, j)
    assert adopted.started_at == began, (adopted.started_at - began)
    assert "scancel 4242" in calls.read_text()  # 600 s since it began: past its 300 s limit, killed
