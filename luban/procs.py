"""A job's processes as one unit: tag, contain, find and kill every process a job starts.

Three mechanisms, strongest first, all used together because each has a gap the next closes:

1. **cgroup v2** (where a writable cgroup2 hierarchy is mounted, e.g. the service runs as root):
   the per-node launcher moves the job's first process into ``<cgroup2>/luban/<tag>`` before it
   executes, so every descendant — ranks in new sessions, their children, daemons that double
   fork — is in it; ``cgroup.kill`` (Linux >= 5.14) kills them all at once.
2. **The job tag**: ``LUBAN_JOB_TAG=<tag>`` is in the environment of every process of the job
   (inherited through fork/exec); a sweep of ``/proc/*/environ`` finds them even without a
   cgroup. A process that deliberately clears its environment escapes this one, not (1).
3. **Process groups + parent-death signal**: ``luban train``'s launcher keeps its ranks in one
   process group and kills it when it ends; each rank asks the kernel for SIGKILL when that
   launcher dies (``PR_SET_PDEATHSIG``), so a launcher killed with -9 takes its ranks with it.

``kill_job`` applies (1) and (2) until nothing of the job is left, and says what survived.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path

TAG_VAR = "LUBAN_JOB_TAG"            # set by the scheduler in every job's environment
PARENT_VAR = "LUBAN_LAUNCHER_PID"    # set by ``parallel.launch`` in each rank's environment
CGROUP_SUBDIR = "luban"
PR_SET_PDEATHSIG = 1                 # <linux/prctl.h>
try:  # loaded here, in the parent: die_with_parent runs between fork and exec
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _LIBC.prctl  # noqa: B018 - Linux only
except (OSError, AttributeError):
    _LIBC = None


def cgroup2_root() -> Path | None:
    """The mount point of a writable cgroup2 hierarchy, or None (then tags and groups do the work)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "cgroup2":
            root = Path(parts[1])
            if os.access(root, os.W_OK) and (root / "cgroup.procs").exists():
                return root
    return None


def cgroup_dir(tag: str) -> Path | None:
    root = cgroup2_root()
    return None if root is None else root / CGROUP_SUBDIR / tag


def make_cgroup(tag: str) -> Path | None:
    """Create the job's cgroup; None where cgroup v2 is unavailable or not ours to write."""
    path = cgroup_dir(tag)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path if (path / "cgroup.procs").exists() else None
    except OSError:
        return None


def enter_cgroup(path: Path | None) -> None:
    """Move the calling process into ``path`` (used between fork and exec); best effort."""
    if path is None:
        return
    try:
        with open(path / "cgroup.procs", "w") as f:
            f.write("0")
    except OSError:
        pass


def tagged(tag: str) -> list[int]:
    """Pids of live processes whose environment holds ``LUBAN_JOB_TAG=<tag>`` (not this one)."""
    needle = f"{TAG_VAR}={tag}".encode()
    me, out = os.getpid(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle in f.read().split(b"\0") and alive(int(entry.name)):
                    out.append(int(entry.name))
        except OSError:
            continue
    return out


def alive(pid: int) -> bool:
    """True for a running (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def members(tag: str) -> list[int]:
    """Every live process of the job: its cgroup's members and the tagged ones."""
    pids = set(tagged(tag))
    path = cgroup_dir(tag)
    if path is not None:
        try:
            pids.update(int(p) for p in (path / "cgroup.procs").read_text().split())
        except (OSError, ValueError):
            pass
    pids.discard(os.getpid())
    return sorted(p for p in pids if alive(p))


def kill_job(tag: str, pgids: tuple[int, ...] = (), timeout: float = 15.0) -> list[int]:
    """SIGKILL every process of the job until none is left (or ``timeout``); the survivors' pids."""
    path = cgroup_dir(tag)
    deadline = time.monotonic() + timeout
    while True:
        if path is not None and (path / "cgroup.kill").exists():
            try:
                (path / "cgroup.kill").write_text("1")
            except OSError:
                pass
        for group in pgids:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        left = members(tag)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        left = [p for p in left if alive(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if path is not None and not left:
        try:
            path.rmdir()
        except OSError:
            pass
    return left


def die_with_parent(expected_parent: int | None) -> None:
    """Ask for SIGKILL when the parent dies; if it already died (or is not ``expected_parent``), die now."""
    if _LIBC is None:
        return
    _LIBC.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(128 + int(signal.SIGKILL))  # the launcher died before the request took effect
