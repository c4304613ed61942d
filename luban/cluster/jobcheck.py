"""Can a job's OS account start the job's command? Checked before the job counts as started.

With the service as root, each user's jobs run as that user's own account (``accounts.py``), and
the job's command must be reachable *by that account*: a Python environment under a home folder
of mode 700 (``~root/venv``, ``/home/me/.venv``) works for its owner and fails for every job with
``[Errno 13] Permission denied``. ``problem`` finds that before the job is queued (``luban submit``,
when the service's machine is where jobs run: the local executor) and again in the node launcher
before the command starts (any executor), and says in one line which path stops the account and
what to do about it.

What is checked, as the kernel and ``execvp`` would for the account's uid and groups:

- the command found on the job's ``PATH`` (the submitter's environment, as the job gets it) the way
  ``execvp`` searches: the first candidate the account can execute wins, a candidate it cannot
  reach is remembered and the search goes on (so a blocked copy earlier on PATH is no error if a
  later one works); a command with a ``/`` is taken as is (relative to ``workdir``);
- every directory on the way (symbolic links followed, their targets' directories too) searchable
  (``x``), the file a regular file with ``x`` for the account;
- a script (``#!``): readable by the account (its interpreter opens it), and its interpreter in
  turn (``#!/usr/bin/env NAME``: NAME on the job's PATH); a Python interpreter of a virtual
  environment also needs the environment's ``pyvenv.cfg`` readable and its ``lib`` readable and
  searchable, or it starts without the environment's packages;
- the job's ``workdir`` reachable and searchable.

The permissions are the mode bits (owner, group, other); POSIX ACLs and network file systems that
map root to nobody are not read, so a job they stop still fails at start, with the launcher's
"cannot start" line (and where the service itself is denied a look, the check says nothing).
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat

R, X = 4, 1
MAX_LINKS = 40  # the kernel's limit on symbolic links in one path resolution (ELOOP)
MAX_NESTING = 4  # interpreters of interpreters (the kernel's BINPRM_MAX_RECURSION)
SHARED_ENV = ("put the environment where every job account can reach it (e.g. python -m venv /opt/luban-env; "
              "directories o+rx, files o+r: docs/platform.md, 'A shared Python environment')")


class Blocked(Exception):
    """The account cannot use ``path``: it lacks permission ``need`` ("x", "r", "rx") there, which
    it needs ``why``; ``candidate`` is the command's path that led there."""

    def __init__(self, path: str, st: os.stat_result, need: str, why: str):
        super().__init__(path)
        self.path, self.st, self.need, self.why, self.candidate = path, st, need, why, None


class NotRunnable(OSError):
    """The command's path leads to something exec refuses whoever asks (a directory, a device)."""


def allowed(st: os.stat_result, who, want: int) -> bool:
    """Mode bits ``want`` (R, X, R|X) granted to ``who`` (uid, gid, groups) by ``st``: the owner's
    bits if it owns the file, else the group's if it is in the file's group, else the others'."""
    if who.uid == 0:
        return not want & X or stat.S_ISDIR(st.st_mode) or bool(st.st_mode & 0o111)
    if st.st_uid == who.uid:
        bits = st.st_mode >> 6
    elif st.st_gid == who.gid or st.st_gid in who.groups:
        bits = st.st_mode >> 3
    else:
        bits = st.st_mode
    return bits & want == want


def resolve(path: str, who) -> str:
    """The real path that absolute ``path`` names, walked as ``who``: every directory entered must
    be searchable by it. Raises ``Blocked`` where it is not, ``OSError`` (ENOENT, ENOTDIR,
    ELOOP) where the path does not lead anywhere."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    cur, links = "/", 0
    while parts:
        name = parts.pop(0)
        st = os.stat(cur)
        if not allowed(st, who, X):
            raise Blocked(cur, st, "x", "to enter it")
        if name == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, name)
        st = os.lstat(nxt)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
            target = os.readlink(nxt)
            if target.startswith("/"):
                cur = "/"
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            continue
        if parts and not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), nxt)
        cur = nxt
    return cur


def _describe(path: str, st: os.stat_result) -> str:
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{path} ({stat.filemode(st.st_mode)} {owner}:{group})"


def _need(path: str, who, want: int, why: str) -> None:
    """``path`` (absolute) reachable by ``who`` and granting it ``want``."""
    real = resolve(path, who)
    st = os.stat(real)
    if not allowed(st, who, want):
        raise Blocked(real, st, "r" * bool(want & R) + "x" * bool(want & X), why)


def _first_line(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(256).split(b"\n", 1)[0]


def _check_file(path: str, who, search: list[str], depth: int = 0) -> None:
    """``path`` (absolute, existing) executable by ``who``; a script's interpreter too."""
    real = resolve(path, who)
    st = os.stat(real)
    if not stat.S_ISREG(st.st_mode):
        raise NotRunnable(errno.EACCES, "not a regular file", real)
    if not allowed(st, who, X):
        raise Blocked(real, st, "x", "to execute it")
    line = _first_line(real)
    if not line.startswith(b"#!"):
        return
    if not allowed(st, who, R):
        raise Blocked(real, st, "r", "to read it (a script: its interpreter reads it)")
    words = line[2:].decode(errors="replace").split()
    if not words or not words[0].startswith("/") or depth >= MAX_NESTING:
        return
    interpreter = words[0]
    if os.path.basename(interpreter) == "env" and len(words) > 1 and not words[1].startswith("-"):
        _check_file(interpreter, who, search, depth + 1)
        found = _search(words[1], search, who, depth + 1)
        if found is not None:
            return
        raise FileNotFoundError(errno.ENOENT, f"{words[1]} (the interpreter {path} names) is not on the job's PATH")
    _check_file(interpreter, who, search, depth + 1)
    venv = os.path.dirname(os.path.dirname(interpreter))
    if os.path.exists(os.path.join(venv, "pyvenv.cfg")):  # Python ignores a venv it cannot read
        _need(os.path.join(venv, "pyvenv.cfg"), who, R, f"to read it (the environment of {interpreter})")
        if os.path.isdir(os.path.join(venv, "lib")):
            _need(os.path.join(venv, "lib"), who, R | X, f"to list and enter it (the packages of {interpreter})")


def _search(name: str, dirs: list[str], who, depth: int = 0) -> str | None:
    """``execvp``'s search: the first candidate ``who`` can run (None: none exists); the first
    candidate that exists but is blocked is raised if no later one works."""
    blocked = None
    for d in dirs:
        candidate = os.path.join(d, name)
        if not os.path.isfile(candidate):  # execvp goes on past a missing name or a directory
            continue
        try:
            _check_file(candidate, who, dirs, depth)
            return candidate
        except Blocked as err:
            err.candidate = err.candidate or candidate
            blocked = blocked or err
    if blocked is not None:
        raise blocked
    return None


def problem(command: str, env: dict[str, str], workdir: str | None, who) -> str | None:
    """One line saying why account ``who`` (``accounts.Identity``) cannot start ``command`` with
    the job's environment ``env`` in ``workdir``, and what to do; None when it can."""
    base = workdir or os.getcwd()
    if workdir:
        try:
            _need(workdir, who, X, "to enter it (the job's working directory)")
        except Blocked as err:
            return _blocked_line("workdir", workdir, err, who)
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EPERM):
                return f"workdir = {workdir!r}: {err.strerror or err} (the job starts there)"
    dirs = [d if d.startswith("/") else os.path.join(base, d) for d in os.get_exec_path(env)]
    try:
        if "/" in command:
            path = command if command.startswith("/") else os.path.join(base, command)
            try:  # walked as the account first: root's look (os.path.exists) told any user whether a file is
                _check_file(path, who, dirs)  # there behind a folder it cannot enter ("lacks x" or "no such file")
            except FileNotFoundError as err:
                if err.filename is None:  # (an interpreter not on PATH: its own words, below)
                    raise
                return f"command = {command!r}: no such file ({path})"
            return None
        if _search(command, dirs, who) is None:
            return (f"command = {command!r}: not found on the job's PATH ({os.pathsep.join(dirs)}); "
                    f"give its full path, or submit from an environment whose PATH has it")
    except Blocked as err:
        return _blocked_line("command", command, err, who)
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EPERM) and not isinstance(err, NotRunnable):
            return None  # the service itself may not look (root-squashed network file system): exec decides
        return f"command = {command!r}: {err.strerror or err}" + (f": {err.filename}" if err.filename else "")
    return None


def _blocked_line(key: str, value: str, err: Blocked, who) -> str:
    where = f" (found at {err.candidate})" if err.candidate and err.candidate != value else ""
    return (f"{key} = {value!r}{where}: the job's account {who.account} lacks {err.need} on "
            f"{_describe(err.path, err.st)} {err.why}, so the job would fail with 'Permission denied'; "
            f"fix: {SHARED_ENV}, or grant {who.account} {err.need} on {err.path} (o+{err.need}, or a group "
            f"it is in)")
