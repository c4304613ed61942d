"""The one rule for every folder luban writes (docs/ARCHITECTURE.md, "Output folders").

luban writes into a folder only if it is absent, empty, or luban's own of the same kind:

- its own means it holds the marker file ``.luban`` (JSON ``{"luban": KIND}``), written by
  ``claim`` the first time luban writes there;
- folders made by luban before the marker existed are recognised by their layout (``_LEGACY``:
  only luban's own file names for that kind, and the file that proves it — a run's checkpoints or
  its config, a dataset's manifest, a service's database or admin token, a study's results),
  and get the marker on first use;
- anything else — a folder holding one file luban did not write, or luban's folder of another
  kind — is refused before a byte is written, with one line (``KEY = PATH: ...``, exit 2).

Inside its own folder luban replaces or deletes only what it wrote itself (a dataset swapped in
whole, a run's older checkpoints under its ``train.keep_checkpoints`` retention); a file a user adds to a
run folder is never touched. This module is torch-free (the launcher checks before any rank).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from luban.errors import bad_value

MARKER = ".luban"
MARKER_TEMP = re.compile(r"\.luban\.tmp-\d+")  # ``mark``'s temporary: all a kill while marking leaves

KINDS = {"run": "a training run", "dataset": "a dataset", "hf-export": "a Hugging Face export",
         "cluster-state": "a cluster service's state", "plan-study": "a planner study"}

STEP_DIR = re.compile(r"^step_(\d{7,})$")  # a run's finished checkpoint: checkpoints/step_NNNNNNN (7 digits or more)


def try_lock(fd: int) -> bool | None:
    """An exclusive ``flock`` on ``fd`` without waiting (the kernel gives it back when the process ends, a
    kill -9 too): True held, False another process holds it, None where the file system has no ``flock``
    (some network mounts: the caller goes on unguarded). One run, import or export per folder, one service
    per SQLite file."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None


def step_dirs(root: Path) -> list[Path]:
    """A run's finished checkpoint folders under ``root`` (its ``checkpoints/``), newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)), reverse=True)


def _names(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def _read_json(path: Path):
    """What the regular file ``path`` holds, as JSON; anything else by that name (a named pipe, a device)
    is not opened, since a read of it could wait for a writer forever or never end (``OSError``)."""
    if not path.is_file():
        raise OSError(f"{path} is not a regular file")
    return json.loads(path.read_text())


STUDY_KEYS = {"precision", "runtime", "models", "a", "b", "c"}  # what luban.plan.study.run writes in results.json


def _is_run(path: Path) -> bool:
    """A run folder written before the marker: only luban's run files, and either a checkpoint
    (``checkpoints/step_NNNNNNN/meta.json``) or a ``config.json`` that is a luban run config."""
    own = {"checkpoints", "config.json", "metrics.jsonl", "peak.json", "plan.json", "plan_vs_measured.json",
           "tensorboard"}  # what luban.train writes into run.dir (peak.json: luban.train.peak.PEAK_FILE)
    if not set(_names(path)) <= own:
        return False
    ckpts = path / "checkpoints"
    if ckpts.is_dir() and any((p / "meta.json").is_file() for p in ckpts.iterdir() if STEP_DIR.match(p.name.removeprefix(".tmp-"))):
        return True
    try:
        cfg = _read_json(path / "config.json")
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(cfg, dict) and {"model", "data", "train", "parallel", "run"} <= set(cfg)


def _is_dataset(path: Path) -> bool:
    """A dataset folder written before the marker: only a dataset's files, and a ``manifest.json`` of
    luban's format (a web app's manifest.json alone in a folder is not a dataset)."""
    from luban.data.build import dataset_file  # lazy: numpy
    from luban.data.manifest import FORMAT, MANIFEST

    names = _names(path)
    if MANIFEST not in names or not all(dataset_file(path / n) for n in names):
        return False
    try:
        manifest = _read_json(path / MANIFEST)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def _is_cluster_state(path: Path) -> bool:
    names = set(_names(path))
    own = {"luban.db", "luban.db-journal", "luban.db-wal", "luban.db-shm", "admin.token", "logs", "runs",
           "serve.lock"}  # serve.lock: luban.cluster.cli.STATE_LOCK
    return names <= own and bool(names & {"luban.db", "admin.token"})


def _is_plan_study(path: Path) -> bool:
    """A study folder written before the marker: only a study's files, and a ``results.json`` of the study's
    form (``luban.plan.study.run``'s keys). By its names alone, a user's folder holding a ``results.json``
    was taken for one: ``luban plan study --out`` wrote over the user's results (a review of 2026-12-04)."""
    names = _names(path)
    if "results.json" not in names or not all(n in ("results.json", "seed003.md") or n.endswith(".png") for n in names):
        return False
    try:
        results = _read_json(path / "results.json")
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(results, dict) and STUDY_KEYS <= set(results)


# Folders luban wrote before the marker; an HF export has no legacy form: it is indistinguishable
# from a user's own Hugging Face folder, which is exactly what must not be overwritten.
_LEGACY = {"run": _is_run, "dataset": _is_dataset, "cluster-state": _is_cluster_state, "plan-study": _is_plan_study}


def marked_kind(path: Path) -> str | None:
    """The kind named by ``path``'s marker, or None (no marker, or not one luban wrote)."""
    try:
        data = _read_json(Path(path) / MARKER)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    kind = data.get("luban") if isinstance(data, dict) else None
    return kind if kind in KINDS else None


def owner(path: str | Path) -> str | None:
    """``"empty"`` for an absent or empty folder; the kind of luban folder it is (by marker, else by
    a legacy layout); None for anything else (a file, a folder with someone else's files)."""
    path = Path(path)
    if not path.exists():
        return "empty"
    if not path.is_dir():
        return None
    try:
        if all(MARKER_TEMP.fullmatch(p.name) for p in path.iterdir()):  # (a start killed while marking it)
            return "empty"
        kind = marked_kind(path)
        if kind is not None:
            return kind
        if (path / MARKER).exists():
            return None
        return next((k for k, test in _LEGACY.items() if test(path)), None)
    except OSError:
        return None


def check(path: str | Path, kind: str, key: str) -> None:
    """Refuse, with one line, a destination luban may not write ``kind`` into; nothing is touched."""
    assert kind in KINDS, kind
    if "\0" in str(path):  # no file system takes it (os calls raise ValueError)
        raise bad_value(key, str(path), "a folder path without a NUL character (nothing was changed)")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise bad_value(key, str(path), f"a folder for {KINDS[kind]}, not a file (nothing was changed)")
    outer = _enclosing(path)
    if outer is not None:
        raise bad_value(key, str(path), f"is inside {str(outer[0])!r}, luban's folder for {KINDS[outer[1]]}, which "
                                        "holds luban's files only (a folder there would stop its next rebuild or "
                                        "resume); choose a folder outside it (nothing was changed)")
    found = owner(path)
    if found == kind:
        _refuse_links(path, key)
    if found in ("empty", kind):
        return
    if found is not None:
        raise bad_value(key, str(path), f"is luban's folder for {KINDS[found]}, not {KINDS[kind]}; choose a new or "
                                        "empty folder (nothing was changed)")
    try:
        foreign = next((n for n in _names(path) if n != MARKER), MARKER)
    except OSError as err:
        raise bad_value(key, str(path), f"cannot be read ({err.strerror}); choose a new or empty folder") from None
    raise bad_value(key, str(path), f"holds {foreign!r}, which luban did not write; choose a new or empty folder, "
                                    f"or one luban made for {KINDS[kind]} (nothing was changed)")


# the kinds of luban folder that must hold nothing else: a dataset is swapped in whole, an export's
# files are replaced by its marker's list, a run folder holds only RUN_ENTRIES (luban.train.rundir)
_SOLE = ("dataset", "hf-export", "run")


def _enclosing(path: Path) -> tuple[Path, str] | None:
    """The nearest folder above ``path`` that luban marked as one of ``_SOLE``'s kinds, and its kind."""
    try:  # through links too: ``ln -s run/checkpoints latest; export ... latest/hf`` wrote into the run
        for parent in [*path.absolute().parents, *path.resolve().parents]:
            kind = marked_kind(parent) if (parent / MARKER).is_file() else None
            if kind in _SOLE:
                return parent, kind
    except (OSError, RuntimeError):  # RuntimeError: a link loop (Python < 3.13)
        return None
    return None


def _refuse_links(path: Path, key: str) -> None:
    """luban makes no symbolic links and no special files (named pipes, sockets, devices) in its
    folders: a link there (``metrics.jsonl`` -> a user's file) would have luban write through it, and
    a write to a named pipe waits for a reader forever, so its folder is refused as if foreign.
    Checked: the folder's entries and those of its ``checkpoints`` folder."""
    try:
        entries = list(path.iterdir())
        if (path / "checkpoints").is_dir() and not (path / "checkpoints").is_symlink():
            entries += list((path / "checkpoints").iterdir())
    except OSError as err:
        raise bad_value(key, str(path), f"cannot be read ({err.strerror}); choose a new or empty folder") from None
    for entry in sorted(entries):
        what = ("a symbolic link" if entry.is_symlink() else None if entry.is_file() or entry.is_dir()
                else "a named pipe" if entry.is_fifo() else "a socket" if entry.is_socket() else "a device file")
        if what is not None:
            raise bad_value(key, str(path), f"holds {str(entry.relative_to(path))!r}, {what} luban did not make; "
                                            "remove it, or choose a new or empty folder (nothing was changed)")


def mark(path: str | Path, kind: str) -> None:
    """Write the marker into ``path`` (a folder luban just made or checked with ``check``)."""
    marker = Path(path) / MARKER
    if marked_kind(Path(path)) == kind:
        return
    tmp = marker.with_name(f"{MARKER}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"luban": kind}) + "\n")
    os.chmod(tmp, 0o644)
    tmp.replace(marker)
    for stale in Path(path).iterdir():  # what an earlier start killed while marking left (its process gone)
        if MARKER_TEMP.fullmatch(stale.name) and stale.is_file() and \
                not os.path.exists(f"/proc/{stale.name.rsplit('-', 1)[1]}"):
            stale.unlink(missing_ok=True)


def claim(path: str | Path, kind: str, key: str) -> Path:
    """``check``, then create the folder (and its parents) if absent and mark it as luban's.

    Returns the path. An ``OSError`` creating it is the same one-line refusal (``KEY = PATH``)."""
    path = Path(path)
    check(path, kind, key)
    try:
        path.mkdir(parents=True, exist_ok=True)
        mark(path, kind)
    except OSError as err:
        raise bad_value(key, str(path), f"cannot be written there ({err.strerror or err}); choose a writable "
                                        "folder") from None
    return path
