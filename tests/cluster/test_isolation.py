"""The threat model, attack by attack (docs/platform.md): with the service as root, each user's
jobs run as that user's own OS account, so a job cannot read the service's state (admin token,
database), another user's files or another job's environment (its token), while members of a
group share the group's directory. Accounts made here are named luban-t<hex> and removed."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from luban.cluster import accounts
from tests.cluster.conftest import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="per-user OS accounts need the service to run as root")


@pytest.fixture
def users(service):
    """A root service running jobs as per-user accounts; names of luban users are random."""
    svc = service("--nodes", "3", "--tick", "0.2", "--run-jobs-as", "user")
    made: list[str] = []
    public = Path(tempfile.mkdtemp(prefix="luban-iso-"))
    public.chmod(0o755)  # job accounts may read the scripts' folder; pytest's tmp_path is root's alone

    def add(prefix: str, group: str | None = None):
        name = f"t{prefix}{secrets.token_hex(3)}"
        token = svc.admin().add_user(name, group=group)["token"]
        made.append(name)
        svc.admin().set_quota(f"user:{name}", "NORMAL", 1)
        from luban.cluster.client import Client

        return name, Client(svc.url, token)

    yield svc, add, public
    for name in made:  # a job still ending would make userdel refuse: end the account's processes first
        subprocess.run(["pkill", "-KILL", "-u", accounts.account_for(name)], capture_output=True, timeout=300)
        account = accounts.account_for(name)
        wait_for(lambda: subprocess.run(["userdel", "--remove", account], capture_output=True, timeout=300) and
                 account not in subprocess.run(["getent", "passwd"], capture_output=True, text=True, timeout=300).stdout,
                 30, what=f"userdel {account}")
    for g in ("tg",):
        subprocess.run(["groupdel", accounts.unix_group(g + svc.state.name[-6:])], capture_output=True, timeout=300)
    shutil.rmtree(public, ignore_errors=True)


def run(client, name: str, script: str, nodes: int = 1) -> str:
    job = client.submit({"name": name, "command": "/bin/sh", "args": ["-c", script]})["id"]
    final = client.wait(job, timeout=60)
    return final["state"], client.logs(job)["text"]


def test_jobs_run_as_their_users_account_and_cannot_read_the_services_state(users):
    svc, add, _ = users
    name, alice = add("a")
    assert alice.call("GET", "/whoami")["user"] == name
    state, log = run(alice, "peek", f"id -un; cat {svc.state}/admin.token || echo DENIED-TOKEN; "
                                    f"cat {svc.state}/luban.db > /dev/null || echo DENIED-DB; "
                                    f"ls {svc.state} || echo DENIED-LIST")
    assert state == "succeeded", log
    assert accounts.account_for(name) in log.splitlines()[1]
    assert "DENIED-TOKEN" in log and "DENIED-DB" in log and "DENIED-LIST" in log
    assert svc.admin_token not in log
    assert oct(os.stat(svc.state).st_mode & 0o777) == "0o700"


def test_a_job_cannot_read_another_users_files_or_job_environment(users):
    svc, add, _ = users
    a, alice = add("a")
    b, bob = add("b")
    home = pwd.getpwnam(accounts.account_for(a)).pw_dir
    assert run(alice, "write", "echo private > $HOME/secret.txt && chmod 600 $HOME/secret.txt")[0] == "succeeded"
    sleeper = alice.submit({"name": "sleeper", "command": "/bin/sh", "args": ["-c", "sleep 600"]})["id"]
    wait_for(lambda: alice.job(sleeper)["state"] == "running", 60, what="alice's job running")
    pids = wait_for(lambda: subprocess.run(["pgrep", "-u", accounts.account_for(a), "sleep"], capture_output=True,
                                           text=True, timeout=300).stdout.split(), 30, what="alice's sleep process")
    state, log = run(bob, "steal", f"cat {home}/secret.txt || echo DENIED-FILE; "
                                  f"cat /proc/{pids[0]}/environ || echo DENIED-ENVIRON")
    assert "DENIED-FILE" in log and "DENIED-ENVIRON" in log and "LUBAN_CLUSTER_TOKEN" not in log
    alice.stop(sleeper)


def test_group_members_share_the_groups_directory_others_do_not(users):
    svc, add, public = users
    group = "tg" + svc.state.name[-6:]
    shared = public / "shared"
    svc.admin().add_group(group, data_dir=str(shared))
    a, alice = add("a", group)
    c, carol = add("c", group)
    b, bob = add("b")
    assert run(alice, "put", "echo hello > $LUBAN_GROUP_DATA_DIR/note.txt")[0] == "succeeded"
    state, log = run(carol, "get", "cat $LUBAN_GROUP_DATA_DIR/note.txt")
    assert state == "succeeded" and "hello" in log
    state, log = run(bob, "get", f"cat {shared}/note.txt || echo DENIED")
    assert "DENIED" in log and "hello" not in log


def test_a_job_token_cannot_act_as_its_user(users):
    svc, add, _ = users
    name, alice = add("a")
    script = ("python3 - <<'EOF'\nimport json, os, urllib.request\n"
              "req = urllib.request.Request(os.environ['LUBAN_CLUSTER_URL'] + '/api/jobs', "
              "headers={'Authorization': 'Bearer ' + os.environ['LUBAN_CLUSTER_TOKEN']})\n"
              "try:\n    urllib.request.urlopen(req)\n    print('ALLOWED')\n"
              "except Exception as e:\n    print('REFUSED', getattr(e, 'code', e))\nEOF")
    state, log = run(alice, "escalate", script)
    assert "REFUSED 403" in log, log


def _closed_venv(public: Path) -> tuple[Path, Path]:
    """A venv-shaped environment (bin/python, a console script ``luban`` whose #! is it) inside a
    folder of mode 700 that only root can enter, like a venv under /root or a private home."""
    closed = public / "home"
    venv_bin = closed / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(os.path.realpath("/bin/sh"))
    tool = venv_bin / "luban"
    tool.write_text(f"#!{venv_bin}/python\necho STARTED-AS $(id -un)\n")
    tool.chmod(0o755)
    for d in (closed / "venv", venv_bin):
        d.chmod(0o755)
    closed.chmod(0o700)
    return closed, venv_bin


def test_a_command_the_account_cannot_reach_is_refused_at_submit_with_the_path_and_the_fix(users):
    """Was: accepted, queued, then `cannot start ['luban']: [Errno 13] Permission denied: 'luban'`
    (exit 127) in the job log. Now `luban submit` refuses it in one line; opened up (o+rx, the
    layout docs/platform.md gives), the same command runs."""
    from luban.errors import LubanError

    svc, add, public = users
    name, alice = add("a")
    closed, venv_bin = _closed_venv(public)
    spec = {"name": "env", "command": "luban", "env": {"PATH": f"{venv_bin}:/usr/bin:/bin"}}
    with pytest.raises(LubanError) as err:
        alice.submit(spec)
    message = str(err.value)
    assert "\n" not in message, message
    assert message.startswith(f"command = 'luban' (found at {venv_bin}/luban): the job's account "
                              f"{accounts.account_for(name)} lacks x on {closed} (drwx------ root:root)"), message
    assert "docs/platform.md" in message and "/opt" in message, message
    assert alice.jobs() == []  # nothing was queued
    with pytest.raises(LubanError, match=f"workdir = '{closed}': "):
        alice.submit({"name": "wd", "command": "/bin/true", "workdir": str(closed)})
    closed.chmod(0o755)
    job = alice.submit(spec)["id"]
    assert alice.wait(job, timeout=60)["state"] == "succeeded"
    assert f"STARTED-AS {accounts.account_for(name)}" in alice.logs(job)["text"]


def test_the_launcher_checks_the_command_before_it_starts_it(users, tmp_path):
    """Where the service cannot look (a Slurm node), or when the environment changed after submit,
    the node launcher makes the same check before the job's command starts: one line, exit 127."""
    svc, add, public = users
    name, _ = add("a")
    closed, venv_bin = _closed_venv(public)
    env = {**os.environ, "PATH": f"{venv_bin}:/usr/bin:/bin", "LUBAN_JOB_ID": "0"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                      os.environ.get("PYTHONPATH")]))
    log = tmp_path / "rank0.log"
    done = subprocess.run([sys.executable, "-m", "luban.cluster.launcher", "--run-dir", str(tmp_path), "--log", str(log),
                           "--rank", "0", "--tag", f"luban-check-{name}", "--user", accounts.account_for(name),
                           "--", "luban"], env=env, capture_output=True, text=True, timeout=120)
    text = log.read_text()
    assert done.returncode == 127 and (tmp_path / "rank0.exit").read_text() == "127", (done, text)
    line = next(line for line in text.splitlines() if "cannot start" in line)
    assert f"lacks x on {closed} (drwx------ root:root)" in line and "docs/platform.md" in line, text
    assert "Errno 13" not in text and "STARTED-AS" not in text, text
