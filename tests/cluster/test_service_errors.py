"""The service's own errors are one line, exit 2, and leave no state behind (issue 24): a port in
use, an unreachable database, a foreign --state folder, --run-jobs-as namespace as root; and the
API refuses what it cannot launch (NUL bytes, non-string env values, an --os-user it would ignore
or that is a system account) instead of accepting it; a huge chunked body is a 413 without a
logged traceback."""

from __future__ import annotations

import os
import socket
import subprocess

import httpx
import pytest

from tests.cluster.conftest import LUBAN, ROOT, free_port, wait_for


def serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*LUBAN, "cluster", "serve", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def one_line(proc: subprocess.CompletedProcess, *words: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("luban: error: "), \
        (proc.returncode, proc.stderr[-3000:])
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def test_a_port_in_use_is_one_line_and_creates_no_state(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        state = tmp_path / "state"
        proc = serve("--state", str(state), "--port", str(port), "--run-jobs-as", "service")
        one_line(proc, f"--port = {port}", "a free port")
        assert not state.exists()  # no folder, no admin token
        empty = tmp_path / "empty"
        empty.mkdir(mode=0o755)
        one_line(serve("--state", str(empty), "--port", str(port), "--run-jobs-as", "service"), "--port")
        assert list(empty.iterdir()) == [] and empty.stat().st_mode & 0o777 == 0o755


def test_an_unreachable_database_is_one_line_and_creates_no_state(tmp_path):
    state = tmp_path / "state"
    proc = serve("--state", str(state), "--port", str(free_port()), "--run-jobs-as", "service",
                 "--db", "postgresql://luban:secret@127.0.0.1:1/luban")
    line = one_line(proc, "--db", "127.0.0.1:1", "cannot be used")
    assert "secret" not in line and "Traceback" not in proc.stderr
    assert not state.exists()


def test_slurm_without_its_commands_is_one_line_and_creates_no_state(tmp_path):
    """2026-11-27: a missing ``scontrol`` was uvicorn's start-up traceback, exit 3."""
    state, bare = tmp_path / "state", tmp_path / "bin"
    bare.mkdir()
    proc = subprocess.run([*LUBAN, "cluster", "serve", "--executor", "slurm", "--state", str(state), "--port",
                           str(free_port()), "--run-jobs-as", "service"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=dict(os.environ, PATH=str(bare)))
    one_line(proc, "--executor = 'slurm'", "not found: sbatch, squeue, scontrol, scancel", "slurm-wlm")
    assert not state.exists()


def test_a_foreign_state_folder_is_refused_untouched(tmp_path):
    """Issue 24: --state a folder of the user's files was made mode 700 and got the database and
    the admin token among those files."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chmod(theirs, 0o755)
    (theirs / "notes.txt").write_text("mine")
    one_line(serve("--state", str(theirs), "--port", str(free_port()), "--run-jobs-as", "service"),
             "--state", "'notes.txt'", "luban did not write", "nothing was changed")
    assert sorted(p.name for p in theirs.iterdir()) == ["notes.txt"]
    assert theirs.stat().st_mode & 0o777 == 0o755


def test_a_state_folder_of_an_older_luban_is_still_served(service, tmp_path):
    """A state folder written before the marker (database, token, logs) is recognised as luban's."""
    svc = service("--nodes", "1")
    svc.stop()
    (svc.state / ".luban").unlink()
    svc.start()
    assert (svc.state / ".luban").is_file() and svc.admin().call("GET", "/users")


@pytest.mark.skipif(os.geteuid() != 0, reason="the root case")
def test_namespace_mode_as_root_says_what_is_wrong(tmp_path):
    state = tmp_path / "state"
    proc = serve("--state", str(state), "--port", str(free_port()), "--run-jobs-as", "namespace")
    one_line(proc, "--run-jobs-as = 'namespace'", "as root every job would run as root")
    assert "luban cluster: not root" not in proc.stderr and not state.exists()


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    from tests.cluster.conftest import Service, kill_jobs

    svc = Service(tmp_path_factory.mktemp("refuse") / "state", ["--nodes", "1", "--tick", "0.2",
                                                                 "--max-body", "65536"]).start()
    token, alice = svc.user("alice", {"NORMAL": 1})
    yield svc, token, alice
    svc.stop()
    kill_jobs(svc.state)


def post(svc, path, token, **kw):
    return httpx.post(svc.url + "/api" + path, headers={"Authorization": f"Bearer {token}"}, timeout=30, **kw)


@pytest.mark.parametrize("spec,words", [
    ({"name": "j", "command": "tr\x00ue"}, "command"),
    ({"name": "j", "command": "true", "args": ["a\x00b"]}, "args[0]"),
    ({"name": "j", "command": "true", "env": {"A": "x\x00y"}}, "env.A"),
    ({"name": "j", "command": "true", "workdir": "/tmp/\x00"}, "workdir"),
    ({"name": "j", "command": "true", "env": {"A": 5}}, "env.A = 5: a string"),
    ({"name": "j", "command": "true", "env": {"A": True}}, "env.A = True: a string"),
    ({"name": "j", "command": "true", "env": {"A": 1.5}}, "env.A = 1.5: a string"),
])
def test_the_api_refuses_a_spec_it_cannot_launch(api, spec, words):
    svc, token, alice = api
    before = len(alice.jobs(all_attempts=True))
    r = post(svc, "/jobs", token, json={"spec": spec})
    assert r.status_code == 422, r.text[:300]
    detail = r.json()["detail"]
    assert words in detail and "\n" not in detail
    assert len(alice.jobs(all_attempts=True)) == before


def test_yaml_env_numbers_must_be_quoted(api):
    svc, token, _ = api
    r = post(svc, "/jobs", token, json={"yaml": "name: j\ncommand: 'true'\nenv: {OMP_NUM_THREADS: 4}\n"})
    assert r.status_code == 422 and "env.OMP_NUM_THREADS = 4: a string" in r.json()["detail"]


@pytest.mark.parametrize("body,words", [
    ({"name": "x", "os_user": "root"}, "os_user = 'root': only where jobs run as per-user OS accounts"),
    ({"name": "x", "os_user": "nobody"}, "os_user"),
    ({"name": "x", "shell": "/bin/sh"}, "shell"),
])
def test_an_os_user_this_service_would_ignore_is_refused(api, body, words):
    """Issue 24: `admin user add x --os-user root` on a service that does not run jobs as per-user
    accounts was accepted and ignored."""
    svc, _, _ = api
    r = post(svc, "/users", svc.admin_token, json=body)
    assert r.status_code == 422, r.text[:300]
    assert words in r.json()["detail"]
    assert "x" not in {u["name"] for u in svc.admin().call("GET", "/users")}
    proc = svc.cli("admin", "user", "add", "x", "--os-user", "root", check=False)
    assert proc.returncode == 2 and "os_user" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_system_accounts_are_not_job_accounts():
    from luban.cluster import accounts
    from luban.errors import LubanError

    for name in ("root", "daemon", "nobody"):
        with pytest.raises(LubanError, match="os_user"):
            accounts.ensure_user("x", name)


def test_a_huge_chunked_body_is_413_without_a_traceback_in_the_log(api):
    svc, token, _ = api
    size = svc.log.stat().st_size

    def chunks():  # no Content-Length: counted as it arrives (issue 24: 60 MB)
        for _ in range(60 * 16):
            yield b"x" * 65536

    r = post(svc, "/jobs", token, content=chunks())
    assert r.status_code == 413, r.text[:300]
    assert httpx.get(svc.url + "/api/whoami", headers={"Authorization": f"Bearer {token}"}, timeout=10).is_success
    wait_for(lambda: "POST /api/jobs" in svc.log.read_text()[size:], 10, what="the access log line")
    logged = svc.log.read_text()[size:]
    assert "Traceback" not in logged and "Exception in ASGI application" not in logged, logged[-3000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="the root case")
def test_service_mode_as_root_warns_that_jobs_run_as_root(service):
    svc = service("--nodes", "1", "--run-jobs-as", "service")
    log = svc.log.read_text()
    assert "every job runs as root" in log and "--run-jobs-as user" in log, log[-2000:]


@pytest.mark.parametrize("url", ["foo", "http://[::1", "http://head:99999"])
def test_a_public_url_jobs_could_not_use_is_refused(tmp_path, url):
    """--public-url is every job's LUBAN_CLUSTER_URL: 'foo' was accepted, and each job's SDK call failed."""
    state = tmp_path / "state"
    one_line(serve("--state", str(state), "--port", str(free_port()), "--run-jobs-as", "service",
                   "--public-url", url), f"--public-url = {url!r}", "http(s)://HOST[:PORT]")
    assert not state.exists()


def test_the_url_jobs_get_for_an_ipv6_host_is_a_url():
    import httpx

    from luban.cluster.cli import service_url

    assert service_url("::1", 8765) == "http://[::1]:8765" and httpx.URL(service_url("::", 1)).port == 1
    assert service_url("0.0.0.0", 8765) == "http://0.0.0.0:8765"
