"""Claims of README.md, docs/data.md, docs/ARCHITECTURE.md and docs/parallelism.md checked the way a careless or
unlucky user meets them (a hostile review, 2026-11-28). Each test names the claim it holds luban to."""

from __future__ import annotations

import errno
import grp
import os
import selectors
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from luban.data import build
from luban.data.build import build_dataset
from luban.data.manifest import load_manifest, open_dataset
from tests import nobody
from tests.data.conftest import write_docs

ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 120  # one small build in a child process; far above its ~1 s

# A build whose process dies (os._exit: no clean-up, as kill -9) at its KILL_AT-th file removal after the
# swap, i.e. while it deletes the old copy of the dataset it replaced.
_KILLED_WHILE_DELETING = textwrap.dedent("""
    import os, sys
    from luban.data import build
    kill_at, count, armed = int(sys.argv[3]), [0], [False]
    exchange, unlink = build._exchange, os.unlink
    def exchanged(a, b):
        done = exchange(a, b)
        armed[0] = True
        return done
    def dying_unlink(*args, **kwargs):
        if armed[0]:
            count[0] += 1
            if count[0] == kill_at:
                os._exit(9)
        return unlink(*args, **kwargs)
    build._exchange, os.unlink = exchanged, dying_unlink
    build.build_dataset([sys.argv[1]], sys.argv[2], shard_size_mb=0.002)
""")


def test_a_build_killed_while_deleting_the_old_copy_leaves_nothing_behind_for_good(tmp_path):
    """docs/data.md: "the staging folder of a killed build is removed by the next build". Was (to 2026-11-28):
    the old copy was deleted by ``shutil.rmtree`` in the directory's order; a build killed after it had removed
    ``.luban`` and ``manifest.json`` but not the shards left ``.ds.building-PID`` holding shards and no mark of
    luban's, which every later build kept (it is not recognisably luban's), found by kill -9 at random
    moments of rebuilds: a dataset's worth of disk lost for good."""
    text = write_docs(tmp_path / "text", n_docs=8)
    build_dataset([text], tmp_path / "ds", shard_size_mb=0.002)
    removals = len(os.listdir(tmp_path / "ds")) + 1  # its files, then the folder
    for kill_at in range(1, removals + 1):
        child = subprocess.run([sys.executable, "-c", _KILLED_WHILE_DELETING, text, tmp_path / "ds", str(kill_at)],
                               capture_output=True, text=True, cwd=ROOT, timeout=CHILD_TIMEOUT_S)
        assert child.returncode in (0, 9), child.stderr
        open_dataset(tmp_path / "ds")  # the new dataset is in place whatever the moment
        build_dataset([text], tmp_path / "ds", shard_size_mb=0.002)  # the next build removes the dead one's
        left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ds."))
        assert left == [], f"killed at removal {kill_at}: {left} stays"


def test_two_builds_into_one_absent_folder_both_succeed(tmp_path, monkeypatch):
    """Two builds into one new folder at once: the one that swaps in second found the folder absent when it
    looked, then the first one's dataset there. Was (to 2026-11-28): ``os.rename`` onto it failed ENOTEMPTY, a
    traceback and exit 1 after the whole build; now it replaces it, as a rebuild does."""
    text = write_docs(tmp_path / "text", n_docs=6)
    build_dataset([text], tmp_path / "other", seed=5)
    rename = os.rename

    def racing(src, dst, *args, **kwargs):
        if Path(dst) == tmp_path / "ds" and not Path(dst).exists():
            shutil.copytree(tmp_path / "other", tmp_path / "ds")  # the other build's swap lands first
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", racing)
    manifest = build_dataset([text], tmp_path / "ds")
    assert load_manifest(tmp_path / "ds") == manifest and manifest["seed"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "other", "text"]


def _luban(*args, cwd=ROOT, **kwargs):
    return subprocess.run([sys.executable, "-m", "luban", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=CHILD_TIMEOUT_S, **kwargs)


def _one_line_error(proc, code: int, *fragments: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1 and lines[0].startswith("luban: error: "), proc.stderr
    assert "Traceback" not in proc.stderr and all(f in lines[0] for f in fragments), lines[0]


@pytest.mark.parametrize("name", ["point", "mount ü 数据"])
def test_a_mount_point_as_the_output_is_refused_before_the_build(tmp_path, name):
    """docs/ARCHITECTURE.md: luban writes into a folder that is absent, empty or its own; an empty folder that is
    a mount point (a data volume mounted at data/mine) is empty, but a build renames its stage onto the folder's
    name, which a mount point refuses. Was (to 2026-11-28): the whole build ran, then a traceback ("OSError:
    [Errno 16] Device or resource busy"), exit 1. Now one line before anything is read or written, exit 2.
    Needs ``mount --bind`` (root with CAP_SYS_ADMIN); skipped elsewhere."""
    text = write_docs(tmp_path / "text", n_docs=3)
    source, point = tmp_path / "volume", tmp_path / name
    source.mkdir()
    point.mkdir()
    mounted = subprocess.run(["mount", "--bind", source, point], capture_output=True, text=True, timeout=60)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.strip()}")
    try:
        proc = _luban("data", "build", text, "--out", point)
        _one_line_error(proc, 2, f"--out = {str(point)!r}: a folder that is not a mount point", "nothing was changed")
        assert list(point.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == sorted(
            ["text", "volume", name])
        build_dataset([text], point / "ds")  # a folder inside it, as the message says
        open_dataset(point / "ds")
    finally:
        subprocess.run(["umount", point], capture_output=True, timeout=60)


def test_an_output_folder_whose_parent_is_not_writable_is_named_as_such(tmp_path, monkeypatch):
    """A user's own writable folder under a folder they cannot write (/data/alice under root's /data): the build
    stages beside it, in the parent. Was (to 2026-11-28): "--out = '/data/alice': a folder that exists and is
    writable, or can be created (Permission denied)" — the folder is both. Now the message names the parent and
    a folder to use instead."""
    text = write_docs(tmp_path / "text", n_docs=3)
    (tmp_path / "alice").mkdir()
    mkdir = os.mkdir

    def parent_read_only(path, *args, **kwargs):  # root writes anywhere: the parent's refusal, as a user gets it
        if Path(path).parent == tmp_path and Path(path).name.startswith(".alice."):
            raise PermissionError(13, "Permission denied", str(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", parent_read_only)
    with pytest.raises(build.LubanError) as refused:
        build_dataset([text], tmp_path / "alice")
    message = str(refused.value)
    assert f"a build stages the dataset beside it, in {str(tmp_path)!r}" in message, message
    assert f"e.g. {str(tmp_path / 'alice' / 'ds')!r} (nothing was changed)" in message, message
    assert list((tmp_path / "alice").iterdir()) == []


@pytest.mark.parametrize("theirs", [".notes.tmp-1", ".draft.tmp-2026"])
def test_a_users_hidden_tmp_file_in_a_dataset_folder_is_not_deleted(tmp_path, theirs):
    """docs/ARCHITECTURE.md: "Nothing luban writes deletes what it did not write". A dataset folder's files were
    luban's by name, temporaries by the glob ``.*.tmp-*``: a user's ``.notes.tmp-1`` there passed for one of
    luban's and a rebuild deleted it (to 2026-11-28). Now only luban's temporaries of its own names count; the
    rebuild is refused, naming the file, and changes nothing."""
    text = write_docs(tmp_path / "text", n_docs=3)
    build_dataset([text], tmp_path / "ds")
    (tmp_path / "ds" / theirs).write_text("mine")
    before = load_manifest(tmp_path / "ds")
    with pytest.raises(build.LubanError, match=f"holds {theirs!r}, which luban did not write"):
        build_dataset([text], tmp_path / "ds", seed=1)
    assert (tmp_path / "ds" / theirs).read_text() == "mine" and load_manifest(tmp_path / "ds") == before
    (tmp_path / "ds" / f".manifest.json.tmp-{os.getpid()}").write_text("{")  # luban's own, from a killed write
    (tmp_path / "ds" / theirs).unlink()
    build_dataset([text], tmp_path / "ds", seed=1)
    assert sorted(p.name for p in (tmp_path / "ds").iterdir() if p.name.startswith(".")) == [".luban"]


# A build that stops once its stage is made, marked (and, now, locked), until a line comes on its stdin.
_PAUSED_BUILD = textwrap.dedent("""
    import sys
    from luban.data import build
    into = build._build_into
    def paused(*args, **kwargs):
        print("staged", flush=True)
        sys.stdin.readline()
        return into(*args, **kwargs)
    build._build_into = paused
    build.build_dataset([sys.argv[1]], sys.argv[2], seed=7)
""")


def test_a_live_build_that_this_machine_cannot_see_keeps_its_stage(tmp_path, monkeypatch):
    """docs/data.md: "the staging folder of a killed build is removed by the next build". A build was judged
    dead when its PID was not in this machine's /proc; one in another PID namespace (a container) or on another
    machine over NFS never is. Was (to 2026-11-28, seen with ``unshare --pid``): the second build removed the
    first's live stage and the first died with a traceback (FileNotFoundError, exit 1). Now a live build holds
    its stage's marker locked (flock) and no stage whose marker is locked is removed."""
    text = write_docs(tmp_path / "text", n_docs=4)
    first = subprocess.Popen([sys.executable, "-c", _PAUSED_BUILD, text, tmp_path / "ds"], cwd=ROOT, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with selectors.DefaultSelector() as wait:
            wait.register(first.stdout, selectors.EVENT_READ)
            assert wait.select(CHILD_TIMEOUT_S), "the first build never staged"
        assert first.stdout.readline() == "staged\n", first.communicate(timeout=CHILD_TIMEOUT_S)
        monkeypatch.setattr(build, "_ended", lambda pid: True)  # what a build in another PID namespace sees
        build_dataset([text], tmp_path / "ds")
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".ds.building-")] == [
            f".ds.building-{first.pid}"]
        out, err = first.communicate("\n", timeout=CHILD_TIMEOUT_S)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate(timeout=CHILD_TIMEOUT_S)
    assert first.returncode == 0, err
    assert load_manifest(tmp_path / "ds")["seed"] == 7  # the last to swap in wins, as in any rebuild
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "text"]


def test_a_stage_killed_while_its_marker_was_written_is_removed(tmp_path):
    """A build killed inside ``owned.mark`` (its temp file written, not yet renamed to ``.luban``) left a
    ``.ds.building-PID`` holding ``.luban.tmp-PID`` alone: neither empty nor marked, so no later build removed it
    (to 2026-11-28). A user's folder of that name holding anything else is still kept."""
    text = write_docs(tmp_path / "text", n_docs=3)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S).stdout.strip()  # the PID of a process that has ended
    dead = tmp_path / f".ds.building-{gone}"
    dead.mkdir()
    (dead / f".luban.tmp-{gone}").write_text('{"luban": "dataset"}\n')
    theirs = tmp_path / f".ds.building-{gone}0"
    theirs.mkdir()
    (theirs / ".luban.tmp-1").write_text("x")
    (theirs / "notes.txt").write_text("mine")
    build_dataset([text], tmp_path / "ds")
    assert not dead.exists() and (theirs / "notes.txt").read_text() == "mine"


def test_a_rebuild_keeps_the_folders_mode_and_group(tmp_path):
    """docs/data.md: a build into an empty folder or luban's own replaces the folder whole. Was (to 2026-11-28): the
    new folder was a plain one of the builder's umask and group, so a team's folder made ``chmod 2770; chgrp
    team`` became 0755 of the builder's group after the first build. Now the stage takes the old folder's mode and
    group before any file is made in it (its files then get the group, as in the old folder)."""
    text = write_docs(tmp_path / "text", n_docs=3)
    other = next((g.gr_gid for g in grp.getgrall() if g.gr_gid != os.getegid()), None)
    folder = tmp_path / "ds"
    folder.mkdir()
    try:
        if other is not None:
            os.chown(folder, -1, other)
    except PermissionError:
        other = None  # not root: keep this user's group, check the mode alone
    os.chmod(folder, 0o2770)
    for _ in range(2):  # into the empty folder, then a rebuild of luban's own
        build_dataset([text], folder)
        assert stat.S_IMODE(folder.stat().st_mode) == 0o2770
        if other is not None:
            assert {p.stat().st_gid for p in [folder, *folder.iterdir()]} == {other}


def _luban_as(uid: int, *args):
    """``luban ARGS`` run as ``uid`` (group too, no supplementary groups), by setpriv(1), with code that user
    can read (``tests/nobody.py``: CI's clone is in a mode-700 folder)."""
    code, site = nobody.code_paths()
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "env",
                           f"PYTHONPATH={code}:{site}", str(nobody.SYSTEM_PYTHON), "-m", "luban", *map(str, args)],
                          capture_output=True, text=True, cwd="/", timeout=CHILD_TIMEOUT_S)


@pytest.mark.skipif(nobody.UNAVAILABLE is not None, reason=f"to run builds as two other users: {nobody.UNAVAILABLE}")
def test_another_users_dataset_in_a_sticky_folder_is_refused_before_the_build(tmp_path):
    """Alice's dataset in a sticky folder (/tmp, a cluster's /scratch), shared writable: Bob's rebuild passed every
    check, built, then the swap's rename was refused (the sticky bit: only the owner may rename). Was (to
    2026-11-28): "PermissionError: [Errno 1] Operation not permitted", a traceback, exit 1. Now one line before
    the build, exit 2, Alice's dataset untouched."""
    alice, bob = 65534, 54321  # nobody, and a uid no account has
    shared = Path(tempfile.mkdtemp(prefix="luban-sticky-", dir="/tmp"))  # pytest's tmp_path is root's only (0700)
    try:
        os.chmod(shared, 0o1777)
        text = write_docs(shared / "text", n_docs=3)
        for p in [text, *text.iterdir()]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        made = _luban_as(alice, "data", "build", text, "--out", shared / "ds")
        assert made.returncode == 0, made.stderr
        os.chmod(shared / "ds", 0o777)  # Alice shares it
        before = load_manifest(shared / "ds")
        proc = _luban_as(bob, "data", "build", text, "--out", shared / "ds", "--seed", "1")
        _one_line_error(proc, 2, "another user's in", "sticky bit", "(nothing was changed)")
        assert load_manifest(shared / "ds") == before
        assert sorted(p.name for p in shared.iterdir()) == ["ds", "text"]
    finally:
        shutil.rmtree(shared)


def test_a_folder_name_too_long_for_the_stage_is_named_as_such(tmp_path):
    """A 250-byte folder name is a valid name (NAME_MAX 255), but the stage ``.NAME.building-PID`` is not. Was (to
    2026-11-28): "--out = ...: a folder that exists and is writable, or can be created (File name too long)" —
    which the folder can. Now the message says that the name must be shorter, and why."""
    text = write_docs(tmp_path / "text", n_docs=2)
    with pytest.raises(build.LubanError, match=r"a shorter folder name: a build stages the dataset beside it as "
                                               r"'\.NAME\.building-PID', here 2\d\d bytes"):
        build_dataset([text], tmp_path / ("d" * 250))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text"]


def test_a_refused_or_failed_build_removes_the_parent_folders_it_made(tmp_path, monkeypatch):
    """``--out a/b/<250-byte name>`` was refused, but left the empty ``a/b/`` it had made (to 2026-11-28); a
    build that fails while writing leaves none either. A folder that was there already is kept."""
    text = write_docs(tmp_path / "text", n_docs=2)
    with pytest.raises(build.LubanError, match="a shorter folder name"):
        build_dataset([text], tmp_path / "a" / "b" / ("d" * 250))
    (tmp_path / "kept").mkdir()
    def fail(*args, **kwargs):  # the storage failing part-way (a disk error while shards are written)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(build, "_build_into", fail)
    with pytest.raises(build.OutputWriteError):
        build_dataset([text], tmp_path / "kept" / "c" / "ds")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "text"] and not any((tmp_path / "kept").iterdir())


@pytest.mark.parametrize("replace", ["folder", "pipe", "link to a device", "gone"])
def test_a_tokenizer_that_is_not_a_file_is_not_called_missing(tmp_path, replace):
    """``luban data verify`` (and training) on a BPE dataset whose tokenizer.json is a folder, a named pipe or a link
    to /dev/zero said "(missing, but manifest.json names it)" (to 2026-11-28): it is there, as something else."""
    text = write_docs(tmp_path / "text", n_docs=6)
    build_dataset([text], tmp_path / "ds", tokenizer="bpe", vocab_size=300)
    path = tmp_path / "ds" / "tokenizer.json"
    path.unlink()
    {"folder": path.mkdir, "pipe": lambda: os.mkfifo(path), "link to a device": lambda: path.symlink_to("/dev/zero"),
     "gone": lambda: None}[replace]()
    proc = _luban("data", "verify", tmp_path / "ds")
    _one_line_error(proc, 2, f"{path}: cannot load the BPE tokenizer ("
                    + ("missing" if replace == "gone" else "not a regular file") + ", but manifest.json names it)")
