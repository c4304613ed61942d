"""The platform as an untrusted user attacks it, a hostile review of 2026-12-04.

- The root launcher started with the job's environment and in the job's working directory:
  ``python -m`` put that directory first on ``sys.path`` (a ``luban/`` package there ran as root),
  and ``PYTHONPATH``/``LD_PRELOAD`` applied to root; under Slurm sbatch, the batch script (``BASH_ENV``)
  and the launchers did too. The launcher starts isolated now, in ``/``, with nothing of the job's;
  the job's environment reaches only its command (``launcher --env-file``).
- Every job started from the service's own environment (the admin's shell: a ``PGPASSWORD``, a key).
- The first start's ``admin`` has no OS account: its jobs ran as root where jobs run as per-user accounts.
- Homes were 755 and jobs' umask 022: another user's job read them.
- A SQLite ``--db`` outside ``--state`` was 0644 (every spec's environment readable), and two services
  on one such file both ran (jobs started by the other, logs in its state); a ``--db`` password on the
  command line was in every job's ``ps``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from luban import jobenv
from luban.cluster import launcher
from luban.cluster.executors import Launch
from luban.cluster.executors.local import LocalExecutor
from tests.cluster.conftest import LUBAN, wait_for

EVIL = 'import os, sys\nopen(os.environ.get("PWNED_AT", "/dev/null"), "w").write(str(os.geteuid()))\n'


def _planted(tmp_path: Path) -> Path:
    """A folder with a ``luban`` package that records who imported it (the workdir a job names)."""
    evil = tmp_path / "evil"
    (evil / "luban").mkdir(parents=True)
    (evil / "luban" / "__init__.py").write_text(EVIL.replace('os.environ.get("PWNED_AT", "/dev/null")',
                                                             repr(str(tmp_path / "pwned"))))
    return evil


def test_the_launcher_runs_nothing_of_the_jobs_environment_or_workdir(tmp_path):
    evil = _planted(tmp_path)
    run_dir = tmp_path / "runs" / "1"
    env = {**jobenv.MINIMAL, "PYTHONPATH": str(evil), "PYTHONSTARTUP": str(evil / "luban" / "__init__.py"),
           "LUBAN_WORKDIR": str(evil), "LUBAN_JOB_ID": "1", "MY_SETTING": "kept"}
    launch = Launch(job_id=1, name="luban-1-isolated", nodes=["node1"], env=env, run_dir=str(run_dir),
                    command=["/bin/sh", "-c", 'pwd; echo "setting=$MY_SETTING path=$PYTHONPATH"; umask'],
                    log_pattern=str(tmp_path / "rank{rank}.log"), workdir=str(evil))
    executor = LocalExecutor(nodes=1)
    handle = executor.start(launch)
    wait_for(lambda: executor.poll(handle).done, 60, what="the job's end")
    log = (tmp_path / "rank0.log").read_text()
    assert not (tmp_path / "pwned").exists(), "the launcher imported the job's luban package"
    lines = log.splitlines()
    assert str(evil) in lines and f"setting=kept path={evil}" in lines, log  # the job's own, as given
    assert "0007" in lines, log  # the job's umask (launcher.JOB_UMASK)
    env_file = run_dir / launcher.ENV_FILE
    assert os.stat(env_file).st_mode & 0o777 == 0o600 and json.loads(env_file.read_text())["MY_SETTING"] == "kept"


def test_sbatch_gets_nothing_of_the_jobs_environment(tmp_path, monkeypatch):
    """sbatch, the batch script (``BASH_ENV``) and the launchers run as the service's account."""
    from luban.cluster.executors import slurm

    seen = {}

    def fake_run(argv, **kwargs):
        seen.update(argv=argv, env=kwargs.get("env"))
        return subprocess.CompletedProcess(argv, 0, "4242\n", "")

    monkeypatch.setattr(slurm.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(slurm.subprocess, "run", fake_run)
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/other.conf")
    evil = _planted(tmp_path)
    run_dir = tmp_path / "runs" / "2"
    launch = Launch(job_id=2, name="luban-2-sbatch", nodes=["node1"], command=["/bin/true"], workdir=str(evil),
                    env={**jobenv.MINIMAL, "BASH_ENV": str(evil / "x.sh"), "LD_PRELOAD": "/x.so",
                         "LUBAN_WORKDIR": str(evil)},
                    run_dir=str(run_dir), log_pattern=str(tmp_path / "rank{rank}.log"))
    slurm.SlurmExecutor(state_dir=str(tmp_path)).start(launch)
    assert seen["env"] == {**launcher.launcher_env(), "SLURM_CONF": "/etc/slurm/other.conf"}
    assert f"--chdir={run_dir}" in seen["argv"]
    script = (run_dir / slurm.SCRIPT).read_text()
    assert " -s -P -m luban.cluster.launcher " in script and f"--env-file {run_dir / launcher.ENV_FILE}" in script
    assert json.loads((run_dir / launcher.ENV_FILE).read_text())["BASH_ENV"] == str(evil / "x.sh")


def test_a_job_starts_from_a_minimal_environment_not_the_services(monkeypatch):
    monkeypatch.setenv("PGPASSWORD", "the-admins-secret")
    assert jobenv.base_environment({}) == jobenv.MINIMAL
    assert jobenv.base_environment({"env_only": True}) == jobenv.MINIMAL
    assert "LUBAN_CLUSTER_DB" not in jobenv.inheritable({"LUBAN_CLUSTER_DB": "postgresql://a:b@h/d"})


def test_a_second_service_on_one_sqlite_file_is_refused_and_the_file_is_private(service, tmp_path):
    db = tmp_path / "shared" / "x.db"
    db.parent.mkdir()
    service("--nodes", "1", "--db", f"sqlite:///{db}")
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in db.parent.iterdir()}[db.name] == "0o600"
    proc = subprocess.run([*LUBAN, "cluster", "serve", "--state", str(tmp_path / "other"), "--port", "1",
                           "--db", f"sqlite:///{db}", "--run-jobs-as", "service"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().endswith(
        "in use by another luban cluster serve; stop it first, or choose another --db"), proc.stderr
    assert not (tmp_path / "other").exists()


root = pytest.mark.skipif(os.geteuid() != 0, reason="per-user OS accounts need the service to run as root")


@root
def test_a_db_password_on_the_command_line_is_refused_where_jobs_run_as_users(tmp_path):
    proc = subprocess.run([*LUBAN, "cluster", "serve", "--state", str(tmp_path / "s"), "--run-jobs-as", "user",
                           "--db", "postgresql://alice:s3cret@127.0.0.1:9/x"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "s3cret" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("luban: error: --db = 'postgresql://alice:PASSWORD@127.0.0.1:9/x': no password "
                                  "on the command line here"), proc.stderr
    assert not (tmp_path / "s").exists()


@root
def test_per_user_jobs_private_homes_and_files_no_service_environment_admin_refused(service, tmp_path):
    from luban.cluster.client import Client
    from luban.errors import LubanError
    import pwd
    import secrets

    from luban.cluster import accounts

    svc = service("--nodes", "1", "--tick", "0.2", "--run-jobs-as", "user")
    with pytest.raises(LubanError, match=r"^user = 'admin': a user with an OS account to run jobs as.*\(HTTP 403\)$"):
        svc.admin().submit({"name": "as-root", "command": "/usr/bin/id"})
    name = f"tr{secrets.token_hex(3)}"
    token = svc.admin().add_user(name)["token"]
    try:
        svc.admin().set_quota(f"user:{name}", "NORMAL", 1)
        user = Client(svc.url, token)
        job = user.submit({"name": "modes", "command": "/bin/sh", "args": [
            "-c", 'cd "$HOME" && touch made && stat -c "%a" made "$HOME"; env']})["id"]
        assert user.wait(job, timeout=60)["state"] == "succeeded"
        log = user.logs(job)["text"].splitlines()
        assert log[1:3] == ["660", "700"], log
        assert not [line for line in log if line.startswith(("PYTEST_", "VIRTUAL_ENV="))], log  # the service's own
        home = pwd.getpwnam(accounts.account_for(name)).pw_dir
        assert os.stat(home).st_mode & 0o777 == 0o700
    finally:
        account = accounts.account_for(name)
        subprocess.run(["pkill", "-KILL", "-u", account], capture_output=True, timeout=300)
        wait_for(lambda: subprocess.run(["userdel", "--remove", account], capture_output=True, timeout=300)
                 .returncode in (0, 6), 30, what=f"userdel {account}")


def test_a_group_members_job_environment_values_are_hidden_from_the_group(in_process):
    """``--export ALL`` sends the submitter's environment (an HF_TOKEN); every member of its group read it in
    ``GET /api/jobs`` and ``/api/jobs/ID``. They see the names now, the owner and admins the values."""
    api = in_process()
    assert api.http.post("/api/groups", json={"name": "vis"}, headers=api.admin).status_code == 201
    quota = {"owner": "group:vis", "priority": "NORMAL", "nodes": 1}
    assert api.http.put("/api/quota", json=quota, headers=api.admin).status_code == 200
    ann, bob = api.user("ann", 1, group="vis"), api.user("bob", 1, group="vis")
    spec = {"name": "j", "command": "true", "group": "vis", "env": {"HF_TOKEN": "hf_secret", "SEED": "1"}}
    r = api.http.post("/api/jobs", json={"spec": spec}, headers={"Authorization": f"Bearer {ann}"})
    assert r.status_code == 201, r.text
    job = r.json()["id"]
    seen = {who: api.http.get(f"/api/jobs/{job}", headers={"Authorization": f"Bearer {token}"}).json()["spec"]["env"]
            for who, token in (("ann", ann), ("bob", bob))}
    listed = api.http.get("/api/jobs", headers={"Authorization": f"Bearer {bob}"}).json()
    admin = api.http.get(f"/api/jobs/{job}", headers=api.admin).json()["spec"]["env"]
    assert seen["ann"] == admin == {"HF_TOKEN": "hf_secret", "SEED": "1"}
    assert seen["bob"] == {"HF_TOKEN": "(hidden: another user's)", "SEED": "(hidden: another user's)"}
    assert [j["spec"]["env"] for j in listed] == [seen["bob"]]


def test_a_second_service_on_anothers_default_database_is_refused(service, tmp_path):
    """The default STATE/luban.db was not locked: a service of another state naming it with --db started,
    answered with the first's admin token and marked its nodes gone."""
    first = service("--nodes", "1")
    proc = subprocess.run([*LUBAN, "cluster", "serve", "--state", str(tmp_path / "other"), "--port", "1",
                           "--db", f"sqlite:///{first.state / 'luban.db'}", "--run-jobs-as", "service"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "in use by another luban cluster serve" in proc.stderr, proc.stderr


def test_a_groups_directory_may_not_be_in_the_state_nor_hold_it(in_process):
    api = in_process()
    for where in (api.state / "logs" / "g", api.state.parent):
        r = api.http.post("/api/groups", json={"name": "g1", "data_dir": str(where)}, headers=api.admin)
        assert r.status_code == 422 and "neither inside the service's state nor holding it" in r.text, r.text


def test_an_existing_folder_with_files_is_not_taken_for_a_groups_directory(tmp_path):
    """(2026-12-04) ``group add --data-dir /home/luban-bob`` made bob's home root:luban-g-X 2770."""
    from luban.cluster import accounts
    from luban.errors import LubanError

    home = tmp_path / "home"
    home.mkdir()
    (home / ".profile").write_text("bob's")
    with pytest.raises(LubanError, match=r"a new or empty directory \(it holds 1 entries"):
        accounts._open_dir("data_dir", str(home))
    os.close(accounts._open_dir("data_dir", str(tmp_path / "new" / "dir")))  # made: fine
    os.close(accounts._open_dir("data_dir", str(tmp_path / "new" / "dir")))  # empty: fine


@root
def test_the_job_enters_its_workdir_as_its_account_and_gains_no_privileges(tmp_path):
    """Popen(cwd=) entered the workdir as root, before the launcher became the job's account: a link the job
    swapped after the checks took it into a folder its account cannot reach (here the checks are skipped, as
    the race skipped them). And a setgid copy of a binary kept a removed member in its group: no new privileges."""
    import secrets

    closed = tmp_path / "closed"
    (closed / "sub").mkdir(parents=True)
    closed.chmod(0o700)
    (closed / "sub").chmod(0o755)
    account = f"luban-tw{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", account], check=True, timeout=60)
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        env = {**jobenv.MINIMAL, "LUBAN_WORKDIR": str(closed / "sub"), "LUBAN_JOB_ID": "7"}
        env_file = launcher.write_env(run_dir, env)
        code = ("import sys\nfrom luban.cluster import jobcheck, launcher\njobcheck.problem = lambda *a, **k: None\n"
                "sys.exit(launcher.main(sys.argv[1:]))")
        argv = ["--run-dir", str(run_dir), "--log", str(tmp_path / "rank{rank}.log"), "--rank", "0", "--env-file",
                str(env_file), "--user", account, "--", "/bin/sh", "-c", "pwd; grep NoNewPrivs /proc/self/status"]
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                              cwd="/")
        log = (tmp_path / "rank0.log").read_text()
        assert f"cannot enter the working directory {closed / 'sub'}: Permission denied" in log, (log, proc.stderr)
        assert (run_dir / "rank0.exit").read_text() == "127"
        env_file = launcher.write_env(run_dir, {**env, "LUBAN_WORKDIR": "/tmp"})
        (tmp_path / "rank0.log").unlink()
        subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, cwd="/")
        log = (tmp_path / "rank0.log").read_text()
        assert "/tmp\nNoNewPrivs:\t1\n" in log, log
    finally:
        subprocess.run(["userdel", account], capture_output=True, timeout=60)
