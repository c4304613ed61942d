"""Each luban user's jobs run as an OS account of their own, so Unix permissions separate users.

When the service runs as root (``cluster serve --run-jobs-as user``, the default for root):

- ``luban admin user add alice`` creates the account ``luban-alice`` (home directory, own primary
  group), or maps an existing one with ``--os-user``;
- ``luban admin group add vision`` creates the Unix group ``luban-g-vision``; members join it, and
  the group's data/env directories become ``root:luban-g-vision`` mode 2770 (shared by members,
  closed to everyone else);
- the node launcher (root) starts each job's command as that account (``identity`` → setgroups,
  setgid, setuid between fork and exec), after moving it into the job's cgroup.

The service's state directory (database, admin token, logs, run records) is mode 700, owned by
the service: a job's account can open nothing in it. Without root, jobs run as the service's own
account and *can* read its state; the service says so at start-up and in every job's log.
"""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
from dataclasses import dataclass
from pathlib import Path

from luban.errors import LubanError, bad_value

USER_PREFIX = "luban-"
GROUP_PREFIX = "luban-g-"
MAX_ACCOUNT = 32  # useradd's limit on a login name (shadow-utils, LOGIN_NAME_MAX on Linux)


NOBODY_UID = 65534  # the overflow uid: shared by unrelated daemons


def uid_min() -> int:
    """The first uid of a regular account: ``UID_MIN`` of /etc/login.defs (useradd's own), default 1000."""
    try:
        for line in Path("/etc/login.defs").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 2 and fields[0] == "UID_MIN" and fields[1].isdigit():
                return int(fields[1])
    except OSError:
        pass
    return 1000


def privileged() -> bool:
    return os.geteuid() == 0


def account_for(name: str) -> str:
    account = USER_PREFIX + name
    if len(account) > MAX_ACCOUNT:
        raise bad_value("name", name, f"at most {MAX_ACCOUNT - len(USER_PREFIX)} characters when jobs run as "
                                      f"per-user OS accounts (or map an existing account with --os-user)")
    return account


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise LubanError(f"{argv[0]} failed: {result.stderr.strip() or result.returncode}")


def ensure_user(name: str, os_user: str | None = None) -> str:
    """The OS account of luban user ``name``: ``os_user`` if given (must exist), else luban-NAME,
    created with a home directory and a primary group of its own if missing."""
    if os_user is not None:
        try:
            entry = pwd.getpwnam(os_user)
        except KeyError:
            raise bad_value("os_user", os_user, "no such OS account on the service's machine") from None
        if entry.pw_uid == 0:
            raise bad_value("os_user", os_user, "an account other than root (jobs must not run as root)")
        if entry.pw_uid < uid_min() or entry.pw_uid == NOBODY_UID:
            raise bad_value("os_user", os_user, f"a person's account (uid {entry.pw_uid} is a system account: "
                                                f"uids from {uid_min()}, not nobody); jobs must not run as a "
                                                "service's or daemon's account")
        return os_user
    account = account_for(name)
    try:
        pwd.getpwnam(account)
    except KeyError:
        _run("useradd", "--create-home", "--user-group", "--shell", "/bin/sh", "--comment", f"luban user {name}",
             account)
    return account


def unix_group(name: str) -> str:
    return GROUP_PREFIX + name


def ensure_group(name: str, dirs: list[str | None]) -> str:
    """The Unix group of luban group ``name``; its shared directories made root:GROUP 2770."""
    group = unix_group(name)
    if len(group) > MAX_ACCOUNT:
        raise bad_value("name", name, f"at most {MAX_ACCOUNT - len(GROUP_PREFIX)} characters for a group")
    try:
        grp.getgrnam(group)
    except KeyError:
        _run("groupadd", group)
    gid = grp.getgrnam(group).gr_gid
    for d in dirs:
        if d:
            Path(d).mkdir(parents=True, exist_ok=True)
            os.chown(d, 0, gid)
            os.chmod(d, 0o2770)
    return group


def join_group(account: str, group_name: str | None) -> None:
    if group_name is not None:
        _run("usermod", "--append", "--groups", unix_group(group_name), account)


@dataclass(frozen=True)
class Identity:
    account: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    def env(self) -> dict[str, str]:
        return {"HOME": self.home, "USER": self.account, "LOGNAME": self.account}

    def become(self) -> None:
        """Drop to this account (in a child between fork and exec; root only)."""
        os.setgroups(list(self.groups))
        os.setgid(self.gid)
        os.setuid(self.uid)


def identity(account: str) -> Identity:
    entry = pwd.getpwnam(account)
    return Identity(account, entry.pw_uid, entry.pw_gid, tuple(os.getgrouplist(account, entry.pw_gid)),
                    entry.pw_dir)
