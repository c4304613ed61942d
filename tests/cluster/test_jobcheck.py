"""Can a job's account start its command (``luban.cluster.jobcheck``)? Mode bits evaluated for an
account that owns nothing here (a uid no file has), as execvp and the kernel would: the PATH search,
every directory on the way, the file, a script's interpreter and a venv's pyvenv.cfg."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from luban.cluster.accounts import Identity
from luban.cluster.jobcheck import problem

NOBODY = Identity("luban-tcheck", 54321, 54321, (54321,), "/nonexistent")
SH = os.path.realpath("/bin/sh")


@pytest.fixture
def tree():
    """A folder every account may enter (pytest's tmp_path is closed to them: its parents are 700)."""
    root = Path(tempfile.mkdtemp(prefix="luban-jobcheck-"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _script(path: Path, body: str, mode: int = 0o755) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    path.chmod(mode)
    return path


def _venv(at: Path) -> Path:
    """A venv-shaped folder (bin/python -> the system's sh, pyvenv.cfg, lib/) with a console
    script ``luban`` whose #! is that python, all open to everyone."""
    (at / "bin").mkdir(parents=True)
    (at / "lib").mkdir()
    (at / "bin" / "python").symlink_to(SH)
    _script(at / "pyvenv.cfg", "home = /usr/bin\n", 0o644)
    _script(at / "bin" / "luban", f"#!{at}/bin/python\nexit 0\n")
    for d in (at, at / "bin", at / "lib"):
        d.chmod(0o755)
    return at


def test_a_venv_under_a_closed_home_is_refused_naming_the_folder_and_the_fix(tree):
    home = tree / "home"
    venv = _venv(home / "venv")
    home.chmod(0o700)  # like /root or a home made with a umask of 077
    why = problem("luban", {"PATH": f"{venv}/bin:/usr/bin:/bin"}, None, NOBODY)
    assert why is not None and "\n" not in why
    assert why.startswith(f"command = 'luban' (found at {venv}/bin/luban): the job's account luban-tcheck lacks x on "
                          f"{home} (drwx------ "), why
    assert "docs/platform.md" in why and "/opt" in why
    home.chmod(0o755)
    assert problem("luban", {"PATH": f"{venv}/bin:/usr/bin:/bin"}, None, NOBODY) is None


def test_the_path_search_goes_on_past_a_blocked_copy_like_execvp(tree):
    closed = tree / "closed"
    _script(closed / "bin" / "tool", "#!/bin/sh\n")
    closed.chmod(0o700)
    _script(tree / "open" / "tool", "#!/bin/sh\n")
    assert problem("tool", {"PATH": f"{closed}/bin:{tree}/open"}, None, NOBODY) is None
    assert f"lacks x on {closed} " in problem("tool", {"PATH": f"{closed}/bin:/usr/bin"}, None, NOBODY)
    assert "not found on the job's PATH" in problem("no-such-tool-here", {"PATH": f"{tree}/open"}, None, NOBODY)


def test_the_file_the_script_and_its_interpreter(tree):
    assert "lacks x on" in problem(str(_script(tree / "noexec", "#!/bin/sh\n", 0o744)), {}, None, NOBODY)
    unreadable = _script(tree / "unreadable", "#!/bin/sh\n", 0o711)
    assert "lacks r on" in problem(str(unreadable), {}, None, NOBODY)
    assert problem(str(_script(tree / "binary-like", "\x7fELF", 0o711)), {}, None, NOBODY) is None  # not a script: x is enough
    hidden = tree / "hidden"
    _script(hidden / "python", f"#!{SH}\n")
    hidden.chmod(0o700)
    script = _script(tree / "uses-hidden", f"#!{hidden}/python\n")
    why = problem(str(script), {}, None, NOBODY)
    assert f"lacks x on {hidden} " in why and why.startswith(f"command = '{script}': ")
    env_script = _script(tree / "via-env", "#!/usr/bin/env hidden-tool\n")
    _script(hidden / "hidden-tool", "#!/bin/sh\n")
    assert f"lacks x on {hidden} " in problem(str(env_script), {"PATH": f"{hidden}:/usr/bin:/bin"}, None, NOBODY)


def test_a_venv_python_needs_its_pyvenv_cfg_and_packages(tree):
    venv = _venv(tree / "venv")
    assert problem(str(venv / "bin" / "luban"), {}, None, NOBODY) is None
    (venv / "pyvenv.cfg").chmod(0o600)
    assert f"lacks r on {venv}/pyvenv.cfg" in problem(str(venv / "bin" / "luban"), {}, None, NOBODY)
    (venv / "pyvenv.cfg").chmod(0o644)
    (venv / "lib").chmod(0o711)
    assert f"lacks rx on {venv}/lib" in problem(str(venv / "bin" / "luban"), {}, None, NOBODY)


def test_groups_symlinks_and_the_workdir(tree):
    shared = tree / "shared"
    _script(shared / "tool", "#!/bin/sh\n", 0o750)
    shared.chmod(0o750)
    gid = shared.stat().st_gid
    member = Identity("luban-tmember", 54321, 54322, (54322, gid), "/nonexistent")
    assert problem(str(shared / "tool"), {}, None, member) is None
    assert "lacks x on" in problem(str(shared / "tool"), {}, None, NOBODY)
    (tree / "link").symlink_to(shared)  # an open link into a closed folder is still closed
    assert f"lacks x on {shared} " in problem(str(tree / "link" / "tool"), {}, None, NOBODY)
    why = problem("/bin/sh", {}, str(shared), NOBODY)
    assert why.startswith(f"workdir = '{shared}': the job's account luban-tcheck lacks x on {shared} "), why
    assert problem("/bin/sh", {}, str(tree), NOBODY) is None


def test_a_path_behind_a_folder_the_account_cannot_enter_answers_alike_there_or_not(tree):
    """(2026-12-04) root looked first (os.path.exists): behind another user's closed home the answer was
    "lacks x" for a file that is there and "no such file" for one that is not, telling any user which
    files another has. Walked as the account, both read "lacks x" on the closed folder."""
    home = tree / "home"
    _script(home / "notes-salary.txt", "private\n", 0o644)
    home.chmod(0o700)
    there, absent = problem(str(home / "notes-salary.txt"), {}, None, NOBODY), problem(str(home / "none.txt"), {}, None, NOBODY)
    assert there is not None and absent is not None
    assert there.replace("notes-salary.txt", "X") == absent.replace("none.txt", "X") and "lacks x on" in there, (there, absent)
    assert problem(str(tree / "none.txt"), {}, None, NOBODY) == f"command = {str(tree / 'none.txt')!r}: no such file ({tree / 'none.txt'})"
