"""The one declaration of each command-line value's type and range.

Every factory here returns a parser: a callable that takes the text of a flag (or a value an API
caller passed) and returns it converted, or raises ``Invalid`` saying what is allowed. The
parsers are argparse ``type=`` callables, so ``luban.cli.Parser`` reports a bad flag as
``luban: error: --key = 'value': <allowed>`` (exit 2), and ``check(key, value, parser)``
applies the same declaration to a Python API argument, raising ``LubanError``.

    integer(1, 65535)("80")            -> 80
    number(0, 1, open_hi=True)("nan")  -> Invalid: a finite number in [0, 1)
    path("dir")("/etc/passwd")         -> Invalid: an existing folder

Ranges that two modules share are declared once below (``SEED``, ``PORT``) and imported.
"""

from __future__ import annotations

import argparse
import math
import numbers
import operator
import os
import re
from pathlib import Path

from luban.errors import LubanError, bad_value

SEED = (0, (1 << 32) - 1)  # numpy/torch seed range (config train.seed, data build --seed, sample --seed, ...)
PORT = (0, 65535)
CLUSTER_NODES = (1, 100_000)  # nodes of one cluster or simulation (serve, submit -n, quotas, traces)
INT32 = (-(1 << 31), (1 << 31) - 1)  # the service's SQL Integer columns (PostgreSQL int4): ids, counts


class Invalid(argparse.ArgumentTypeError):
    """A value outside its declaration: the number when the text was one (``nan``, ``-1``), else
    the text (``'abc'``). ``str()`` is ``<value!r>: <allowed>``, which ``luban.cli.Parser``
    prefixes with the flag: ``--key = <value!r>: <allowed>``."""

    def __init__(self, value, allowed: str):
        super().__init__(f"{value!r}: {allowed}")
        self.value, self.allowed = value, allowed


def _num(x) -> str:
    """A bound as typed: an integer whole (2**50 is 1125899906842624, not 1.1259e+15), a float short."""
    if isinstance(x, int) and not isinstance(x, bool):
        return str(x)
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _range(lo, hi, open_lo: bool = False, open_hi: bool = False) -> str:
    """``from 1 to 9``, ``in (0, 1]``, ``> 0``, ``>= 1``, ``<= 9`` or nothing."""
    if lo is not None and hi is not None:
        return (f"in {'(' if open_lo else '['}{_num(lo)}, {_num(hi)}{')' if open_hi else ']'}"
                if open_lo or open_hi else f"from {_num(lo)} to {_num(hi)}")
    if lo is not None:
        return f"{'>' if open_lo else '>='} {_num(lo)}"
    return f"{'<' if open_hi else '<='} {_num(hi)}" if hi is not None else ""


def _declared(parse, allowed: str):
    parse.allowed = allowed  # what Parser shows for a flag given without its value
    return parse


# what an integer is on the command line: ASCII decimal digits, a sign; not int()'s surrounding spaces,
# underscores or other scripts' digits (``luban stop ٣`` stopped job 3, 2026-11-28)
DECIMAL = re.compile(r"[+-]?[0-9]+")
_NUMBER = r"(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf(?:inity)?|nan)"
FLOAT = re.compile(r"[+-]?" + _NUMBER, re.IGNORECASE)
# what argparse takes for a negative number (a flag's value, not an option): its own matcher takes only
# -1 and -1.5 (argparse.ArgumentParser._negative_number_matcher), so `--quantum -inf` or `--gpus -1e3` was
# "(missing)" instead of the flag's own one-line error (luban.cli.Parser sets this one)
NEGATIVE_NUMBER = re.compile("^-" + _NUMBER + "$", re.IGNORECASE)


def integer(lo: int | None = None, hi: int | None = None):
    """A whole number in [lo, hi] (decimal text, or an integer; not a bool, not 1.0)."""
    allowed = f"an integer {_range(lo, hi)}".rstrip()

    def parse(text) -> int:
        try:
            if isinstance(text, bool):
                raise TypeError
            if isinstance(text, str) and not DECIMAL.fullmatch(text):  # int() also takes " 7", "1_0", "٣"
                raise ValueError
            value = int(text) if isinstance(text, str) else operator.index(text)
        except (TypeError, ValueError):
            raise Invalid(text, allowed) from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise Invalid(value, allowed)
        return value

    return _declared(parse, allowed)


def number(lo: float | None = None, hi: float | None = None, *, open_lo: bool = False, open_hi: bool = False,
           also: tuple[float, ...] = ()):
    """A finite number in the range (``open_lo``/``open_hi`` exclude the bound), or one of the
    exact values ``also`` (e.g. ``0`` for "off", ``math.inf`` for "unlimited")."""
    allowed = f"a finite number {_range(lo, hi, open_lo, open_hi)}".rstrip()
    if also:
        allowed = " or ".join(_num(a) if math.isfinite(a) else str(a) for a in also) + ", or " + allowed

    def parse(text) -> float:
        try:
            if isinstance(text, bool) or not isinstance(text, (numbers.Real, str)):
                raise TypeError
            if isinstance(text, str) and not FLOAT.fullmatch(text):  # float() also takes " 7", "1_0", "٣"
                raise ValueError
            value = float(text)
        except (TypeError, ValueError, OverflowError):
            raise Invalid(text, allowed) from None
        if value in also:
            return value
        if not math.isfinite(value) or (lo is not None and (value <= lo if open_lo else value < lo)) or \
                (hi is not None and (value >= hi if open_hi else value > hi)):
            raise Invalid(value, allowed)
        return value

    return _declared(parse, allowed)


def choice(*options: str):
    """One of the strings ``options``."""
    allowed = "one of " + ", ".join(map(repr, options))

    def parse(value) -> str:
        if value not in options:
            raise Invalid(value, allowed)
        return value

    return _declared(parse, allowed)


def text(pattern: str | None = None, allowed: str = "non-empty UTF-8 text", *, empty: bool = False):
    """A string that is valid UTF-8 (no lone surrogates from undecodable argv bytes) without NUL
    (no argv, path or C string holds one), non-empty unless ``empty``, matching ``pattern`` if given."""
    regex = re.compile(pattern) if pattern else None

    def parse(value) -> str:
        if not isinstance(value, str) or (not value and not empty) or "\x00" in value or not _utf8(value):
            raise Invalid(value, allowed)
        if regex is not None and not regex.fullmatch(value):
            raise Invalid(value, allowed)
        return value

    return _declared(parse, allowed)


def _utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: an undecodable byte of argv or a file name
        return False
    return True


PATH_KINDS = {"file": "an existing file", "dir": "an existing folder",
              "new-file": "a new file's path in an existing, writable folder (luban never overwrites a file)",
              "new-dir": "a folder that exists and is writable, or can be created"}


# kernel and pseudo file systems: no new files there, whatever os.access says (root passes it everywhere)
PSEUDO_FS = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "securityfs", "debugfs", "tracefs", "pstore", "bpf",
             "configfs", "fusectl", "mqueue", "binfmt_misc", "autofs", "efivarfs", "hugetlbfs", "rpc_pipefs", "nsfs"}


def _mount_of(folder: Path) -> tuple[str, set[str]]:
    """The file-system type and mount options of the mount holding ``folder`` (/proc/self/mountinfo)."""
    best, found = "", ("", set())
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    target = os.path.realpath(folder)
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or not tail:
            continue
        point = fields[4].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, found = point, (tail[0], set(fields[5].split(",")))
    return found


def writable_folder(folder: Path) -> bool:
    """Whether a new file can be made in ``folder``, checked without making one: permissions (for
    other users than root), and for everyone a mount that is neither read-only nor a kernel one
    (/proc, /sys: root passes os.access there, and the write then fails)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    fs_type, options = _mount_of(folder)
    return fs_type not in PSEUDO_FS and "ro" not in options


def path(kind: str):
    """A path checked for existence, type and writability:

    ``file``/``dir``: exists and is a file/folder; ``new-file``: a file to create: nothing by that
    name yet (a user's file is never overwritten; the write itself is ``luban.data.atomic.create_bytes``),
    its folder exists and is writable; ``new-dir``: a folder to write into: an existing
    writable folder, or one that can be created (its nearest existing ancestor is a writable folder).
    """
    allowed = PATH_KINDS[kind]

    def parse(value) -> str:
        if isinstance(value, str) and not _utf8(value):  # (it said "an existing folder" of one that exists)
            raise Invalid(value, f"{allowed}, named in UTF-8: this name holds bytes that are not UTF-8 text, "
                                 "which luban's records (JSON) cannot hold; rename it")
        value = text(allowed=allowed)(value)
        try:
            ok = _path_is(Path(value), kind)
        except OSError as err:  # a name too long for the file system (pathlib raises ENAMETOOLONG)
            raise Invalid(value, f"{allowed} ({err.strerror or err})") from None
        if not ok:
            raise Invalid(value, allowed)
        return value

    return _declared(parse, allowed)


def _path_is(p: Path, kind: str) -> bool:
    """Whether ``p`` is what ``path(kind)`` accepts."""
    if kind == "file":
        return p.is_file()
    if kind == "dir":
        return p.is_dir()
    if kind == "new-file":
        return not os.path.lexists(p) and p.parent.is_dir() and writable_folder(p.parent)
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p.is_dir() and writable_folder(p)


def custom(convert, allowed: str, shown=None):
    """``convert(value)``; a ``ValueError``, ``LubanError`` or ``Invalid`` it raises is reported as ``allowed``,
    with the value as ``shown`` gives it (a URL without its password, ``errors.without_password``)."""

    def parse(value):
        try:
            return convert(value)
        except (ValueError, LubanError, Invalid):
            raise Invalid(value if shown is None else shown(value), allowed) from None

    return _declared(parse, allowed)


def check(key: str, value, parse):
    """``parse(value)`` for an API argument: ``Invalid`` becomes the usual ``LubanError``."""
    try:
        return parse(value)
    except Invalid as err:
        raise bad_value(key, value, err.allowed) from None
