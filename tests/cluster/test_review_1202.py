"""Review of 2026-12-02 (ae1e78a: luban follows Slurm's node states; a 503 on submit prints how to
retry; submission keys expire). What broke under a hostile or unlucky cluster, admin or user:

- an attempt luban placed on a node in the seconds between Slurm's drain and luban's next reading
  stayed ``starting`` (Slurm keeps it pending on ``ReqNodeNotAvail``) for as long as the drain lasted,
  holding its other nodes;
- a node's ``Reason`` (or ``Comment``) holding ``State=IDLE`` or ``NodeName=x`` was read as the node's
  own field: a drained node read usable, renamed or moved to another node group;
- the Reason's control codes reached ``luban nodes`` on an admin's terminal;
- the retry hint of ``luban submit`` quoted an argument with a line feed or a tab so that the one-line
  error (which shows a line feed as ``\\n``) printed another argument than the one sent;
- a job running on a node Slurm drains under it (DRAINING) was preempted for a queued job that could
  never be given that node: killed for nothing;
- a user's workdir ``/x JobState=COMPLETED`` (printed by ``scontrol show job`` after the job's own
  JobState) made luban take a running job for succeeded, free its nodes and stop charging it;
- a job running on a node Slurm drains under it made occupancy (the cards, the samples) held / up:
  over 100%, or N held of 0 nodes when every busy node is drained (``scontrol reboot ASAP``);
- every node reading, now every 30 s, made one SELECT per node;
- ``alembic downgrade 0003`` left nodes ``unavailable``, a state the older code never leaves.
"""

from __future__ import annotations

import argparse
import os
import subprocess

import httpx
import pytest
from sqlalchemy import event, text

from luban.cluster import cli, db
from luban.cluster import client as client_module
from luban.cluster.client import Client, SERVICE_HEADER
from luban.cluster.executors import NodeInfo
from luban.cluster.executors.slurm import SlurmExecutor, node_unavailable
from luban.cluster.models import Job, Node
from luban.cluster.policy import JobView, NodeView, Snapshot, plan
from luban.cluster.scheduler import UNAVAILABLE, Scheduler, Settings
from luban.errors import LubanError
from tests.cluster.conftest import migrate
from tests.cluster.fake_slurm import job, no_tracebacks, ticks
from tests.cluster.test_dashboard import browser  # noqa: F401 - a fixture
from tests.cluster.test_slurm_nodes import _nodes, _read_nodes, _resume, _sbatches, _scontrol, _tick_until, \
    real_slurm  # noqa: F401 - real_slurm: a fixture


# -- an attempt Slurm keeps pending on a node it drained ------------------------------------------
def test_an_attempt_slurm_keeps_pending_on_a_node_it_drained_is_requeued_elsewhere(slurm, caplog):
    """luban placed the attempt on node1 just before Slurm drained it (its reading is 30 s old):
    Slurm keeps the sbatch pending. Once luban reads the drain, the attempt is cancelled there and
    requeued at its place (charged nothing), and starts on node2."""
    scheduler, submit, fake, calls, t = slurm
    (fake / "job").write_text("JobId=4242 JobState=PENDING Reason=ReqNodeNotAvail,_UnavailableNodes:node1\n")
    first = submit()
    scheduler.guarded_tick()
    assert job(scheduler, first).state == "starting" and job(scheduler, first).nodes == ["node1"]
    _nodes(fake, node1="State=IDLE+DRAIN Reason=bad gpu [root@2026-12-02T01:00:00]")
    _read_nodes(scheduler, t)
    ticks(scheduler, t, 2)
    ended = job(scheduler, first)
    assert ended.state == "suspended" and "node1" in ended.reason and "bad gpu" in ended.reason, ended.reason
    assert ended.ended_at == ended.started_at  # it never ran: charged nothing
    assert any(line.startswith("scancel") for line in calls.read_text().splitlines())
    with scheduler.sessions() as s:
        retry = s.query(Job).filter(Job.chain_id == ended.chain_id, Job.restart_count == 1).one()
    assert retry.place == ended.place and retry.nodes == ["node2"] and retry.state == "starting", retry.reason
    assert len(_sbatches(calls)) == 2
    no_tracebacks(caplog)


@pytest.mark.exclusive("slurm")
def test_an_attempt_placed_on_a_node_real_slurm_drained_meanwhile_is_requeued(real_slurm):
    """The real daemons: node4 drained in Slurm after luban's last reading; a 4-node job is placed on
    node1..node4 and Slurm keeps it pending (ReqNodeNotAvail). After luban's next reading the Slurm job
    is cancelled, the requeued attempt waits (node4 drained) with nothing in squeue, and starts after
    state=resume."""
    scheduler, http, admin, alice = real_slurm
    spec = {"name": "four", "command": "sleep", "args": ["300"], "nodes": 4}
    try:
        assert _scontrol("update", "nodename=node4", "state=drain", "reason=luban review 1202").returncode == 0
        first = http.post("/api/jobs", json={"spec": spec}, headers=alice).json()["id"]
        scheduler.guarded_tick()  # placed on all four: luban has not read the drain yet
        placed = http.get(f"/api/jobs/{first}", headers=alice).json()
        assert placed["state"] == "starting" and sorted(placed["nodes"]) == ["node1", "node2", "node3", "node4"]
        tag = f"luban-{first}-{placed['chain_id']}"
        listed = lambda: subprocess.run(["squeue", "-h", "-n", tag, "-o", "%T %r"], capture_output=True,  # noqa: E731
                                        text=True, timeout=60).stdout.strip()
        assert listed().startswith("PENDING"), listed()
        scheduler.sync_nodes()
        _tick_until(scheduler, http, alice, first, ("suspended",), "the pending attempt to be requeued")
        assert listed() == "" or listed().startswith("CANCELLED"), listed()
        chain = http.get(f"/api/jobs/{first}", headers=alice).json()["chain_id"]
        retry = next(j for j in http.get("/api/jobs", headers=alice).json() if j["chain_id"] == chain)
        for _ in range(3):
            scheduler.guarded_tick()
        waiting = http.get(f"/api/jobs/{retry['id']}", headers=alice).json()
        assert waiting["state"] == "queued" and "drained" in waiting["reason"], waiting
        _resume("node4")
        scheduler.sync_nodes()
        _tick_until(scheduler, http, alice, retry["id"], ("running",), "the 4-node job to run after resume")
        http.post(f"/api/jobs/{retry['id']}/stop", headers=alice)
        _tick_until(scheduler, http, alice, retry["id"], ("stopped",), "the job to stop")
    finally:
        _resume("node4")  # other tests share the cluster


# -- a node's free text is not its fields -----------------------------------------------------------
def test_a_reason_or_comment_is_never_read_as_the_nodes_own_fields(monkeypatch, tmp_path):
    """scontrol prints Reason, then Comment and Extra, last (node_info.c): free text an admin or a
    health check wrote. 'State=IDLE' in a drained node's reason made it usable, 'NodeName=x' renamed
    it, 'Partitions=x' moved it; a reason with 'ticket=42' in it was cut there."""
    executor = SlurmExecutor(state_dir=str(tmp_path))
    out = ("NodeName=node1 NodeAddr=10.0.0.1 State=IDLE+DRAIN Partitions=debug AvailableFeatures=zone1 Gres=(null) "
           "Reason=swapped, see ticket=42 State=IDLE NodeName=evil Partitions=other [root@2026-12-02T01:00:00]\n"
           "NodeName=node2 NodeAddr=10.0.0.2 State=IDLE Partitions=debug AvailableFeatures=zone1 "
           "Comment=State=DOWN NodeName=node1 Gres=gpu:8\n")
    monkeypatch.setattr(executor, "_run", lambda *args, **kwargs: out)
    nodes = {n.name: n for n in executor.discover()}
    assert sorted(nodes) == ["node1", "node2"]
    assert (nodes["node1"].node_group, nodes["node1"].addr) == ("debug", "10.0.0.1")
    assert nodes["node1"].unavailable == ("slurm: drained (swapped, see ticket=42 State=IDLE NodeName=evil "
                                          "Partitions=other [root@2026-12-02T01:00:00])")
    assert nodes["node2"].unavailable is None and nodes["node2"].gpus == 0


def test_a_reasons_control_codes_never_reach_the_terminal():
    """A health check's reason quoting a log line: ESC, BEL and a right-to-left override are kept
    as escapes (what `luban nodes`, the events and the API show)."""
    why = node_unavailable("IDLE+DRAIN", "nhc: \x1b]0;owned\x07 \u202eflipped")
    assert why == "slurm: drained (nhc: \\x1b]0;owned\\x07 \\u202eflipped)", why


# -- the retry hint of luban submit -------------------------------------------------------------------
def _words_in_bash(line: str, luban: bool = False) -> list[str]:
    """The words a bash prompt makes of ``line`` (what a user pastes); ``luban``: ``line`` is a command
    (``cd DIR && luban ...``) run from /, and the words are the directory ``luban`` ran in, then its
    command line."""
    run = "luban() { printf '%s\\0' \"$PWD\" luban \"$@\"; }; " + line if luban else \
        "f() { printf '%s\\0' \"$@\"; }; f " + line
    out = subprocess.run(["bash", "-c", run], capture_output=True, cwd="/",
                         timeout=30, check=True, env={"LC_ALL": "C.UTF-8", "PATH": "/usr/bin:/bin"}).stdout
    return out.decode().split("\0")[:-1]


@pytest.mark.parametrize("argv", [
    ["-n", "2", "-p", "HIGH", "-t", "2-00:00:00", "--name", "x", "--", "python", "train.py", "--lr", "3e-4"],
    ["-e", "MSG=it's \"quoted\" $HOME `id`", "--export", "NONE", "--", "sh", "-c", "echo 'a  b' -- x"],
    ["--", "python", "-c", "import sys\nprint(sys.argv)\t# tab"],  # a script with a line feed and a tab
    ["--", "printf", "\x1b[31mred\x1b[0m \u202eflip \x9bC1 \u2028 back\\slash 'q'"],
])
def test_the_printed_retry_repeats_the_submission_word_for_word(argv, monkeypatch, capsys):
    """The 503's last line, as luban prints it on a terminal (one line: a line feed shown as \\n, ESC
    as \\x1b), pasted into bash gives back the same arguments, the key added and a --token given
    shown as TOKEN."""
    from luban import errors
    from luban.cli import error_line

    monkeypatch.setattr(errors, "_isatty", lambda stream: True)

    def unavailable(request):
        return httpx.Response(503, json={"detail": "the service's database is unavailable now"},
                              headers={SERVICE_HEADER: "1"})

    client = Client("http://testserver", "secret-token")
    client.http = httpx.Client(base_url="http://testserver", transport=httpx.MockTransport(unavailable))
    monkeypatch.setattr(client_module, "SUBMIT_RETRY_S", 0.0)
    monkeypatch.setattr(cli, "_client", lambda args: client)
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    full = ["submit", "--token", "secret-token", "--key", "k-1202", *argv]
    with pytest.raises(LubanError) as gave_up:
        cli.cmd_submit(parser.parse_args(full))
    line = error_line(gave_up.value)
    assert "\n" not in line and "secret-token" not in line, line
    command = line.split("run in this shell: ", 1)[1]
    here, *words = _words_in_bash(command, luban=True)
    assert here == os.getcwd() and words[:2] == ["luban", "submit"], (here, words)
    again, first = vars(parser.parse_args(words[1:])), vars(parser.parse_args(full))
    assert again.pop("token") == "TOKEN" and first.pop("token") == "secret-token"
    assert again == first, (again, first)


# -- preemption for nodes the preemptor can never be given --------------------------------------------
def test_a_job_on_a_node_slurm_drains_is_not_preempted_for_nothing():
    """n1 drained in Slurm under alice's running job (DRAINING: it runs on). Bob's 4-node job at a
    higher priority cannot run until n1 returns: suspending alice frees nothing bob can be given
    (n1 stays drained), so alice runs on and bob waits, the drain named."""
    nodes = [NodeView(f"n{i}", "g", "z", schedulable=i != 1) for i in range(1, 5)]
    jobs = [JobView(1, "alice", "user:alice", 10, "g", 1, "running", 0.0, 0.0, ("n1",)),
            JobView(2, "bob", "user:bob", 30, "g", 4, "queued", 10.0, 10.0)]
    out = plan(Snapshot(100.0, nodes, jobs, {("user:alice", "g", 10): 4, ("user:bob", "g", 30): 4}))
    assert out.suspends == [] and 1 in out.admitted, out
    assert out.waits[2].endswith("1 node(s) of g are drained: it cannot run until they return"), out.waits
    # ... but a job it can make room for still preempts: bob asks 3, alice's second job holds n2
    jobs = [jobs[0], JobView(3, "alice", "user:alice", 10, "g", 1, "running", 0.0, 0.0, ("n2",)),
            JobView(2, "bob", "user:bob", 30, "g", 3, "queued", 10.0, 10.0)]
    out = plan(Snapshot(100.0, nodes, jobs, {("user:alice", "g", 10): 4, ("user:bob", "g", 30): 4}))
    assert [s[0] for s in out.suspends] == [3] and out.admitted == {1, 2}, out


# -- the node reading every 30 s ---------------------------------------------------------------------
def test_a_node_reading_costs_a_few_statements_whatever_the_number_of_nodes(tmp_path):
    """NODE_SYNC_S went from 300 s to 30 s; each reading asked the database once per node (2000 nodes:
    2001 SELECTs, 3-4 s on PostgreSQL here, every 30 s in the scheduler's thread)."""
    engine = db.open_checked(str(tmp_path / "luban.db"))

    class Many:
        def discover(self):
            return [NodeInfo(f"n{i:04d}", "g", 8, {"zone": "z1", "features": ["zone1"]}, "10.0.0.1",
                             unavailable="slurm: drained" if i % 7 == 0 else None) for i in range(500)]

    scheduler = Scheduler(db.sessions(engine), Many(), Settings(state_dir=str(tmp_path)))
    scheduler.sync_nodes()
    statements = []
    event.listen(engine, "before_cursor_execute", lambda conn, cursor, sql, *args: statements.append(sql))
    scheduler.sync_nodes()
    assert len(statements) <= 3, statements[:5]
    with scheduler.sessions() as s:
        assert s.query(Node).filter(Node.state == UNAVAILABLE).count() == 72
    engine.dispose()


# -- alembic downgrade --------------------------------------------------------------------------------
def test_a_downgrade_leaves_no_node_in_a_state_the_older_code_never_leaves(db_url):
    """0004's downgrade dropped nodes.unavailable but kept state 'unavailable': the older code schedules
    only 'up' and never sets such a node up again (only an admin's `up` would). It is up, as the older
    code had it (it did not follow Slurm); an admin's drain stays."""
    engine = db.open_checked(db_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO nodes (name, node_group, gpus, labels, addr, state, unavailable) VALUES "
                          "('node1', 'debug', 0, '{}', '127.0.0.1', 'unavailable', 'slurm: drained'), "
                          "('node2', 'debug', 0, '{}', '127.0.0.1', 'drain', 'slurm: down')"))
    with engine.begin() as conn:
        migrate(conn, "downgrade", "0003")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT name, state FROM nodes ORDER BY name")).all() == [
            ("node1", "up"), ("node2", "drain")]
    db.upgrade(engine)  # and up again: the executor's next reading says which are unavailable
    with engine.connect() as conn:
        assert conn.execute(text("SELECT state, unavailable FROM nodes ORDER BY name")).all() == [
            ("up", None), ("drain", None)]
    engine.dispose()


def test_a_workdir_that_reads_like_a_state_does_not_end_a_running_job(slurm, caplog):
    """A user's spec workdir '/tmp/x JobState=COMPLETED ExitCode=0:0' (an absolute path: allowed) is
    printed by `scontrol show job -o` after the job's own JobState (WorkDir=..., checked on the real
    22.05): read last-wins, luban took the running job for succeeded, freed its nodes and stopped
    charging it while Slurm ran it on. The first JobState is the job's."""
    scheduler, submit, fake, calls, t = slurm
    started = submit()
    scheduler.guarded_tick()
    (fake / "job").write_text("JobId=4242 JobName=luban-x JobState=RUNNING Reason=None ExitCode=0:0 "
                              "Command=/state/job.sbatch WorkDir=/tmp/x JobState=COMPLETED ExitCode=0:0\n")
    ticks(scheduler, t, 3)
    assert job(scheduler, started).state == "running", job(scheduler, started).reason
    no_tracebacks(caplog)


# -- occupancy with a node drained under its job ---------------------------------------------------------
def test_a_sample_counts_a_node_drained_under_its_job_as_in_service(slurm):
    """Slurm drains node1 under its job (DRAINING: it runs on), node2 is idle: the sample said 1 node
    up, 1 held (occupancy 100%, the chart's held / nodes); a cluster-wide `scontrol reboot ASAP`
    (DRAIN on every busy node) made it N held of 0 nodes. In service: up, or held by a job."""
    from luban.cluster.models import Sample

    scheduler, submit, fake, calls, t = slurm
    first = submit()
    scheduler.guarded_tick()
    on = job(scheduler, first).nodes[0]
    _nodes(fake, **{on: "State=MIXED+DRAIN Reason=reboot ASAP"})
    _read_nodes(scheduler, t)
    scheduler.sample(scheduler.clock.now())
    with scheduler.sessions() as s:
        last = s.query(Sample).order_by(Sample.t.desc()).first()
    assert (last.nodes, last.held) == (2, 1)


def test_the_dashboards_occupancy_counts_a_node_drained_under_its_job(service, browser):
    """The cards: 2 nodes, a job on node1, node1 drained under it (an admin's drain; Slurm's reads the
    same, a state other than up): occupancy was 1 held / 1 up = 100% with node2 idle; it is 50%."""
    from selenium.webdriver.common.by import By

    from tests.cluster.conftest import PYTHON, wait_for

    svc = service("--nodes", "2", "--tick", "0.2", "--sample-every", "0.3")
    admin = svc.admin()
    _, alice = svc.user("alice", {"NORMAL": 1})
    running = alice.submit({"name": "run", "command": PYTHON, "args": ["-c", "import time; time.sleep(600)"]})["id"]
    wait_for(lambda: alice.job(running)["state"] == "running", 60, what="the job running")
    admin.set_node(alice.job(running)["nodes"][0], "drain")
    browser.get(f"{svc.url}/?token={svc.admin_token}")
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready") == "1", 30, what="dashboard")
    cards = browser.find_element(By.ID, "cards").text
    assert "1 / 2\nnodes up" in cards and "50%\noccupancy" in cards and "50%\nutilisation" in cards, cards
    admin.stop(running)
