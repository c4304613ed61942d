"""A node Slurm drains, takes down or stops hearing from is not scheduled by luban until Slurm runs
jobs there again; what runs there runs on (fake ``scontrol`` and the real daemons).

2026-12-02: ``SlurmExecutor.discover`` ignored the node's ``State``: a node drained in Slurm stayed
``up`` in luban, which placed attempts on it that Slurm never started (``sbatch --nodelist`` pending
on ``ReqNodeNotAvail``), and ``luban nodes`` said nothing of it."""

from __future__ import annotations

import argparse
import shutil
import subprocess

import pytest

from luban.cluster import cli, db
from luban.cluster.client import Client
from luban.cluster import scheduler as scheduler_module
from luban.cluster.executors.slurm import SlurmExecutor, node_reason, node_unavailable
from luban.cluster.models import Event
from luban.cluster.scheduler import UNAVAILABLE
from tests.cluster.conftest import api_client, kill_jobs, migrate, require, wait_for
from tests.cluster.fake_slurm import job, no_tracebacks, running_job, ticks
from tests.cluster.test_dashboard import browser  # noqa: F401 - a fixture


@pytest.mark.parametrize("state, why", [
    ("IDLE", None),
    ("IDLE+DRAIN", "slurm: drained"),
    ("MIXED+DRAIN", "slurm: draining"),  # a job runs there: it runs on, no new one starts
    ("ALLOCATED+DRAIN+COMPLETING", "slurm: draining"),
    ("DOWN*", "slurm: down, not responding"),  # the suffix of older scontrol and of sinfo
    ("DOWN+NOT_RESPONDING", "slurm: down, not responding"),
    ("IDLE+NOT_RESPONDING", "slurm: not responding"),
    ("ALLOCATED+COMPLETING", None),
    ("IDLE+POWERED_DOWN", None),  # power saving: Slurm powers it up for the job it allocates there
    ("IDLE+CLOUD+POWERED_DOWN", None),
    ("IDLE+POWERING_DOWN", "slurm: powering down"),
    ("IDLE+POWER_DOWN", "slurm: pending power down"),
    ("IDLE+POWERED_DOWN+DRAIN", "slurm: drained"),
    ("IDLE+FAIL", "slurm: failing"),
    ("FUTURE", "slurm: future (not configured yet)"),
    ("UNKNOWN", "slurm: unknown (not registered yet)"),
    ("IDLE+MAINTENANCE", "slurm: in a maintenance reservation"),
    ("IDLE+RESERVED", "slurm: in an advanced reservation"),
    ("IDLE+INVALID_REG", "slurm: invalid registration"),
    ("IDLE+REBOOT_ISSUED", "slurm: rebooting"),
    ("MIXED+REBOOT_REQUESTED", None),  # rebooted once idle; jobs start meanwhile (ASAP adds DRAIN)
    ("IDLE~", None), ("IDLE%", "slurm: powering down"), ("IDLE$", "slurm: in a maintenance reservation"),
    ("IDLE+DYNAMIC_NORM", None),  # a flag luban does not know: usable
    ("", None),  # no State (an older fake or a trimmed answer): as before
])
def test_a_node_state_reads_as_whether_slurm_starts_new_jobs_there(state, why):
    assert node_unavailable(state) == why
    if why:
        assert node_unavailable(state, " disk  swap ") == f"{why} (disk swap)"


def test_the_reason_is_read_whole_from_a_one_line_node():
    line = ("NodeName=node2 Arch=x86_64 State=IDLE+DRAIN ThreadsPerCore=1 Partitions=debug "
            "CapWatts=n/a ExtSensorsTemp=n/s Reason=disk swap, ticket 42 [root@2026-12-02T01:03:36]")
    assert node_reason(line) == "disk swap, ticket 42 [root@2026-12-02T01:03:36]"
    assert node_reason("NodeName=node2 State=IDLE Reason=a b Comment=c") == "a b"
    assert node_reason("NodeName=node2 State=IDLE") == ""


def _nodes(fake, **extra: str) -> None:
    """The fake scontrol's node1 and node2, with ``State=... Reason=...`` text per node."""
    (fake / "nodes").write_text("".join(f"NodeName={n} Partitions=debug AvailableFeatures=zone1 {extra.get(n, '')}\n"
                                        for n in ("node1", "node2")))


def _read_nodes(scheduler, t) -> None:
    t.elapse(scheduler_module.NODE_SYNC_S + 1)
    scheduler.guarded_tick()


def _sbatches(calls) -> list[str]:
    return [line for line in calls.read_text().splitlines() if line.startswith("sbatch ")]


def test_luban_follows_a_drain_in_slurm_and_an_admin_drain_stays_its_own(slurm, caplog, monkeypatch, capsys):
    scheduler, submit, fake, calls, t = slurm
    http, admin = api_client(scheduler)
    first = running_job(scheduler, submit)
    on = job(scheduler, first).nodes[0]
    other = "node2" if on == "node1" else "node1"
    _nodes(fake, **{on: "State=MIXED+DRAIN Reason=bad fan [root@2026-12-02T01:00:00]",
                    other: "State=IDLE+DRAIN Reason=disk swap [root@2026-12-02T01:00:00]"})
    _read_nodes(scheduler, t)
    nodes = {n["name"]: n for n in http.get("/api/nodes", headers=admin).json()}
    assert nodes[on]["state"] == nodes[other]["state"] == UNAVAILABLE, nodes
    assert nodes[on]["why"] == "slurm: draining (bad fan [root@2026-12-02T01:00:00])"
    assert nodes[other]["why"] == "slurm: drained (disk swap [root@2026-12-02T01:00:00])"
    second = submit()
    ticks(scheduler, t, 3)
    assert job(scheduler, first).state == "running"  # DRAINING: the job there runs on
    assert job(scheduler, second).state == "queued" and "drained" in job(scheduler, second).reason
    assert len(_sbatches(calls)) == 1  # nothing placed on a drained node

    client = Client("http://testserver", "unused")  # `luban nodes` and `luban admin node up` on this app
    client.http = http
    http.headers.update(admin)
    monkeypatch.setattr(cli, "_client", lambda args: client)
    cli.cmd_nodes(argparse.Namespace())
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[-1] == "WHY" and any(line.startswith(other) and line.endswith(
        "slurm: drained (disk swap [root@2026-12-02T01:00:00])") for line in table), table

    # an admin's "up" cannot lift Slurm's drain; an admin's own drain outlasts Slurm's
    cli.cmd_admin(argparse.Namespace(what="node", action="up", name=other))
    assert capsys.readouterr().out == (f"node {other}: unavailable (slurm: drained (disk swap "
                                       "[root@2026-12-02T01:00:00]))\n")
    r = http.patch(f"/api/nodes/{other}", json={"state": "up"}, headers=admin)
    assert r.status_code == 200 and r.json()["state"] == UNAVAILABLE and "disk swap" in r.json()["why"], r.text
    assert http.patch(f"/api/nodes/{other}", json={"state": "drain"}, headers=admin).json()["state"] == "drain"
    _nodes(fake)  # resumed in Slurm (scontrol update state=resume)
    _read_nodes(scheduler, t)
    nodes = {n["name"]: n for n in http.get("/api/nodes", headers=admin).json()}
    assert (nodes[on]["state"], nodes[on]["why"]) == ("up", None)
    assert (nodes[other]["state"], nodes[other]["why"]) == ("drain", None)  # the admin's drain stays
    assert job(scheduler, second).state == "queued"
    assert http.patch(f"/api/nodes/{other}", json={"state": "up"}, headers=admin).json()["state"] == "up"
    ticks(scheduler, t, 2)
    assert job(scheduler, second).state in ("starting", "running") and job(scheduler, second).nodes == [other]
    with scheduler.sessions() as s:
        said = [e.message for e in s.query(Event).filter(Event.kind == "node").order_by(Event.id)]
    assert f"{other} takes no new job: slurm: drained (disk swap [root@2026-12-02T01:00:00])" in said
    assert any(m.startswith(f"{on}: the executor starts jobs there again (was: slurm: draining") for m in said), said
    no_tracebacks(caplog)


def test_a_node_slurm_does_not_hear_from_waits_until_it_answers_and_then_runs_jobs(slurm, caplog):
    scheduler, submit, fake, calls, t = slurm
    down = "State=DOWN+NOT_RESPONDING Reason=Not responding [slurm@2026-12-02T01:00:00]"
    _nodes(fake, node1=down, node2="State=IDLE+NOT_RESPONDING")
    _read_nodes(scheduler, t)
    waiting = submit()
    ticks(scheduler, t, 2)
    assert job(scheduler, waiting).state == "queued" and not _sbatches(calls)
    _nodes(fake, node1=down, node2="State=IDLE")  # node2's slurmd registered again
    _read_nodes(scheduler, t)
    assert job(scheduler, waiting).state in ("starting", "running") and job(scheduler, waiting).nodes == ["node2"]
    no_tracebacks(caplog)


# -- the real daemons (.ci/services.sh: node1..node4) ---------------------------------------------
def _scontrol(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)


def _slurm_state(node: str) -> str:
    out = _scontrol("show", "node", "-o", node).stdout
    return next((t.split("=", 1)[1] for t in out.split() if t.startswith("State=")), "")


def _resume(node: str) -> None:
    """``state=resume`` (an error where the node is not drained: nothing to undo), then until Slurm
    has the node back (a resumed node reads NOT_RESPONDING until its slurmd registers again)."""
    _scontrol("update", f"nodename={node}", "state=resume")
    wait_for(lambda: node_unavailable(_slurm_state(node)) is None, 120, 0.5, f"{node} back in Slurm")


@pytest.fixture
def real_slurm(tmp_path, in_process):
    """The scheduler and the API in this process over the real Slurm (SQLite): ticks are the test's."""
    require(bool(shutil.which("scontrol")) and bool(_slurm_state("node2")), "a Slurm cluster (node1..node4)")
    wait_for(lambda: all(node_unavailable(_slurm_state(f"node{i}")) is None for i in range(1, 5)), 60, 1,
             "node1..node4 usable in Slurm")
    state = tmp_path / "state"
    api = in_process(executor=SlurmExecutor(state_dir=str(state)), state=state)
    scheduler, http, admin = api.scheduler, api.http, api.admin
    group = http.get("/api/nodes", headers=admin).json()[0]["node_group"]
    token = api.user("alice", 4, node_group=group)
    try:
        yield scheduler, http, admin, {"Authorization": f"Bearer {token}"}
    finally:
        for line in subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True,
                                   timeout=60).stdout.splitlines():
            slurm_id, name = line.split()[:2]
            if name.startswith("luban-") and str(state) in _scontrol("show", "job", "-o", slurm_id).stdout:
                subprocess.run(["scancel", slurm_id], timeout=60)
        kill_jobs(state)


def _tick_until(scheduler, http, headers, job_id: int, states: tuple[str, ...], what: str) -> dict:
    def seen():
        scheduler.guarded_tick()
        answer = http.get(f"/api/jobs/{job_id}", headers=headers).json()
        return answer if answer["state"] in states else None

    return wait_for(seen, 120, 0.3, what)


@pytest.mark.exclusive("slurm")
def test_a_node_drained_in_real_slurm_is_not_placed_on_until_it_is_resumed(real_slurm):
    """scontrol update state=drain on node2 under a running 4-node job: the job runs on (DRAINING);
    once it has ended, a 4-node job waits (node2 drained) with nothing submitted to Slurm; after
    state=resume luban places it on all four again."""
    scheduler, http, admin, alice = real_slurm
    spec = {"name": "four", "command": "sleep", "args": ["300"], "nodes": 4}
    try:
        first = http.post("/api/jobs", json={"spec": spec}, headers=alice).json()["id"]
        _tick_until(scheduler, http, alice, first, ("running",), "a 4-node job running in Slurm")
        assert _scontrol("update", "nodename=node2", "state=drain", "reason=luban test").returncode == 0
        assert "DRAIN" in _slurm_state("node2")
        scheduler.sync_nodes()  # the next reading (every NODE_SYNC_S)
        node2 = next(n for n in http.get("/api/nodes", headers=admin).json() if n["name"] == "node2")
        assert node2["state"] == UNAVAILABLE and node2["why"].startswith("slurm: draining (luban test"), node2
        for _ in range(5):
            scheduler.guarded_tick()
        assert http.get(f"/api/jobs/{first}", headers=alice).json()["state"] == "running"  # runs on
        assert http.post(f"/api/jobs/{first}/stop", headers=alice).status_code == 200
        _tick_until(scheduler, http, alice, first, ("stopped",), "the first job to stop")
        wait_for(lambda: "ALLOCATED" not in _slurm_state("node2") and "COMPLETING" not in _slurm_state("node2"),
                 60, 0.5, "node2 drained (its job gone)")
        scheduler.sync_nodes()
        node2 = next(n for n in http.get("/api/nodes", headers=admin).json() if n["name"] == "node2")
        assert node2["why"].startswith("slurm: drained (luban test"), node2
        second = http.post("/api/jobs", json={"spec": spec}, headers=alice).json()["id"]
        for _ in range(5):
            scheduler.guarded_tick()
        waiting = http.get(f"/api/jobs/{second}", headers=alice).json()
        assert waiting["state"] == "queued" and "drained" in waiting["reason"], waiting
        listed = subprocess.run(["squeue", "-h", "-n", f"luban-{second}-{waiting['chain_id']}"], capture_output=True,
                                text=True, timeout=60).stdout
        assert listed == "", listed  # nothing submitted for Slurm to leave pending
        _resume("node2")
        scheduler.sync_nodes()
        running = _tick_until(scheduler, http, alice, second, ("running",), "the 4-node job to start after resume")
        assert sorted(running["nodes"]) == ["node1", "node2", "node3", "node4"]
        http.post(f"/api/jobs/{second}/stop", headers=alice)
        _tick_until(scheduler, http, alice, second, ("stopped",), "the second job to stop")
    finally:
        _resume("node2")  # other tests share the cluster


def test_the_node_unavailable_migration_keeps_the_nodes_of_an_older_schema(db_url):
    """0004 adds nodes.unavailable (NULL: the executor starts jobs there) to a database made by 0003."""
    from sqlalchemy import text

    engine = db.make_engine(db_url)
    with engine.begin() as conn:
        migrate(conn, "upgrade", "0003")
        conn.execute(text("INSERT INTO nodes (name, node_group, gpus, labels, addr, state) "
                          "VALUES ('node1', 'debug', 0, '{}', '127.0.0.1', 'drain')"))
    db.upgrade(engine)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT state, unavailable FROM nodes")).all() == [("drain", None)]
    engine.dispose()


@pytest.mark.exclusive("slurm")
def test_the_dashboard_says_why_real_slurm_starts_nothing_on_a_node(service, browser):
    """Slurm's drain reason on the dashboard's node box, end to end: real ``scontrol`` drain, the
    service's first node reading, the API's ``why``, the page (the one path no test had run whole)."""
    from selenium.webdriver.common.by import By

    require(bool(shutil.which("scontrol")) and bool(_slurm_state("node4")), "a Slurm cluster (node1..node4)")
    wait_for(lambda: all(node_unavailable(_slurm_state(f"node{i}")) is None for i in range(1, 5)), 60, 1,
             "node1..node4 usable in Slurm")
    try:
        assert _scontrol("update", "nodename=node4", "state=drain", "reason=luban dashboard test").returncode == 0
        svc = service("--executor", "slurm", "--tick", "0.3")  # its first tick reads the nodes
        wait_for(lambda: any(n["name"] == "node4" and n["why"] for n in svc.admin().nodes()), 60, 0.5,
                 "node4's why in the API")
        browser.get(f"{svc.url}/?token={svc.admin_token}")
        wait_for(lambda: browser.execute_script("return document.body.dataset.ready") == "1", 30, what="dashboard")
        boxes = {e.get_attribute("data-node"): e.text for e in browser.find_elements(By.CSS_SELECTOR, ".node")}
        assert "slurm: drained (luban dashboard test" in boxes["node4"], boxes
        assert "drain" in browser.find_element(By.CSS_SELECTOR, '.node[data-node="node4"]').get_attribute("class")
        assert not any("slurm:" in text for name, text in boxes.items() if name != "node4"), boxes
    finally:
        _resume("node4")  # other tests share the cluster
