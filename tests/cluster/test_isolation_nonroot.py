"""The threat model for a NON-root service (docs/platform.md, luban/cluster/jobguard.py): the real
service runs as ``nobody`` with ``--run-jobs-as namespace``; real jobs attack its state and fail:
the admin token, the database, the state directory, the service's /proc entries (environ, root),
another job's environment. A normal job still runs, and ``luban train`` works inside one. How the
service runs as ``nobody`` at all (the system's interpreter, the code mirrored where needed):
tests/nobody.py."""

from __future__ import annotations

import tempfile
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from luban.cluster.client import Client
from tests.cluster.conftest import LUBAN, ROOT, Service, wait_for
from tests.conftest import tiny_toml
from tests.nobody import NOBODY, SYSTEM_PYTHON, UNAVAILABLE, VENV_SITE, code_paths

pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))
CODE, SITE = code_paths() if UNAVAILABLE is None else (ROOT, VENV_SITE)
JOB_ENV = {"PYTHONPATH": f"{CODE}:{SITE}", "PATH": "/usr/bin:/bin", "HOME": "/tmp"}


class NobodyService(Service):
    def start(self):
        self.state.mkdir(parents=True, exist_ok=True)
        shutil.chown(self.state, "nobody")
        cmd = [*NOBODY, "env", *[f"{k}={v}" for k, v in
               JOB_ENV.items()], str(SYSTEM_PYTHON), *LUBAN[1:]]
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([*cmd, "cluster", "serve", "--state", str(self.state), "--port",
                                          str(self.port), "--log-level", "info", *self.args],
                                         stdout=log, stderr=subprocess.STDOUT, cwd="/tmp")
        wait_for(self._up, 60, 0.2, f"service on {self.url} (log {self.log})")
        return self


@pytest.fixture
def svc():
    base = Path(tempfile.mkdtemp(prefix="luban-nonroot-"))
    base.chmod(0o755)
    service = NobodyService(base / "state", ["--nodes", "2", "--tick", "0.2", "--run-jobs-as", "namespace"])
    service.log = base / "service.log"
    service.start()
    yield service
    service.stop()
    subprocess.run(["pkill", "-KILL", "-u", "nobody", "-f", str(base)], capture_output=True, timeout=300)
    shutil.rmtree(base, ignore_errors=True)


def run(client: Client, script: str, timeout: float = 60) -> tuple[str, str]:
    job = client.submit({"name": "attack", "command": "/bin/sh", "args": ["-c", script], "env": JOB_ENV,
                         "workdir": "/tmp"})["id"]
    final = client.wait(job, timeout=timeout)
    return final["state"], client.logs(job)["text"]


def test_jobs_of_a_nonroot_service_cannot_reach_its_secrets(svc):
    token, alice = svc.user("alice", {"NORMAL": 2})
    service_pid = svc.proc.pid  # setpriv and env exec: this is the service's python
    state, log = run(alice, f"id -u; cat {svc.state}/admin.token || echo DENIED-TOKEN; "
                            f"cat {svc.state}/luban.db > /dev/null || echo DENIED-DB; "
                            f"ls {svc.state} && echo LISTED-$(ls {svc.state} | wc -l); "
                            f"cat /proc/{service_pid}/environ || echo DENIED-ENVIRON; "
                            f"cat /proc/{service_pid}/root{svc.state}/admin.token || echo DENIED-ROOT; "
                            f"umount {svc.state} || echo DENIED-UMOUNT; "
                            f"unshare -Urm sh -c 'umount {svc.state} && cat {svc.state}/admin.token' || echo DENIED-NS")
    assert state == "succeeded", log
    assert log.splitlines()[1] == "65534", log  # nobody, not root in any namespace that matters
    for word in ("TOKEN", "DB", "ENVIRON", "ROOT", "UMOUNT", "NS"):
        assert f"DENIED-{word}" in log, (word, log)
    assert "LISTED-0" in log or "LISTED" not in log, log
    assert svc.admin_token not in log
    notice = [line for line in svc.log.read_text().splitlines() if line.startswith("luban cluster: not root:")]
    assert len(notice) == 1 and str(svc.state) in notice[0] and "read-only" in notice[0], notice
    # outside any namespace, as the service's own uid: undumpable, so its /proc entries stay closed
    peek = subprocess.run([*NOBODY, "cat",
                           f"/proc/{service_pid}/environ"], capture_output=True, timeout=300)
    assert peek.returncode != 0 and b"Permission denied" in peek.stderr, peek


def test_a_job_cannot_see_another_jobs_processes_and_a_normal_job_trains(svc, tmp_path):
    token, alice = svc.user("alice", {"NORMAL": 2})
    sleeper = alice.submit({"name": "sleeper", "command": "/bin/sh", "args": ["-c", "sleep 600"], "env": JOB_ENV,
                            "workdir": "/tmp"})["id"]
    wait_for(lambda: alice.job(sleeper)["state"] == "running", 60, what="sleeper running")
    pids = wait_for(lambda: subprocess.run(["pgrep", "-u", "nobody", "-x", "sleep"], capture_output=True,
                                           text=True, timeout=300).stdout.split(), 30, what="the sleeper's process")
    state, log = run(alice, f"cat /proc/{pids[0]}/environ || echo DENIED-ENVIRON; ls /proc | grep -c '^[0-9]'")
    assert "DENIED-ENVIRON" in log and "LUBAN_CLUSTER_TOKEN" not in log, log
    alice.stop(sleeper)
    work = Path(tempfile.mkdtemp(prefix="luban-nonroot-train-"))
    shutil.chown(work, "nobody")
    cfg = work / "train.toml"
    cfg.write_text(tiny_toml(work / "run", {"steps": 5, "global_batch": 2, "log_every": 1, "checkpoint_every": 0,
                                            "eval_every": 0}, run_keys={"system": "dgx-a100-80g"}))
    job = alice.submit({"name": "train", "command": str(SYSTEM_PYTHON), "args": ["-m", "luban", "train", str(cfg)],
                        "env": JOB_ENV, "workdir": str(work)})["id"]
    final = alice.wait(job, timeout=300)
    text = alice.logs(job)["text"]
    shutil.rmtree(work, ignore_errors=True)
    assert final["state"] == "succeeded", text[-2000:]


def test_a_job_that_could_reach_a_secret_does_not_start(tmp_path):
    """The job-side check: a secret the cover does not hide (here a file: the guard covers
    directories only) makes the launcher refuse: exit 126, one line in the job's log, no run."""
    secret = tmp_path / "secrets"
    secret.mkdir()
    (secret / "admin.token").write_text("x")
    code = subprocess.run([sys.executable, "-c", "from luban.cluster import jobguard; "
                           f"print(jobguard.reachable([{str(secret)!r}]))"], capture_output=True, text=True, timeout=300)
    assert code.stdout.strip() == str(secret)
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "luban.cluster.launcher", "--run-dir", str(run_dir), "--log",
                             str(tmp_path / "log"), "--rank", "0", "--hide", str(secret / "admin.token"), "--",
                             "/bin/sh", "-c", f"touch {tmp_path}/ran"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 126 and (run_dir / "rank0.exit").read_text() == "126"
    lines = [line for line in (tmp_path / "log").read_text().splitlines() if "isolation failed" in line]
    assert len(lines) == 1 and "admin.token is still readable" in lines[0], lines
    assert not (tmp_path / "ran").exists()


def _state_folder_of_nobody(prefix: str) -> tuple[Path, Path]:
    """A fresh base folder (world-readable) holding ``state/admin.token``, all owned by nobody."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    base.chmod(0o755)
    secret = base / "state"
    secret.mkdir()
    (secret / "admin.token").write_text("TOKEN-SECRET")
    for p in (base, secret, secret / "admin.token"):
        shutil.chown(p, "nobody")
    return base, secret


def test_no_bypass_through_the_inherited_working_directory_and_the_code_is_read_only(tmp_path):
    """A job with no workdir started by a service whose working directory is its state folder
    (``--state .``): the launcher's cwd is taken before the cover, so the job must be moved by path
    after it, or ``cat admin.token`` reads the token. And a job cannot rewrite the code or the
    Python environment the service runs (its next start would run the job's code)."""
    base, secret = _state_folder_of_nobody("luban-nonroot-cwd-")
    try:
        script = (f"cat admin.token || echo DENIED-REL; touch {CODE}/luban/pwned || echo DENIED-CODE; "
                  f"touch {SITE}/pwned || echo DENIED-SITE; pwd")
        env = {**JOB_ENV, "PATH": "/usr/bin:/bin"}
        result = subprocess.run([*NOBODY, "env", *[f"{k}={v}" for k, v in env.items()], str(SYSTEM_PYTHON), "-m",
                                 "luban.cluster.launcher", "--run-dir", str(base / "run"), "--log", str(base / "log"),
                                 "--rank", "0", "--hide", str(secret), "--", "/bin/sh", "-c", script],
                                capture_output=True, text=True, cwd=secret, timeout=300)
        log = (base / "log").read_text()
        assert result.returncode == 0, (result, log)
        assert "TOKEN-SECRET" not in log and "DENIED-REL" in log, log
        assert "DENIED-CODE" in log and "DENIED-SITE" in log, log
        assert not (Path(CODE) / "luban" / "pwned").exists() and not (Path(SITE) / "pwned").exists()
        assert log.splitlines()[-2] == "/", log  # moved by path to /, not left in the covered folder
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_workdir_inside_a_hidden_folder_refuses_to_start():
    """A job whose workdir lies in the state folder (a careless or hostile spec) does not start
    (it would sit in the empty cover): one line in its log, exit 126, nothing ran."""
    base, secret = _state_folder_of_nobody("luban-nonroot-wd-")
    try:
        env = {**JOB_ENV, "LUBAN_WORKDIR": str(secret)}
        result = subprocess.run([*NOBODY, "env", *[f"{k}={v}" for k, v in env.items()], str(SYSTEM_PYTHON), "-m",
                                 "luban.cluster.launcher", "--run-dir", str(base / "run"), "--log", str(base / "log"),
                                 "--rank", "0", "--hide", str(secret), "--", "/bin/sh", "-c",
                                 f"cat admin.token; touch {base}/ran"], capture_output=True, text=True, cwd="/tmp", timeout=300)
        log = (base / "log").read_text()
        assert result.returncode == 126, (result, log)
        lines = [line for line in log.splitlines() if "isolation failed" in line]
        assert len(lines) == 1 and "lies in a hidden folder" in lines[0], log
        assert "TOKEN-SECRET" not in log and not (base / "ran").exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)
