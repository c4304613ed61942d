"""Each luban user's jobs run as an OS account of their own, so Unix permissions separate users.

When the service runs as root (``cluster serve --run-jobs-as user``, the default for root):

- ``luban admin user add alice`` creates the account ``luban-alice`` (home directory, own primary
  group), or maps an existing one with ``--os-user``;
- ``luban admin group add vision`` creates the Unix group ``luban-g-vision``; members join it (and
  leave it when moved to another group or out of any), and the group's data/env directories become
  ``root:luban-g-vision`` mode 2770 (shared by members, closed to everyone else). A user name
  starting with ``g-`` is refused (its account ``luban-g-NAME`` would be the group ``NAME``'s), and
  an existing Unix group is adopted only if it gives no one anything yet;
- the node launcher (root) starts each job's command as that account (``identity`` → setgroups,
  setgid, setuid between fork and exec), after moving it into the job's cgroup.

The service's state directory (database, admin token, logs, run records) is mode 700, owned by
the service: a job's account can open nothing in it. Without root, jobs run as the service's own
account and *can* read its state; the service says so at start-up and in every job's log.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import pwd
import stat
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from luban.errors import LubanError, bad_value

USER_PREFIX = "luban-"
GROUP_PREFIX = "luban-g-"
GROUP_INFIX = GROUP_PREFIX[len(USER_PREFIX):]  # "g-": a user name starting so would make a group's name
MAX_ACCOUNT = 32  # useradd's limit on a login name (shadow-utils, LOGIN_NAME_MAX on Linux)


NOBODY_UID = 65534  # the overflow uid: shared by unrelated daemons


def _login_def(key: str) -> int:
    """A number of /etc/login.defs (useradd's and groupadd's own), default 1000."""
    try:
        for line in Path("/etc/login.defs").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 2 and fields[0] == key and fields[1].isdigit():
                return int(fields[1])
    except OSError:
        pass
    return 1000


def uid_min() -> int:
    """The first uid of a regular account: ``UID_MIN`` of /etc/login.defs, default 1000."""
    return _login_def("UID_MIN")


def gid_min() -> int:
    """The first gid groupadd gives a (non-system) group: ``GID_MIN`` of /etc/login.defs, default 1000."""
    return _login_def("GID_MIN")


def privileged() -> bool:
    return os.geteuid() == 0


def account_for(name: str) -> str:
    """luban-NAME. A NAME starting with "g-" is refused: luban-g-X (and useradd's primary group of
    that name) is the Unix group of luban group X: that user's jobs would read and write group X's
    directories without its being a member, and ``group add X`` would adopt the user's primary group."""
    account = USER_PREFIX + name
    if name.startswith(GROUP_INFIX):
        raise bad_value("name", name, f"a name not starting with {GROUP_INFIX!r} when jobs run as per-user OS "
                                      f"accounts ({account} is the Unix group of a luban group "
                                      f"{name[len(GROUP_INFIX):]!r}), or map an existing account with --os-user")
    if len(account) > MAX_ACCOUNT:
        raise bad_value("name", name, f"at most {MAX_ACCOUNT - len(USER_PREFIX)} characters when jobs run as "
                                      f"per-user OS accounts (or map an existing account with --os-user)")
    return account


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise LubanError(f"{argv[0]} failed: {result.stderr.strip() or result.returncode}")


HOME_MODE = 0o700  # a luban account's home: its own (jobs of other accounts share the machine)


def ensure_user(name: str, os_user: str | None = None) -> str:
    """The OS account of luban user ``name``: ``os_user`` if given (must exist), else luban-NAME,
    created with a home directory of mode 700 (``HOME_MODE``) and a primary group of its own if missing.
    useradd's default home was 755 here (login.defs without HOME_MODE, UMASK 022): another user's job read it."""
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
        os.chmod(pwd.getpwnam(account).pw_dir, HOME_MODE)
    return account


def unix_group(name: str) -> str:
    return GROUP_PREFIX + name


def _foreign(entry: grp.struct_group) -> str | None:
    """Why existing Unix group ``entry`` is not one luban may adopt for a new luban group, or None.
    groupadd (luban's) gives a gid of its own from GID_MIN; members join only once the luban group
    exists: so a group of luban's left behind by an add that failed half-way (adopted, so that the
    add can be repeated) has neither members nor accounts with it as their primary group. Any other
    would hand the new group's directories to accounts that are not its members."""
    gid = entry.gr_gid
    if gid < gid_min() or gid == NOBODY_UID:
        return f"is a system group (gid {gid}), not one luban made"
    shared = sorted(g.gr_name for g in grp.getgrall() if g.gr_gid == gid and g.gr_name != entry.gr_name)
    if shared:
        return f"shares gid {gid} with {', '.join(shared[:3])}, not one luban made"
    owners = sorted(p.pw_name for p in pwd.getpwall() if p.pw_gid == gid)
    if owners:
        return f"is the primary group of account {', '.join(owners[:3])}"
    if entry.gr_mem:
        return f"has members already ({', '.join(sorted(entry.gr_mem)[:3])})"
    return None


MADE_PARENT_MODE = 0o755  # a missing parent of a group's directory, made by luban: as mkdir -p under umask 022


def _open_dir(key: str, path: str) -> int:
    """An fd of directory ``path``, made with its missing parents (as ``mkdir -p``). It is opened one
    component at a time from / with O_NOFOLLOW, so a symbolic link anywhere in the path is refused,
    never followed: ``--data-dir LINK`` to a root-only directory made that directory the group's
    (root:luban-g-X 2770), and a link swapped in after a check would redirect a chown by path. The
    caller changes owner and mode through this fd (fchown, fchmod)."""
    parts = [part for part in path.split("/") if part]
    if not path.startswith("/") or "\x00" in path:
        raise bad_value(key, path, "an absolute path without NUL bytes")
    if any(part in (".", "..") for part in parts):
        raise bad_value(key, path, "a path without . or .. components (the directory's own path)")
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    last_made = False
    try:
        for i, part in enumerate(parts):
            where = "/" + "/".join(parts[:i + 1])
            child, made = None, False
            for _ in range(2):
                try:
                    child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                    if made:  # a parent made here: members pass through it (the service's umask is 077)
                        os.fchmod(child, MADE_PARENT_MODE)
                    break
                except FileNotFoundError:
                    with contextlib.suppress(FileExistsError):  # made meanwhile: opened (and checked) next
                        os.mkdir(part, 0o700, dir_fd=fd)
                        made = True
                except OSError as err:
                    if err.errno not in (errno.ENOTDIR, errno.ELOOP):
                        raise
                    if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise bad_value(key, path, f"a path without symbolic links ({where} is one, to "
                                                   f"{os.readlink(part, dir_fd=fd)}): give the real "
                                                   "directory's path") from None
                    raise bad_value(key, path, f"a directory ({where} is not one)") from None
            if child is None:
                raise bad_value(key, path, f"a directory ({where} vanished as it was made)")
            os.close(fd)
            fd = child
            last_made = made
        if not parts:
            raise bad_value(key, path, "a directory below / (not / itself)")
        held = [] if last_made else os.listdir(fd)
        if held:  # (an existing folder of someone's, a home or /etc, became root:GROUP 2770: a review of 2026-12-04)
            raise bad_value(key, path, f"a new or empty directory (it holds {len(held)} entries, which would become "
                                       "the group's, its owner's lost); choose a new one")
        return fd
    except OSError as err:
        os.close(fd)
        raise bad_value(key, path, f"a directory the service can make and open ({err.strerror})") from None
    except BaseException:
        os.close(fd)
        raise


def ensure_group(name: str, dirs: dict[str, str | None]) -> str:
    """The Unix group of luban group ``name``, made if missing; its shared directories (``dirs``:
    field name -> path, None for none) made root:GROUP 2770. An existing Unix group of that name is
    adopted only if luban may have made it (``_foreign``); nothing is changed on a refusal."""
    group = unix_group(name)
    if len(group) > MAX_ACCOUNT:
        raise bad_value("name", name, f"at most {MAX_ACCOUNT - len(GROUP_PREFIX)} characters for a group")
    try:
        entry = grp.getgrnam(group)
    except KeyError:
        entry = None
    why = None if entry is None else _foreign(entry)
    if why is not None:
        raise bad_value("name", name, f"a group whose Unix group luban can make: {group} exists and {why}; "
                                      f"choose another name, or remove that group (groupdel {group}) if "
                                      "nothing needs it")
    with contextlib.ExitStack() as opened:
        fds = []
        for key, path in dirs.items():  # all checked (and made) before the group: a bad path leaves none
            if path:
                fds.append(_open_dir(key, path))
                opened.callback(os.close, fds[-1])
        if entry is None:
            _run("groupadd", group)
        gid = grp.getgrnam(group).gr_gid
        for fd in fds:
            os.fchown(fd, 0, gid)
            os.fchmod(fd, 0o2770)
    return group


def set_groups(account: str, group_names: Iterable[str]) -> None:
    """Make ``account``'s luban groups (its supplementary luban-g-* groups) exactly those of
    ``group_names``: a user moved to another group, or out of any, leaves the old group's Unix group
    (appending alone kept it there, and its jobs reading and writing that group's directories). Its
    other groups (a mapped account's own) are left as they are."""
    wanted = {unix_group(name) for name in group_names}
    current = {g.gr_name for g in grp.getgrall() if g.gr_name.startswith(GROUP_PREFIX) and account in g.gr_mem}
    for group in sorted(current - wanted):
        _run("gpasswd", "--delete", account, group)
    if wanted - current:
        _run("usermod", "--append", "--groups", ",".join(sorted(wanted - current)), account)


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
