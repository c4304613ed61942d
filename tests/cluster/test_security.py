"""Authentication, isolation between users and groups, admin-only operations, spec validation."""

from __future__ import annotations

import httpx
import pytest

from luban.cluster.client import Client
from luban.errors import LubanError
from tests.cluster.conftest import PYTHON, wait_for

SLEEP = {"name": "sleeper", "command": PYTHON, "args": ["-c", "import time; time.sleep(600)"]}


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    from tests.cluster.conftest import Service, kill_jobs

    state = tmp_path_factory.mktemp("security")
    service = Service(state, ["--nodes", "3", "--tick", "0.2"]).start()
    try:  # a set-up that fails stops the service too (it outlived a refused add_group, 2026-12-04)
        admin = service.admin()
        admin.add_group("vision", data_dir=str(state.parent / f"{state.name}-vision-data"))  # (not inside the state)
        admin.set_quota("group:vision", "NORMAL", 1)
        yield service
    finally:
        service.stop()
        kill_jobs(state)


def status(svc, method, path, token=None, **kw):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, svc.url + "/api" + path, headers=headers, timeout=10, **kw).status_code


def test_every_call_needs_a_valid_token(svc):
    for method, path in (("GET", "/jobs"), ("GET", "/nodes"), ("POST", "/jobs"), ("GET", "/quota"),
                         ("GET", "/users"), ("GET", "/jobs/1/logs"), ("GET", "/samples")):
        assert status(svc, method, path) == 401
        assert status(svc, method, path, token="not-a-token") == 401


def test_users_see_and_control_only_their_own_jobs(svc):
    _, alice = svc.user("alice", {"NORMAL": 1})
    bob_token, bob = svc.user("bob", {"NORMAL": 1})
    job = alice.submit(SLEEP)["id"]
    assert [j["id"] for j in alice.jobs()] == [job]
    assert bob.jobs() == []
    for call in (lambda: bob.job(job), lambda: bob.stop(job), lambda: bob.suspend(job), lambda: bob.logs(job),
                 lambda: bob.events(job)):
        with pytest.raises(LubanError, match="HTTP 404"):
            call()
    assert status(svc, "PUT", f"/jobs/{job}/whole_life_state", bob_token, json={"value": 3}) == 404
    assert svc.admin().job(job)["user"] == "alice"  # admins see everything
    alice.stop(job)
    assert alice.wait(job, timeout=60)["state"] == "stopped"
    with pytest.raises(LubanError, match=r"job = \d+: is stopped; this needs a job that is starting or running"):
        alice.suspend(job)


def test_admin_only_operations(svc):
    token, carol = svc.user("carol", {"NORMAL": 1})
    for call in (lambda: carol.add_user("mallory", admin=True), lambda: carol.set_quota("user:carol", "HIGH", 9),
                 lambda: carol.set_node("node1", "drain"), lambda: carol.users(), lambda: carol.add_group("x"),
                 lambda: carol.rotate_token("admin"), lambda: carol.set_user("carol", group="vision")):
        with pytest.raises(LubanError, match="HTTP 403"):
            call()
    assert carol.quota() == [{"owner": "user:carol", "node_group": "default", "priority": 10,
                              "priority_name": "NORMAL", "nodes": 1, "used": 0}]
    result = svc.cli("admin", "user", "add", "mallory", token=token, check=False)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "not an admin" in result.stderr


def test_group_jobs_are_shared_with_members_only(svc):
    _, dave = svc.user("dave", {}, group="vision")
    _, erin = svc.user("erin", {}, group="vision")
    _, frank = svc.user("frank", {"NORMAL": 1})
    job = dave.submit(dict(SLEEP, group="vision"))["id"]
    assert dave.job(job)["group"] == "vision" and erin.job(job)["user"] == "dave"
    with pytest.raises(LubanError, match="HTTP 404"):
        frank.job(job)
    with pytest.raises(LubanError, match="group = 'vision': you are not a member"):
        frank.submit(dict(SLEEP, group="vision"))
    wait_for(lambda: dave.job(job)["state"] == "running", 60, what="group job running")
    assert {q["owner"]: q["used"] for q in erin.quota()}["group:vision"] == 1
    assert erin.stop(job)["id"] == job  # a member may stop the group's job
    assert dave.wait(job, timeout=60)["state"] == "stopped"
    assert [g["members"] for g in erin.groups()] == [["dave", "erin"]]


def test_job_token_is_limited_to_its_own_job(svc):
    gina_token, gina = svc.user("gina", {"NORMAL": 2})
    show = "import os; print(os.environ['LUBAN_CLUSTER_TOKEN']); import time; time.sleep(600)"
    job = gina.submit({"name": "tok", "command": PYTHON, "args": ["-c", show]})["id"]
    other = gina.submit(SLEEP)["id"]
    token = wait_for(lambda: (gina.logs(job)["text"].splitlines()[1:2] or [None])[0], 60, what="job token")
    as_job = Client(svc.url, token)
    assert as_job.whoami() == {"user": "gina", "admin": False, "group": None, "job_id": job}
    assert as_job.call("PUT", f"/jobs/{job}/whole_life_state", json={"value": 7}) == {"value": 7}
    assert gina.job(job)["whole_life_state"] == 7
    with pytest.raises(LubanError, match="HTTP 403"):
        as_job.jobs()
    with pytest.raises(LubanError, match="HTTP 404"):
        as_job.call("GET", f"/jobs/{other}/whole_life_state")
    # tokens are stored hashed: no plaintext token (admin, user, live job) anywhere in the database files
    stored = b"".join(p.read_bytes() for p in svc.state.glob("luban.db*"))
    assert stored and all(t.encode() not in stored for t in (svc.admin_token, gina_token, token))
    for j in (job, other):
        gina.stop(j)
        gina.wait(j, timeout=60)
    with pytest.raises(LubanError, match="HTTP 401"):
        as_job.whoami()  # the token dies with its attempt


@pytest.fixture(scope="module")
def hank(svc):
    """A user with a NORMAL quota of 1 node: (token, Client)."""
    return svc.user("hank", {"NORMAL": 1})


@pytest.mark.parametrize("spec, message", [
    (dict(SLEEP, nodes=0), "nodes = 0: an integer >= 1"),
    (dict(SLEEP, nodes=9), "nodes = 9: at most 3"),
    (dict(SLEEP, priority="URGENT"), "priority = 'URGENT': one of EXTREME_HIGH"),
    (dict(SLEEP, priority="HIGH"), "priority = 'HIGH': user:hank may hold 0 node(s) at HIGH"),
    (dict(SLEEP, gpus=8), "gpus = 8: unknown key"),
    (dict(SLEEP, env={"1BAD": "x"}), "env.1BAD = 'x'"),
    (dict(SLEEP, args="not a list"), "args = 'not a list': a list of strings"),
    (dict(SLEEP, node_group="tpu"), "node_group = 'tpu': unknown; node groups: default"),
    ({"name": "x"}, "command is missing"),
    ({"name": "bad name!", "command": "true"}, "name = 'bad name!'"),
    ("name: [unclosed", "job spec is not valid YAML"),
])
def test_malformed_specs_are_rejected_with_the_key_and_value(hank, spec, message):
    with pytest.raises(LubanError, match="HTTP 422") as err:
        hank[1].submit(spec)
    assert message in str(err.value)


def test_cli_errors_are_one_line_with_exit_code_2(svc, hank, tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("name: train\ncommand: python\nnodes: two\n")
    cases = [(["submit", str(bad)], "nodes = 'two': an integer >= 1"),
             (["submit", "-p", "SOON", "--", "true"], "priority = 'SOON'"),
             (["submit", str(tmp_path / "missing.yaml")], "no such file"),
             (["submit", "-n", "5", "--", "true"], "nodes = 5: at most 3"),
             (["logs", "999"], "job 999 not found")]
    for args, message in cases:
        result = svc.cli(*args, token=hank[0], check=False)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith("luban: error: ") and result.stderr.count("\n") == 1, result.stderr
        assert message in result.stderr


def _on_a_terminal(svc, *args: str) -> str:
    """What ``luban cluster ARGS`` writes to a terminal (a pty as its stdout), read until it exits."""
    import os
    import pty
    import select
    import subprocess
    import time

    from tests.cluster.conftest import LUBAN

    leader, follower = pty.openpty()
    env = dict(os.environ, LUBAN_CLUSTER_URL=svc.url, LUBAN_CLUSTER_TOKEN=svc.admin_token)
    proc = subprocess.Popen([*LUBAN, *args], env=env, stdout=follower, stderr=subprocess.PIPE)
    os.close(follower)
    out, deadline = b"", time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 1.0)[0]:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                out += data
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=30) == 0, (out, proc.stderr.read())
    finally:
        proc.kill()
        proc.stderr.close()
        os.close(leader)
    return out.decode()


def test_a_jobs_control_codes_do_not_reach_an_admins_terminal(svc):
    """A user's job writes terminal escapes (set the title, write the clipboard: OSC 0 and 52) and a
    right-to-left override, and a carriage return that would print its next words over the line;
    an admin reading its log on a terminal sees them escaped; piped, or with --raw, the bytes are as
    the job wrote them."""
    _, ivan = svc.user("ivan", {"NORMAL": 1})
    payload = "before\\x1b]0;owned\\x07\\x1b]52;c;ZWNobyBoaQ==\\x07\\u202eafter\\tend\\rall is well"
    job = ivan.submit({"name": "escapes", "command": PYTHON, "args": ["-c", f"print('{payload}')"]})["id"]
    assert ivan.wait(job, timeout=120)["state"] == "succeeded"
    raw = "before\x1b]0;owned\x07\x1b]52;c;ZWNobyBoaQ==\x07\u202eafter\tend\rall is well"
    assert raw.replace("\r", "\n") in svc.cli("logs", str(job)).stdout  # a pipe: as written (read as text: \r ends a line)
    shown = _on_a_terminal(svc, "logs", str(job))
    assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown, shown
    assert "before\\x1b]0;owned\\x07\\x1b]52;c;ZWNobyBoaQ==\\x07\\u202eafter\tend\\rall is well" in shown, shown
    assert raw in _on_a_terminal(svc, "logs", "--raw", str(job))


def test_a_log_of_cjk_and_emoji_reads_whole_on_a_terminal_and_across_chunks(svc):
    """An attack on the day's changes, 2026-11-27: text is not a control. On a terminal, U+3000 (the
    space between CJK words), a no-break space and the joiner of an emoji sequence were printed as
    \\u3000, \\xa0, \\u200d; and a log read in 1 MiB chunks cut a character at each chunk's end into
    two U+FFFD (piped and --raw too). Controls are still escaped: C1's CSI and NEL, U+2028."""
    _, ines = svc.user("ines", {"NORMAL": 1})
    line = "日本語\u3000テキスト\u00a0👩\u200d💻"
    code = f"import sys; sys.stdout.write('あ' * 400000 + '\\n' + {line!r} + '\\x9b31m\\x85\\u2028end\\n')"
    job = ines.submit({"name": "unicode", "command": PYTHON, "args": ["-c", code]})["id"]
    assert ines.wait(job, timeout=120)["state"] == "succeeded"
    piped = svc.cli("logs", str(job)).stdout
    assert "\ufffd" not in piped and "\n" + "あ" * 400000 + "\n" in piped, piped.count("\ufffd")
    shown = _on_a_terminal(svc, "logs", str(job))
    assert "\ufffd" not in shown and f"{line}\\x9b31m\\x85\\u2028end" in shown, shown[-200:]
