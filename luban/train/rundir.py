"""The run folder's start-up check (torch-free: the launching process runs it before any rank).

``check_run_dir`` first applies luban's folder rule (``luban.owned``: the run folder must be absent,
empty, or a luban run folder — a folder of other files is refused untouched), then creates ``RUN/checkpoints`` and writes a probe file there, and with
``need_bytes`` also checks the file system has room for one more checkpoint: a read-only,
unwritable or full run folder is one line and exit 2 before any work, not a traceback at the
first save (which, should storage fail later anyway, exits 74: ``train.checkpoint.save``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from luban import owned
from luban.errors import bad_value


def check_run_dir(run_dir: str | Path, need_bytes: int = 0, resume: str | None = None, lock: bool = True) -> None:
    """``refuse_run_dir``, then the folder is made luban's (``owned.claim``) with its ``checkpoints``,
    which must take a write (and with ``need_bytes``, one more checkpoint). ``lock``: this process takes
    the run (``lock_run_dir``); the ranks of luban's launcher, which took it, and nodes but the first do not."""
    refuse_run_dir(run_dir, resume)
    owned.claim(run_dir, "run", "run.dir")
    if lock:
        lock_run_dir(run_dir)
    root = Path(run_dir) / "checkpoints"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as err:
        raise bad_value("run.dir", str(run_dir), f"checkpoints cannot be written there ({err.strerror or err}); "
                                                 "choose a writable folder") from None
    free = shutil.disk_usage(root).free
    if free < need_bytes:
        raise bad_value("run.dir", str(run_dir), f"{free / 2**30:.2f} GiB free, a checkpoint needs about "
                                                 f"{need_bytes / 2**30:.2f} GiB; free space or choose another")


_LOCKS: dict[str, int] = {}  # run folder -> the open marker this process holds its lock on


def lock_run_dir(run_dir: str | Path, name: str = "run.dir") -> None:
    """One ``luban train`` at a time per run folder: an exclusive ``flock`` on its marker (``.luban``),
    held until ``unlock_run_dir`` or the process ends (``luban import`` takes it too; ``name``: the setting
    that named the folder). Two runs resumed into one folder at once each
    saved over the other's checkpoints of the same step and pruned the rest, and interleaved metrics."""
    key = os.path.realpath(run_dir)
    if key in _LOCKS:  # this process holds it (the launcher, then its one Trainer; the demo's two halves)
        return
    try:
        fd = os.open(Path(run_dir) / owned.MARKER, os.O_RDONLY)
    except OSError:  # an unreadable marker: unguarded, as before (the writes that follow name the folder)
        return
    held = owned.try_lock(fd)
    if not held:
        os.close(fd)
        if held is False:
            raise bad_value(name, str(run_dir), f"another luban train (or import) is using this folder now; wait for "
                                                f"it to end, or choose a new {name} (nothing was changed)")
        return  # a file system without flock (some network mounts): unguarded, as before
    _LOCKS[key] = fd


def unlock_run_dir(run_dir: str | Path) -> None:
    fd = _LOCKS.pop(os.path.realpath(run_dir), None)
    if fd is not None:
        os.close(fd)


def refuse_run_dir(run_dir: str | Path, resume: str | None = None) -> None:
    """The refusals that read, never write (a refused run leaves no folder behind): a folder luban may
    not write a run into (``owned.check``); without ``--resume`` (``resume``), one that already holds
    checkpoints (a new run there saved over the old run's equal-numbered ones and pruned the rest under
    its retention, and ``--resume auto`` then mixed the two runs); so is one naming a checkpoint of
    another folder (an imported one, another run's) where this folder holds a run."""
    owned.check(run_dir, "run", "run.dir")
    _refuse_wrong_kinds(run_dir)
    root = Path(run_dir) / "checkpoints"
    held = owned.step_dirs(root) if not resume or _elsewhere(resume, root) else []
    if held and resume:
        raise bad_value("--resume", resume, f"a checkpoint of another folder, and run.dir = {str(run_dir)!r} already "
                                            f"holds a run ({len(held)} checkpoint(s), the newest {held[0].name}) whose "
                                            "checkpoints this run's would save over and mix with; start it in a new "
                                            "run.dir (nothing was changed)")
    if held:
        raise bad_value("run.dir", str(run_dir), f"already holds a run ({len(held)} checkpoint(s), the newest "
                                                 f"{held[0].name}); continue it with --resume auto, or choose a new "
                                                 "run.dir (nothing was changed)")


# what luban writes into run.dir, files and folders (metrics.py, peak.PEAK_FILE, plan_check, the trainer)
RUN_ENTRIES = {"config.json": "file", "metrics.jsonl": "file", "peak.json": "file", "plan.json": "file",
               "plan_vs_measured.json": "file", "checkpoints": "folder", "tensorboard": "folder"}


def _refuse_wrong_kinds(run_dir: str | Path) -> None:
    """A folder where luban writes one of its files (``mkdir RUN/config.json``), or a file where it makes a
    folder (``RUN/tensorboard``), failed with a traceback when it was opened: refused in one line, like a
    foreign file (links and special files: ``owned.check``)."""
    for name, kind in RUN_ENTRIES.items():
        path = Path(run_dir) / name
        if path.exists() and not path.is_symlink() and path.is_dir() != (kind == "folder"):
            found = "folder" if path.is_dir() else "file"
            raise bad_value("run.dir", str(run_dir), f"holds a {found} {name!r} where luban makes its {kind}; move "
                                                     "it away, or choose a new run.dir (nothing was changed)")


def _elsewhere(resume: str | None, root: Path) -> bool:
    """``--resume`` names a checkpoint folder (one with a manifest; anything else is named where it is
    read) outside ``root`` (the run's ``checkpoints``, its ``aside-*`` folders included)."""
    if not resume or resume == "auto":
        return False
    try:
        return (Path(resume) / "manifest.json").is_file() and not Path(resume).resolve().is_relative_to(root.resolve())
    except (OSError, ValueError, RuntimeError):  # unreadable: --resume is named where it is read
        return False
