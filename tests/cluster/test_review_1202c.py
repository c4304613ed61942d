"""What the 2026-12-02 review left as is, mended (2026-12-02, session 26).

- The retry command a 503 prints (``luban submit --key ...``) omitted the directory it was run in and
  the URL ``$LUBAN_CLUSTER_URL`` gave: from another directory or shell it was refused (409), or went
  elsewhere. It now starts ``cd DIR &&`` and names the service.
- A ``--url`` (or ``$LUBAN_CLUSTER_URL``) with a password in it was printed as typed, in that command
  and in every "unreachable" error: a user pasting either into a ticket gave the password away. So
  were ``serve --db`` (with no driver for it) and ``--public-url`` in their one-line errors. Every URL
  luban prints now goes through ``errors.without_password``.
- A repeated key answered the chain's first attempt: after a suspend, ``luban submit --key K`` said the
  job "is suspended" while its requeued attempt queued or ran.
- A node an admin drained, which Slurm then stopped reporting, kept Slurm's old reason in ``why``.
"""

from __future__ import annotations

import argparse
import os

import httpx
import pytest

from luban.cluster import cli
from luban.cluster import client as client_module
from luban.cluster.client import SERVICE_HEADER, SUBMIT_KEY_HEADER, Client
from luban.cluster.executors import NodeInfo
from luban.cluster.models import Event, Job, Node
from luban.cluster.scheduler import GONE, Scheduler, Settings
from luban.errors import LubanError, without_password
from tests.cluster.test_review_1202 import _words_in_bash


@pytest.mark.parametrize("url, shown", [
    ("http://alice:s3cret@cluster:8765", "http://alice:PASSWORD@cluster:8765"),
    ("https://alice:p%40ss@h/x", "https://alice:PASSWORD@h/x"),
    ("http://alice:a@b@h", "http://alice:PASSWORD@h"),  # an unencoded "@": userinfo ends at the last one
    ("http://:only@h", "http://:PASSWORD@h"),
    ("http://alice@h:8765", "http://alice@h:8765"),  # a user alone is no secret
    ("http://h:8765/a:b@c", "http://h:8765/a:b@c"),  # "@" in the path is not userinfo
    ("http://h:8765", "http://h:8765"),
])
def test_a_password_in_a_url_is_never_shown(url, shown):
    assert without_password(url) == shown


def test_a_client_url_with_a_password_is_refused_without_showing_it():
    """(It was used, and named whole in "unreachable" errors; a URL's credentials cannot work at all:
    test_review_1202d.py.)"""
    with pytest.raises(LubanError) as err:
        Client("http://alice:s3cret@127.0.0.1:9", "token", timeout=2)
    assert "s3cret" not in str(err.value) and "alice:PASSWORD@127.0.0.1:9" in str(err.value), err.value


def _give_up_line(monkeypatch, argv: list[str], env_url: str | None) -> str:
    """The one-line error ``luban submit ARGV`` ends with when every try got a 503."""
    from luban.cli import error_line

    def unavailable(request):
        return httpx.Response(503, json={"detail": "the service's database is unavailable now"},
                              headers={SERVICE_HEADER: "1"})

    if env_url is None:
        monkeypatch.delenv("LUBAN_CLUSTER_URL", raising=False)
    else:
        monkeypatch.setenv("LUBAN_CLUSTER_URL", env_url)
    client = Client(None, "token")
    client.http = httpx.Client(base_url="http://testserver", transport=httpx.MockTransport(unavailable))
    monkeypatch.setattr(client_module, "SUBMIT_RETRY_S", 0.0)
    monkeypatch.setattr(cli, "_client", lambda args: client)
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    with pytest.raises(LubanError) as gave_up:
        cli.cmd_submit(parser.parse_args(["submit", "--key", "k-1202c", *argv]))
    return error_line(gave_up.value)


def test_the_retry_runs_where_the_submission_ran_and_names_its_service(monkeypatch, tmp_path):
    """The default workdir and a relative job file are this directory's: the command ``cd``s there
    first (from / here). The service came from $LUBAN_CLUSTER_URL: the command names it."""
    (tmp_path / "job.yaml").write_text("name: j\ncommand: python\nargs: [train.py]\n")
    monkeypatch.chdir(tmp_path)
    line = _give_up_line(monkeypatch, ["job.yaml"], "http://cluster:8765")
    here, *words = _words_in_bash(line.split("run in this shell: ", 1)[1], luban=True)
    assert here == os.getcwd() == str(tmp_path), here
    assert words == ["luban", "submit", "--key", "k-1202c", "--url", "http://cluster:8765", "job.yaml"], words
    line = _give_up_line(monkeypatch, ["--", "python", "train.py"], None)  # the default URL: no --url
    _, *words = _words_in_bash(line.split("run in this shell: ", 1)[1], luban=True)
    assert words == ["luban", "submit", "--key", "k-1202c", "--", "python", "train.py"], words


def test_the_retry_from_a_removed_directory_is_still_a_command(monkeypatch, tmp_path):
    """No directory to ``cd`` to (it was removed under the shell): the command, without ``cd``."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    monkeypatch.delenv("LUBAN_CLUSTER_URL", raising=False)
    args = argparse.Namespace(url=None, token=None, env=[], time=None, export="ALL", rest=["/job.yaml"],
                              **{field: None for field, _ in cli.SPEC_FLAGS})
    assert cli._submit_again(args, "k") == "luban submit --key k /job.yaml"


def test_a_repeated_key_answers_the_chains_latest_attempt(in_process, monkeypatch, capsys):
    service = in_process()
    token = service.user("alice", 1)
    headers = {"Authorization": f"Bearer {token}", SUBMIT_KEY_HEADER: "k-requeued"}
    spec = {"name": "a", "command": "true", "workdir": "/tmp", "env": {}, "env_only": True}
    first = service.http.post("/api/jobs", json={"spec": spec}, headers=headers).json()
    with service.sessions.begin() as s:  # suspended, and requeued as attempt 1 (what Scheduler._end does)
        made = s.get(Job, first["id"])
        made.state = "suspended"
        s.add(Job(chain_id=made.chain_id, first_id=made.first_id, restart_count=1, whole_life_state=0,
                  user=made.user, group=made.group, owner=made.owner, name=made.name, spec=made.spec,
                  priority=made.priority, node_group=made.node_group, nnodes=made.nnodes, state="queued",
                  chain_submitted_at=made.chain_submitted_at, place=made.place, queued_at=made.queued_at,
                  nodes=[], requested=0, stop_reason=0, reason="requeued: suspended"))
    again = service.http.post("/api/jobs", json={"spec": spec}, headers=headers)
    assert again.status_code == 200, again.text
    answer = again.json()
    assert answer["repeated"] and answer["first_id"] == first["id"] != answer["id"], answer
    assert (answer["restart_count"], answer["state"]) == (1, "queued"), answer

    client = Client("http://testserver", token)
    client.http = service.http
    service.http.headers["Authorization"] = f"Bearer {token}"
    monkeypatch.setattr(cli, "_client", lambda args: client)
    monkeypatch.chdir("/tmp")
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    cli.cmd_submit(parser.parse_args(["submit", "--key", "k-requeued", "--export", "NONE", "--name", "a",
                                      "--", "true"]))
    assert capsys.readouterr().out == (f"job {first['id']} was submitted with --key k-requeued before "
                                       "(it is queued); nothing new submitted\n")


def test_a_node_slurm_stops_reporting_loses_slurms_reason_whatever_the_admin_set(tmp_path):
    from luban.cluster import db

    engine = db.open_checked(str(tmp_path / "luban.db"))
    reported = {"n1": "slurm: drained (disk)", "n2": "slurm: drained (fan)", "n3": None}

    class Nodes:
        def discover(self):
            return [NodeInfo(name, "g", 8, {"zone": "z1"}, "10.0.0.1", unavailable=why)
                    for name, why in reported.items()]

    scheduler = Scheduler(db.sessions(engine), Nodes(), Settings(state_dir=str(tmp_path)))
    scheduler.sync_nodes()
    with scheduler.sessions.begin() as s:
        s.get(Node, "n1").state = "drain"  # the admin's own drain, beside Slurm's
    del reported["n1"], reported["n2"]  # removed from Slurm
    scheduler.sync_nodes()
    with scheduler.sessions() as s:
        rows = {n.name: (n.state, n.unavailable) for n in s.query(Node)}
    assert rows == {"n1": ("drain", None), "n2": (GONE, None), "n3": ("up", None)}, rows
    with scheduler.sessions() as s:
        said = [e.message for e in s.query(Event).filter(Event.kind == "node").order_by(Event.id)]
    assert sorted(said[-2:]) == ["n1 is no longer reported by the executor (was: slurm: drained (disk))",
                         "n2 is no longer reported by the executor (was: slurm: drained (fan))"], said
    engine.dispose()


@pytest.mark.parametrize("argv, shown", [
    (["--db", "oracle+nodriver://alice:s3cret@db/x"], "--db = 'oracle+nodriver://alice:PASSWORD@db/x': "),
    (["--db", "postgresql://alice:s3cret@127.0.0.1:9/x", "--run-jobs-as", "service"],  # (as user: test_review_1204_platform)
     "--db = 'postgresql://alice:PASSWORD@127.0.0.1:9/x': cannot be used ("),  # port 9: refused
    (["--public-url", "ftp://alice:s3cret@h"], "--public-url = 'ftp://alice:PASSWORD@h': "),
])
def test_a_database_or_public_url_with_a_password_is_shown_without_it(argv, shown, tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "luban", "cluster", "serve", "--state", str(tmp_path / "s"),
                           *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "s3cret" not in proc.stderr and proc.stderr.startswith("luban: error: " + shown), proc.stderr
