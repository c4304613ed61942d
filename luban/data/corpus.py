"""Input documents: the files a build reads, and the embedded default corpus.

Every input file is one document. The default corpus is real text present on every machine
with Python: the standard library's own ``.py`` sources (found via ``sysconfig``, minus
``site-packages`` and the ``test`` packages), taken in sorted relative-path order until
``max_bytes`` (default ``DEFAULT_MAX_BYTES`` = 4 MiB) would be exceeded. Nothing is
downloaded; the selection is deterministic for a given Python installation.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from luban.errors import LubanError, bad_value

DEFAULT_MAX_BYTES = 4 << 20
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus_files(max_bytes: int = DEFAULT_MAX_BYTES) -> list[Path]:
    """The standard library's ``.py`` files, sorted, capped at ``max_bytes`` in total."""
    root = stdlib_dir()
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]  # prune site-packages before walking
        found += [Path(folder, n) for n in names if n.endswith(".py")]
    if not found:
        raise LubanError(f"{root}: no standard-library sources found for the default corpus")
    return cap_files(sorted(found, key=lambda p: p.relative_to(root).as_posix()), max_bytes)


def collect_files(inputs: Iterable[str | Path], exclude: str | Path | None = None) -> list[Path]:
    """Expand files and folders (recursively, sorted, hidden entries skipped, links to folders not
    followed) into files, but for those inside ``exclude`` (the dataset being built: a rebuild of
    ``corpus/`` into ``corpus/ds`` tokenised the previous dataset's shards and manifest as text,
    growing with every rebuild) and inside any folder luban wrote (another dataset, a run, an
    export: binary, not text; skipped with a warning). A file named twice (``a.txt a.txt``, or a
    folder and a file in it) is one document, at its first place. A folder that cannot be listed is
    the user's input, named (it was skipped without a word)."""
    from luban import owned

    inputs = list(inputs)
    for item in inputs:
        if not str(item).strip():  # Path("") is ".": an unset shell variable would tokenise the working folder
            raise bad_value("INPUTS", str(item), "a file or folder path, not an empty string")
    inputs = [Path(i) for i in inputs]
    files: list[Path] = []
    skipped: list[Path] = []
    for item in inputs:
        if item.is_file():
            files.append(item)
        elif item.is_dir():
            kind = owned.owner(item)
            if kind not in ("empty", None):
                raise bad_value("INPUTS", str(item), f"a folder of text files, not {owned.KINDS[kind]} luban wrote "
                                                     "(its files are not text); nothing was changed")
            files.extend(_walk(item, skipped, exclude))
        else:
            raise bad_value("INPUTS", str(item), "an existing text file or folder")
    if skipped:
        print(f"luban: warning: INPUTS: {len(skipped)} folder(s) that luban wrote (a dataset, a run, an export: not "
              f"text) skipped, e.g. {str(skipped[0])!r}", file=sys.stderr, flush=True)
    if exclude is not None:
        own = Path(exclude).resolve()
        files = [f for f in files if own not in f.resolve().parents]
    seen: set[Path] = set()
    files = [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]
    if not files:
        raise LubanError(f"INPUTS = {[str(i) for i in inputs]}: no files found to tokenise")
    return files


def _walk(root: Path, skipped: list[Path], exclude: str | Path | None = None) -> list[Path]:
    """The files below ``root``, sorted by relative path; the folders luban wrote go to ``skipped``, but
    ``exclude`` (the dataset being rebuilt: no warning for it, docs/data.md)."""
    from luban import owned

    def refuse(err: OSError):
        raise bad_value("INPUTS", str(err.filename or root), f"a readable folder ({err.strerror or err}); "
                                                             "nothing was changed")

    own = Path(exclude).resolve() if exclude is not None else None
    found = []
    for folder, dirs, names in os.walk(root, onerror=refuse):  # links to folders: not followed
        here = Path(folder)
        keep = []
        for name in sorted(dirs):
            if name.startswith(".") or (here / name).resolve() == own:
                continue
            if owned.owner(here / name) not in ("empty", None):
                skipped.append(here / name)
            else:
                keep.append(name)
        dirs[:] = keep
        found += [here / n for n in names if not n.startswith(".") and (here / n).is_file()]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def cap_files(files: list[Path], max_bytes: int | None) -> list[Path]:
    """The longest prefix of ``files`` whose sizes sum to at most ``max_bytes`` (None: all)."""
    if max_bytes is None:
        return files
    kept, total = [], 0
    for path in files:
        total += file_size(path)
        if total > max_bytes:
            break
        kept.append(path)
    if not kept:
        raise bad_value("--max-bytes", max_bytes,
                        f"at least the size of the first file ({files[0]}: "
                        f"{file_size(files[0])} bytes)")
    return kept


def unreadable(path: Path, err: OSError) -> LubanError:
    """An input file that cannot be read (gone since it was listed, a failing disk, no permission):
    the user's input, named, not the dataset's storage."""
    return bad_value("INPUTS", str(path), f"a readable text file ({err.strerror or err}); nothing was changed")


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as err:
        raise unreadable(path, err) from None


def read_text(path: Path) -> str:
    """A document's text; bytes that are not UTF-8 become U+FFFD. A file that reads more or fewer bytes
    than its size (a ``/proc`` file's size is 0; one written to during the build) is refused: ``--max-bytes``
    and the manifest's byte count come from the sizes, and a rebuild would not tokenise the same text."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read()
    except OSError as err:
        raise unreadable(path, err) from None
    if len(data) != size:
        raise bad_value("INPUTS", str(path), f"a regular text file whose size stays as listed (it read {len(data)} "
                        f"bytes, its size says {size}: a /proc-like or changing file); copy it to a file first; "
                        "nothing was changed")
    return data.decode("utf-8", errors="replace")
