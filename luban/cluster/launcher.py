"""Per-node launcher: runs one node's part of a job, forwards signals, records the exit code.

``python -s -P -m luban.cluster.launcher --run-dir D --log F --env-file E [--rank R] [--tag T] [--max-log B]
-- CMD...`` starts CMD with the environment in E (``write_env``) and ``LUBAN_NODE_RANK=R`` set, appends its
output to F (read through a pipe: at most B bytes of log, ``luban.cluster.joblog``), and writes
D/rank<R>.exit when CMD ends, so the service can read the result even after a restart. With no --rank the
rank is Slurm's SLURM_NODEID.

The launcher runs as the service's account (root when jobs run as per-user accounts) and only CMD gets
the job's environment and working directory, after it became the job's account: the launcher itself
starts in ``/`` with ``launcher_env()`` only, no user site and not the working directory on ``sys.path``
(``LAUNCHER_PYTHON``). Started with the job's, a job ran code as root (a
``luban/`` package in its workdir, ``PYTHONPATH``, ``LD_PRELOAD``: a review of 2026-12-04).

The job's processes are one unit (``luban.procs``): CMD runs in a session of its own, inside the
job's cgroup v2 where one can be made (entered before CMD executes, so nothing escapes it), and
with ``LUBAN_JOB_TAG`` in its environment. Signals:

- SIGUSR1 and SIGINT are forwarded to CMD's process group (suspend: CMD checkpoints, exits 75), and the
  log says so (`== luban: SIGUSR1 forwarded to the job HH:MM:SS ==`);
- SIGTERM means *kill this job*: every process of it is killed (cgroup, process group, tag
  sweep) and the launcher exits 137 once none is left — the executors' kill path, local and
  Slurm (``scancel`` sends SIGTERM first);
- handlers are installed before CMD starts: a signal during start-up is delivered, not lost.

When CMD ends, whatever it left behind (daemons, orphaned ranks) is killed before the exit file
is written: when a job's exit is recorded, nothing of it runs on this node.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path

from luban import jobenv, procs
from luban.cluster import accounts, jobcheck, jobguard, joblog
from luban.train import preempt

FORWARDED = (signal.SIGUSR1, signal.SIGINT)
# no user site, not the working directory on sys.path (Python 3.11's -P), then the module; the environment
# is ``launcher_env``'s alone (``-I`` would drop the service's own PYTHONPATH, where luban is not installed)
LAUNCHER_PYTHON = ("-s", "-P", "-m")
# the job's umask: nothing for other accounts (a job's files, its home's: another user's job read them), all
# for its group (a group's shared directory is setgid 2770; luban's accounts each have a primary group of
# their own, ``useradd --user-group``)
JOB_UMASK = 0o007
NO_ACCOUNT = "-"  # --user of a job whose luban user has no OS account where jobs run as per-user accounts
                  # (the first start's admin): it does not start (not a valid account name: never one)
JOB_SIGNALS = preempt.HANDLED  # FORWARDED + SIGTERM: what the launcher handles, and holds until it can
EXIT_KILLED = 128 + int(signal.SIGKILL)  # what the job got: kill_job sends SIGKILL


def exit_file(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank{rank}.exit"


def ended_at(run_dir: Path, ranks: int) -> float | None:
    """When the attempt ended on its nodes: the newest of its ranks' exit files' modification times
    (each written once, after all of its rank's processes died), or None while one is missing."""
    try:
        return max(exit_file(run_dir, rank).stat().st_mtime for rank in range(ranks))
    except (OSError, ValueError):
        return None


def pgid_file(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank{rank}.pgid"


def started_at(run_dir: Path, ranks: int) -> float | None:
    """When the attempt's job began on its nodes: the oldest of its ranks' pgid files' modification
    times (each written once, when its rank started the job), or None while none is there."""
    times = []
    for rank in range(ranks):
        try:
            times.append(pgid_file(run_dir, rank).stat().st_mtime)
        except OSError:
            pass
    return min(times, default=None)


ENV_FILE = "job.env.json"  # in a run dir: the attempt's environment (its token too: the service's alone, 0600)


def launcher_env(**extra: str) -> dict[str, str]:
    """The launcher's own environment: ``jobenv.MINIMAL``, the service's own ``PYTHONPATH`` (where it found
    luban: the admin's, as the service's own code) and ``extra``; nothing of the job's."""
    own = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
    return {**jobenv.MINIMAL, **own, **extra}


def write_env(run_dir: Path, env: dict[str, str]) -> Path:
    """The job's environment into ``run_dir/ENV_FILE``, readable by the service's account only."""
    path = Path(run_dir) / ENV_FILE
    tmp = path.with_name(f".{ENV_FILE}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(env, f)
    os.replace(tmp, path)
    return path


def read_env(path: Path) -> dict[str, str]:
    with open(path) as f:
        env = json.load(f)
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError(f"{path}: not an environment (a JSON object of strings)")
    return env


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="luban.cluster.launcher")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--log", required=True, help="log file; {rank} is replaced by the rank")
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--tag", default=None, help="the job's tag (LUBAN_JOB_TAG of CMD and its descendants)")
    parser.add_argument("--env-file", type=Path, default=None,
                        help="CMD's environment (write_env); without it, this process's own (tests' launchers)")
    parser.add_argument("--user", default=None, help="run CMD as this OS account (the launcher must be root)")
    parser.add_argument("--hide", action="append", default=[], metavar="DIR",
                        help="run CMD in namespaces where DIR is covered (jobguard; repeatable)")
    parser.add_argument("--max-log", type=int, default=joblog.MAX_LOG, metavar="BYTES",
                        help="bytes of the rank's log file (all attempts), past which CMD's output is dropped")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.hide:
        jobguard.undumpable()  # the job must not reach the uncovered tree through /proc/<launcher>
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    rank = args.rank if args.rank is not None else int(os.environ.get("SLURM_NODEID", "0"))
    args.run_dir.mkdir(parents=True, exist_ok=True)
    try:  # (Slurm's variables, and LUBAN_NODE on a local node, are this process's own)
        env = {**os.environ, **(read_env(args.env_file) if args.env_file else {}), jobenv.NODE_RANK: str(rank)}
    except (OSError, ValueError) as err:
        print(f"luban.cluster.launcher: cannot read the job's environment: {err}", file=sys.stderr)
        write_atomic(exit_file(args.run_dir, rank), "126")
        return 126
    env.setdefault("LUBAN_NODE", env.get("SLURMD_NODENAME", "?"))
    # the tag goes into CMD's environment only: the launcher itself and what started it (srun, the
    # batch script) are not the job's processes and must survive the sweep
    # per node: on virtual nodes sharing one host, one node's sweep must not reach another's part
    tag = env[procs.TAG_VAR] = node_tag(args.tag or f"luban-{env.get('LUBAN_JOB_ID', '?')}-{os.getpid()}", rank)
    log_path = Path(args.log.format(rank=rank))
    log_path.parent.mkdir(parents=True, exist_ok=True)

    state = {"child": None, "pending": [], "kill": False, "log": None}

    def on_signal(signum, _frame):
        if signum == signal.SIGTERM:
            state["kill"] = True
        child = state["child"]
        if child is None:
            state["pending"].append(signum)
        elif signum != signal.SIGTERM:
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                return
            log = state["log"]
            if log is not None and not log.closed:  # the job's log says when it was asked (unbuffered: no lock)
                log.write(f"== luban: {signal.Signals(signum).name} forwarded to the job "
                          f"{time.strftime('%H:%M:%S')} ==\n".encode())

    for sig in JOB_SIGNALS:
        signal.signal(sig, on_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, JOB_SIGNALS)  # held since spawn()
    cgroup = procs.make_cgroup(tag)

    with open(log_path, "ab", buffering=0) as log:
        state["log"] = log
        account = args.user or ("the service's account, in namespaces hiding the service's state" if args.hide else f"{pwd.getpwuid(os.geteuid()).pw_name} (the service's own account: the job can "
                                "read the service's state; share it only with users you trust)")
        log.write(f"== luban: job {env.get('LUBAN_JOB_ID', '?')} rank {rank} started "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')} on {env.get('LUBAN_NODE', '?')} as {account} ==\n".encode())
        who = None
        if args.user == NO_ACCOUNT:  # it would run as this launcher's account: root
            log.write(b"== luban: cannot start the job: its user has no OS account to run it as (jobs run as "
                      b"per-user OS accounts here, never as root); submit it as a user an admin added ==\n")
            write_atomic(exit_file(args.run_dir, rank), "126")
            return 126
        if args.user:
            try:
                who = accounts.identity(args.user)
                if os.geteuid() != 0:
                    raise PermissionError("the launcher is not root")
                env.update(who.env())
            except (KeyError, PermissionError) as err:
                log.write(f"== luban: cannot run as {args.user}: {err} ==\n".encode())
                write_atomic(exit_file(args.run_dir, rank), "126")
                return 126
            # before anything of the job starts: a command its account cannot reach fails here in
            # one line that names the path and the fix, not as exec's bare "Permission denied"
            try:
                why = jobcheck.problem(command[0], env, env.get("LUBAN_WORKDIR") or None, who) if command else None
            except Exception as err:  # noqa: BLE001 - a fault of the check must not stop a job: exec decides
                log.write(f"== luban: could not check the command ({err!r}); starting it anyway ==\n".encode())
                why = None
            if why is not None:
                log.write(f"== luban: cannot start {command[:1]}: {why} ==\n".encode())
                write_atomic(exit_file(args.run_dir, rank), "127")
                return 127
        if state["kill"]:
            code = EXIT_KILLED
        else:
            try:
                block = speaks_suspend(command)

                workdir = env.get("LUBAN_WORKDIR") or None

                def prepare():  # between fork and exec: nothing of the job starts outside its cgroup
                    procs.enter_cgroup(cgroup)
                    os.umask(JOB_UMASK)
                    if who is not None:
                        who.become()
                    no_new_privileges()
                    if args.hide:
                        try:
                            jobguard.enter(args.hide, workdir)  # (it enters the working directory, after the cover)
                        except OSError as err:
                            jobguard.fail(str(err) if err.errno else err.strerror)  # GuardError(0, why): no "[Errno 0]"
                    else:
                        enter_workdir(workdir)
                    if block:  # luban's trainer unblocks them once its handlers are in
                        signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)

                # CMD writes into a pipe, the pump copies it into the log up to --max-log (joblog):
                # the read end is not inherited (os.pipe), so it closes only with this launcher
                out, into = os.pipe()
                try:
                    # no cwd=: Popen's child enters it before preexec_fn, as root (a workdir through a link the
                    # job swapped after its check entered a folder the account cannot reach); prepare does, as it
                    child = subprocess.Popen(command, stdout=into, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True, preexec_fn=prepare)
                except BaseException:
                    os.close(out)
                    raise
                finally:
                    os.close(into)
                pump = joblog.Pump(out, log, args.max_log).start()
            except OSError as err:
                log.write(f"== luban: cannot start {command[:1]}: {err} ==\n".encode())
                procs.kill_job(tag)
                write_atomic(exit_file(args.run_dir, rank), "127")
                return 127
            write_atomic(pgid_file(args.run_dir, rank), str(child.pid))
            state["child"] = child
            for signum in state["pending"]:  # arrived while CMD was starting
                on_signal(signum, None)
            code = _wait(child, state)
        survivors = procs.kill_job(tag, (child.pid,) if state["child"] else ())
        if state["child"]:
            pump.join()  # every writer is dead: the job's last output goes before the lines below
        if survivors:
            log.write(f"== luban: could not kill {survivors} of job tag {tag} ==\n".encode())
        if state["kill"]:
            code = EXIT_KILLED
            log.write(f"== luban: rank {rank} killed (all processes of the job ended) ==\n".encode())
        else:
            log.write(f"== luban: rank {rank} exited with code {code} ==\n".encode())
    write_atomic(exit_file(args.run_dir, rank), str(code))
    return code


PR_SET_NO_NEW_PRIVS = 38  # <linux/prctl.h>
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here, not between fork and exec
EXIT_NO_WORKDIR = 127  # as a command that cannot be started


def no_new_privileges() -> None:
    """In the job's process before exec: no setuid/setgid bit nor file capability gives it (or any
    descendant) more than its account has. A user removed from a group kept the group through a setgid
    copy of python it had made while a member (a review of 2026-12-04)."""
    if _LIBC.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)):
        os.write(1, b"== luban: cannot start the job: prctl(PR_SET_NO_NEW_PRIVS) failed ==\n")
        os._exit(EXIT_NO_WORKDIR)


def enter_workdir(workdir: str | None) -> None:
    """In the job's process before exec, as the job's account: its working directory (``/`` without one)."""
    try:
        os.chdir(workdir or "/")
    except OSError as err:
        os.write(1, f"== luban: cannot start the job: cannot enter the working directory {workdir}: "
                    f"{err.strerror} ==\n".encode())
        os._exit(EXIT_NO_WORKDIR)


def spawn(argv: list[str], **popen) -> subprocess.Popen:
    """Start a launcher (``python -m luban.cluster.launcher ...``) with its signals held until its
    handlers are installed: a suspend or kill sent at once is delivered late, never lost or fatal."""
    signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)  # this thread only
    try:
        return subprocess.Popen([sys.executable, *LAUNCHER_PYTHON, "luban.cluster.launcher", *argv], **popen)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, JOB_SIGNALS)


def node_tag(job_tag: str, rank: int) -> str:
    """The tag of the job's processes on node ``rank`` (LUBAN_JOB_TAG, cgroup name)."""
    return f"{job_tag}.{rank}"


def speaks_suspend(command: list[str]) -> bool:
    """``luban train|demo ...`` or ``python -m luban train|demo ...``: a command that installs the
    suspend handlers itself (``luban.train.preempt.install``), so it can start with the signals
    blocked and a SIGUSR1 during its start-up is held for it instead of killing it."""
    for i, word in enumerate(command[:3]):
        if Path(word).name == "luban" and command[i + 1:i + 2] in (["train"], ["demo"]):
            return True
    return False


def _wait(child: subprocess.Popen, state: dict) -> int:
    """CMD's exit code (128 + signal for a signal); on SIGTERM, stop waiting: the caller kills all."""
    while True:
        try:
            code = child.wait(timeout=0.2)
            return 128 - code if code < 0 else code
        except subprocess.TimeoutExpired:
            if state["kill"]:
                return EXIT_KILLED


if __name__ == "__main__":
    exit_code = main()
    preempt.settle()  # the exit file is written: late signals change nothing
    sys.exit(exit_code)
