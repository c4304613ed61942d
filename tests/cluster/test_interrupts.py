"""Ctrl-C and closed pipes on the platform's commands, with a real service, real signals to the
command's whole process group (as a terminal sends them) and real pipes (issue 24)."""

from __future__ import annotations

import re
import subprocess

from tests.cluster.conftest import PYTHON
from tests.interrupt_helpers import (LUBAN, Proc, assert_interrupted, assert_quiet_pipe, closed_pipe_run, env)

TALKER = "import time\nfor i in range(100000):\n    print('line', i, flush=True)\n    time.sleep(0.1)\n"


def _env(svc, token=None) -> dict:
    return {"LUBAN_CLUSTER_URL": svc.url, "LUBAN_CLUSTER_TOKEN": token or svc.admin_token}


def test_ctrl_c_on_logs_follow_is_one_line_and_130(service, tmp_path):
    svc = service("--nodes", "1", "--tick", "0.2")
    token, alice = svc.user("alice", {"NORMAL": 1})
    job = alice.submit({"name": "talker", "command": PYTHON, "args": ["-c", TALKER]})["id"]
    follow = Proc(["logs", "-f", job], extra_env=_env(svc, token))
    follow.wait_for(lambda: b"line 3\n" in b"".join(follow.out), 120, "the job's output on stdout")
    assert_interrupted(*follow.ctrl_c())
    alice.stop(job)


def test_ctrl_c_on_stop_while_it_waits_is_one_line_and_130(service, tmp_path):
    """The service ticks every 60 s: ``luban stop`` has requested the stop and waits for the end."""
    svc = service("--nodes", "1", "--tick", "60")
    token, alice = svc.user("alice", {"NORMAL": 1})
    job = alice.submit({"name": "queued", "command": "sleep", "args": ["600"]})["id"]
    stop = Proc(["stop", job], extra_env=_env(svc, token))
    stop.wait_for(lambda: b"stop requested" in b"".join(stop.out), 120, "the stop request")
    assert stop.proc.poll() is None  # still waiting for the job's end
    assert_interrupted(*stop.ctrl_c())


def test_closed_stdout_of_jobs_and_logs_is_quiet(service, tmp_path):
    svc = service("--nodes", "1", "--tick", "0.2")
    token, alice = svc.user("alice", {"NORMAL": 1})
    for i in range(3):
        alice.submit({"name": f"j{i}", "command": "true"})
    job = alice.submit({"name": "talker", "command": PYTHON, "args": ["-c", TALKER]})["id"]
    alice.wait(job, states=("running",), timeout=120)
    for args in (["jobs", "--all"], ["jobs", "--json"], ["nodes"], ["quota"], ["logs", job]):
        assert_quiet_pipe(closed_pipe_run(args, extra_env=_env(svc, token)))
    # and as a user types it: the reader goes away after one line (timing-dependent; never a traceback)
    shell = subprocess.run(["sh", "-c", " ".join(LUBAN) + " jobs --all | head -1"], capture_output=True,
                           text=True, env=env(**_env(svc, token)), timeout=120)
    assert shell.returncode == 0 and shell.stderr == "" and re.match(r"ID\s+CHAIN", shell.stdout), shell
    alice.stop(job)


def test_ctrl_c_on_serve_shuts_down_then_130(tmp_path):
    from tests.cluster.conftest import free_port, listens
    import httpx

    state, port = tmp_path / "state", free_port()
    serve = Proc(["cluster", "serve", "--state", state, "--port", port, "--run-jobs-as", "service"])

    def up():
        if not listens(serve.proc.pid, port):  # not yet, or another test's process took the port
            return False
        try:
            return httpx.get(f"http://127.0.0.1:{port}/api/whoami", timeout=1).status_code == 401
        except httpx.HTTPError:
            return False

    serve.wait_for(up, 120, "the service")
    code, err, took = serve.ctrl_c()
    assert code == 130 and "Traceback" not in err and err.endswith("luban: interrupted\n"), (code, err)
    assert err.count("luban: interrupted") == 1


def test_sigterm_during_serve_start_up_leaves_nothing_behind(tmp_path):
    """A service manager's stop (SIGTERM) while ``cluster serve`` sets up its state folder: the folder it
    made is removed (one that existed empty is empty again, its mode as it was), exit 143, no traceback.
    Before, SIGTERM's default action ended the process there and left a marked folder with part of a state.
    The signal goes the moment the marker appears, the first thing the set-up writes."""
    import os
    import signal
    import time

    from tests.cluster.conftest import free_port

    given = tmp_path / "given"
    given.mkdir(mode=0o751)
    os.chmod(given, 0o751)
    for state in (tmp_path / "new", given):
        proc = subprocess.Popen([*LUBAN, "cluster", "serve", "--state", str(state), "--port", str(free_port()),
                                 "--run-jobs-as", "service"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env())
        deadline = time.monotonic() + 120
        while not (state / ".luban").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.0005)
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate(timeout=30)  # a child still holding the pipe fails the test, not hangs it
        err = err.decode(errors="replace")
        assert proc.returncode == 143 and "Traceback" not in err, (state, proc.returncode, err)
        if state == given:
            assert list(state.iterdir()) == [] and state.stat().st_mode & 0o7777 == 0o751
        else:
            assert not state.exists(), sorted(os.listdir(state))
