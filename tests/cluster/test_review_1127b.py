"""A second hostile review (2026-11-27) of StartDeferred and ``gone`` nodes. Each test failed when the
review wrote it; the docstring says what was wrong."""

from __future__ import annotations

from sqlalchemy import select

from luban.cluster import scheduler as scheduler_module
from luban.cluster.models import Event, Node
from tests.cluster.conftest import api_client
from tests.cluster.fake_slurm import job, ticks


def _http(scheduler):
    """(client, admin headers, alice's headers) over the fixture's database."""
    http, admin = api_client(scheduler)
    token = http.post("/api/users", json={"name": "bob"}, headers=admin).json()["token"]
    return http, admin, {"Authorization": f"Bearer {token}"}


def _gone(scheduler, fake, t, *names):
    kept = [n for n in ("node1", "node2") if n not in names]
    (fake / "nodes").write_text("".join(f"NodeName={n} Partitions=debug AvailableFeatures=zone1\n" for n in kept))
    t.elapse(scheduler_module.NODE_SYNC_S + 1)
    scheduler.guarded_tick()


def test_an_admin_cannot_set_a_gone_node_up(slurm):
    """PATCH /api/nodes/NAME {"state": "up"} on a node Slurm no longer reports was accepted: the node
    was scheduled again until the next reading (NODE_SYNC_S later), and each start placed on it failed
    its attempt ("launch failed": sbatch --nodelist names a node Slurm does not have). Now a 409: it is up
    again by itself once the executor reports it."""
    scheduler, submit, fake, calls, t = slurm
    _gone(scheduler, fake, t, "node2")
    http, admin, _ = _http(scheduler)
    r = http.patch("/api/nodes/node2", json={"state": "up"}, headers=admin)
    with scheduler.sessions() as s:
        state = s.get(Node, "node2").state
    assert r.status_code == 409 and state == scheduler_module.GONE, (r.status_code, r.text, state)
    assert "is gone" in r.json()["detail"]


def test_a_job_waiting_on_gone_nodes_says_gone_not_drained(slurm):
    """Every node of the group gone: the submission is accepted (the group's size counts gone nodes) and
    the job waits with a reason that says the nodes are *drained* ("until they return"), which sends the
    user to an admin for a drain no admin made. Now the reason names gone nodes apart from drained ones."""
    scheduler, submit, fake, calls, t = slurm
    (fake / "nodes").write_text("NodeName=node1 Partitions=debug AvailableFeatures=zone1\n")
    t.elapse(scheduler_module.NODE_SYNC_S + 1)
    scheduler.guarded_tick()
    submit()  # one node: node1 free, it starts. The next one: node2 is gone
    k = submit()
    ticks(scheduler, t, 3)
    reason = job(scheduler, k).reason or ""
    assert job(scheduler, k).state == "queued", reason
    assert "gone" in reason, reason


def test_a_deferred_start_does_not_preempt_a_running_job_every_backoff(slurm):
    """A HIGH job whose earlier try's copy Slurm lists as COMPLETING for hours is out of the policy's view
    only during its backoff: each time it comes back, the policy admits it and preempts the NORMAL job
    running on its nodes, then its start is deferred again and the preempted job restarts: one
    preemption every backoff (<= RETRY_MAX_S) for as long as the copy is stuck. (Before StartDeferred,
    suspends for starts were held while starts met the 'outage'.) Now it comes back into view only once
    its copy is no longer listed (``Executor.lingering``)."""
    scheduler, submit, fake, calls, t = slurm
    http, admin, bob = _http(scheduler)
    for owner, prio in (("user:bob", "HIGH"), ("user:alice", "NORMAL")):
        assert http.put("/api/quota", json={"owner": owner, "priority": prio, "nodes": 2, "node_group": "debug"},
                        headers=admin).status_code == 200
    sbatch = fake / "bin" / "sbatch"
    sbatch.write_text(f'#!/bin/sh\necho "sbatch $*" >> {calls}\nif [ -f {fake}/sbatch-hang ]; then sleep 30; fi\n'
                      f'echo "JobId=4242 JobState=RUNNING ExitCode=0:0" > {fake}/job\necho 4242\n')  # a new copy runs
    # a suspend's USR1 makes the job checkpoint and exit 75 (scontrol then reads it ended so)
    (fake / "bin" / "scancel").write_text(f'#!/bin/sh\necho "scancel $*" >> {calls}\ncase "$*" in *USR1*) '
                                          f'echo "JobId=4242 JobState=COMPLETED ExitCode=75:0" > {fake}/job;; esac\n')
    (fake / "sbatch-hang").touch()
    r = http.post("/api/jobs", json={"spec": {"name": "hi", "command": "true", "priority": "HIGH", "nodes": 2}},
                  headers=bob)
    assert r.status_code == 201, r.text
    stuck = r.json()["id"]
    scheduler.guarded_tick()
    assert job(scheduler, stuck).state == "queued"
    (fake / "sbatch-hang").unlink()
    (fake / "bin" / "squeue").write_text('#!/bin/sh\necho "4242 COMPLETING"\n')  # stuck in CG
    low = submit()
    ticks(scheduler, t, 40, scheduler_module.RETRY_MAX_S / 4)
    with scheduler.sessions() as s:
        suspends = s.scalars(select(Event.message).where(Event.kind == "suspend")).all()
    assert job(scheduler, stuck).state == "queued"
    assert len(suspends) <= 1, (len(suspends), suspends[:3], job(scheduler, low).state)
