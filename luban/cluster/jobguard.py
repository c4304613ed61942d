"""Job isolation for a NON-root service (``luban cluster serve --run-jobs-as namespace``).

Without root the service cannot give each user an OS account (``accounts.py``), so every job runs
under the service's own uid. What keeps a job away from the service's secrets (the state
directory with ``admin.token``, the SQLite database, other jobs' run records and logs) is then:

1. **User + mount namespaces** (``enter``, between fork and exec of the job's first process): the
   job gets a private mount table in which each secret directory is covered by an empty,
   read-only tmpfs of mode 000. The cover is made in a first user namespace (where the job's
   starter holds CAP_SYS_ADMIN), then a *nested* user + mount namespace is entered, so the cover
   mounts are locked (mount_namespaces(7), "MNT_LOCKED"): nothing the job does can unmount or
   move them, and after exec the job, a non-zero uid in its namespace, holds no capability.
2. **PID namespace + own /proc**: the job's command runs as PID 1 of a fresh PID namespace with
   a /proc of that namespace, so it sees no process outside its own job (no other job's
   ``/proc/PID/environ``, no ``/proc/<service>/root`` to walk around the cover). A small keeper
   process outside (the launcher's direct child) waits for it and exits with its code.
3. **Undumpable service and launchers** (``undumpable``: prctl PR_SET_DUMPABLE 0): even a process
   of the same uid that can name their PIDs cannot ptrace them or open their
   ``/proc/PID/mem|environ|cwd|root`` (ptrace access mode checks, ptrace(2)).
4. **A job-side check** (``reachable``): after the cover is made and before exec, the job's process
   tries to open each secret; if any is reachable, the job does not start: exit ``EXIT_EXPOSED``
   with one line in the job log.
5. **A working directory resolved after the cover**: a process keeps its working directory across
   ``mount``, so one inherited from the service (``--state .``) would still reach the covered
   files by relative path. ``enter`` always changes directory by path once the cover is in: to the
   job's workdir, else ``/``.
6. **The service's code and Python environment read-only** (``protected``): jobs share the
   service's uid, so without this a job could rewrite the code the service runs at its next start
   and reach the secrets that way. The service's home and other files of its account stay
   writable (docs/platform.md says so, and the service says so at start-up).

Written with ctypes (unshare/mount/prctl) because Python 3.11 has no ``os.unshare``; the kernel
interfaces are the ones ``unshare(1) -Urm --pid --fork --mount-proc`` uses.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from luban.train import preempt

# <linux/sched.h> and <sys/mount.h>, <sys/prctl.h> constants
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 0x20, 0x1000, 0x4000, 0x40000, 1 << 21
PR_SET_DUMPABLE = 4
EXIT_EXPOSED = 126  # the job did not start: a secret was reachable from it (like "cannot execute")

_libc = ctypes.CDLL(None, use_errno=True)


class GuardError(OSError):
    """Isolation could not be set up; the job must not start."""


def _call(name: str, *args) -> None:
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise GuardError(err, f"{name}: {os.strerror(err)}")


def _unshare(flags: int) -> None:
    _call("unshare", flags)


def _map_self(uid: int, gid: int) -> None:
    """Map our own outer uid/gid to the same numbers in the user namespace just entered."""
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _call("mount", source.encode(), target.encode(), fstype.encode() if fstype else None,
          ctypes.c_ulong(flags), data.encode() if data else None)


def undumpable(flag: int = 0) -> None:
    """PR_SET_DUMPABLE 0 for this process: same-uid processes cannot ptrace it or read its /proc."""
    _call("prctl", PR_SET_DUMPABLE, ctypes.c_ulong(flag), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def available() -> str | None:
    """None when unprivileged user namespaces work here, else why not (one line)."""
    pid = os.fork()
    if pid == 0:
        try:
            _unshare(CLONE_NEWUSER | CLONE_NEWNS)
            os._exit(0)
        except OSError:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        return None
    return "unprivileged user namespaces are not available (kernel.unprivileged_userns_clone / user.max_user_namespaces)"


def inside(path: str, folders: list[str]) -> bool:
    """Whether ``path`` (symlinks resolved) is one of ``folders`` or below one."""
    real = os.path.realpath(path)
    return any(os.path.commonpath([real, os.path.realpath(f)]) == os.path.realpath(f) for f in folders)


def reachable(secrets: list[str]) -> str | None:
    """The first secret this process can list or open, or None."""
    for path in secrets:
        try:
            if os.path.isdir(path):
                if os.listdir(path):
                    return path
            else:
                with open(path, "rb"):
                    return path
        except OSError:
            continue
    return None


def _locked_flags(path: str) -> int:
    """The mount's flags a user namespace may not clear on remount (mount_namespaces(7): nosuid,
    nodev, noexec and the atime ones are locked), as MS_* bits. ST_* equal MS_* but for relatime."""
    have = os.statvfs(path).f_flag
    flags = have & (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME)
    return flags | (MS_RELATIME if have & os.ST_RELATIME else 0)


def protected() -> list[str]:
    """What jobs may read but not write: this Python environment and the luban package's folder."""
    import luban

    return sorted({os.path.realpath(sys.prefix), os.path.dirname(os.path.realpath(luban.__file__))})


def enter(secrets: list[str], cwd: str | None, readonly: list[str] | None = None) -> None:
    """Between fork and exec: cover ``secrets``, make ``readonly`` (default ``protected()``) read-only,
    lock both, become PID 1 of a new PID namespace (after a fork; the parent stays as the keeper and
    never returns), check, chdir by path. Raises GuardError when any step fails or a secret is
    still reachable."""
    readonly = protected() if readonly is None else readonly
    if cwd and inside(cwd, secrets):  # it would start in an empty cover: refuse instead
        raise GuardError(0, f"the working directory {cwd} lies in a hidden folder")
    uid, gid = os.getuid(), os.getgid()
    # an undumpable process's /proc/self is root's: it could not write its uid_map. Only this
    # child (not yet covering anything, soon in its own namespaces) becomes dumpable again
    undumpable(1)
    _unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID)
    _map_self(uid, gid)
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    for path in secrets:
        if os.path.isdir(path):
            _mount("luban-cover", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=000,size=4k")
    for path in readonly:
        if os.path.isdir(path):
            _mount(path, path, None, MS_BIND | MS_REC)
            _mount("none", path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | _locked_flags(path))
    pid = os.fork()  # the child is PID 1 of the new PID namespace
    if pid:
        _keep(pid)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _unshare(CLONE_NEWUSER | CLONE_NEWNS)  # nested: the covers become locked mounts
    _map_self(uid, gid)
    leak = reachable(secrets)
    if leak is not None:
        raise GuardError(0, f"{leak} is still readable from the job")
    try:  # by path, after the cover: a working directory taken before it would bypass it
        os.chdir(cwd or "/")
    except OSError as err:
        raise GuardError(err.errno, f"cannot enter the working directory {cwd}: {err.strerror}") from None


def _keep(pid: int) -> None:
    """The keeper: outside the job's PID namespace, in its process group; it ignores the signals
    the launcher forwards to the group (they are for the job) and exits with the job's code."""
    for sig in (*preempt.HANDLED, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, preempt.HANDLED)
    os.closerange(3, 65536)  # Popen's error pipe among them: the launcher must not wait on us
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)


def fail(message: str) -> None:
    """In the job's process before exec: one line on its output, exit EXIT_EXPOSED."""
    os.write(1, f"== luban: job isolation failed, not starting: {message} ==\n".encode())
    os._exit(EXIT_EXPOSED)


if __name__ == "__main__":  # python -m luban.cluster.jobguard: can jobs be isolated here?
    why = available()
    print(why or "ok")
    sys.exit(1 if why else 0)
