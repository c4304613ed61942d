"""Data builds, a hostile review of 2026-12-03.

- A rebuild deleted what a user put into ``--out`` while it ran (the folder was checked only at the
  start; the old copy was then deleted whole, subfolders too): a file there at swap time now
  refuses the swap (exit 2, the old dataset and the file kept); one that slips in at the last
  instant stays, with the old copy's folder, named in a warning. Deleting a dataset folder removes
  only a dataset's files.
- A dataset (or a run, an export) inside the input tree was tokenised as text, growing with every
  rebuild into another ``--out``: such folders are skipped with a warning; one named as the input
  is refused.
- A subfolder that cannot be listed was skipped without a word: now one line, exit 2.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from luban.data import build
from luban.data.build import build_dataset
from luban.data.manifest import load_manifest
from luban.errors import LubanError
from tests.nobody import NOBODY, SYSTEM_PYTHON, UNAVAILABLE, code_paths


def corpus(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "a.txt").write_text("the quick brown fox\n" * 20)
    (root / "b.txt").write_text("jumps over the lazy dog\n" * 20)
    return root


def tokens(ds: Path) -> int:
    return sum(split["tokens"] for split in load_manifest(ds)["splits"].values())


@pytest.mark.parametrize("before", ["no dataset yet", "a dataset there"])
def test_a_file_put_into_out_during_a_build_refuses_the_swap_and_stays(tmp_path, monkeypatch, before):
    text, out = corpus(tmp_path / "text"), tmp_path / "ds"
    if before == "a dataset there":
        build_dataset([text / "a.txt"], out)
    old = sorted(p.name for p in out.iterdir()) if out.exists() else None
    real = build._build_into

    def user_writes_during_the_build(out_dir, *args):
        manifest = real(out_dir, *args)
        out.mkdir(exist_ok=True)
        (out / "notes").mkdir()
        (out / "notes" / "plot.txt").write_text("mine")
        (out / "README.md").write_text("mine too")
        return manifest

    monkeypatch.setattr(build, "_build_into", user_writes_during_the_build)
    with pytest.raises(LubanError) as refused:
        build_dataset([text], out)
    assert "holds 'README.md', which luban did not write; it appeared during the build: the new dataset was not " \
           "swapped in" in str(refused.value), refused.value
    assert (out / "README.md").read_text() == "mine too" and (out / "notes" / "plot.txt").read_text() == "mine"
    left = sorted(p.name for p in out.iterdir() if p.name not in ("README.md", "notes"))
    assert left == (old or []), left  # the old dataset as it was (or nothing)
    assert [p.name for p in tmp_path.iterdir() if ".building-" in p.name] == []  # the stage is gone


def test_a_file_that_slips_in_at_the_swap_is_kept_with_the_old_copy_and_named(tmp_path, monkeypatch, capfd):
    text, out = corpus(tmp_path / "text"), tmp_path / "ds"
    build_dataset([text / "a.txt"], out)
    first = tokens(out)
    real = build._exchange

    def user_writes_at_the_swap(a, b):
        (Path(b) / "late.txt").write_text("mine")
        return real(a, b)

    monkeypatch.setattr(build, "_exchange", user_writes_at_the_swap)
    build_dataset([text], out)
    assert tokens(out) > first  # the new dataset is in place
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("ds.kept-")]
    assert len(kept) == 1 and sorted(p.name for p in kept[0].iterdir()) == ["late.txt"], kept  # only the user's file
    assert (kept[0] / "late.txt").read_text() == "mine"
    err = capfd.readouterr().err
    assert "'late.txt', which luban did not write, appeared in it during the build; it is kept" in err, err
    assert str(kept[0]) in err
    build_dataset([text], out)  # a later build leaves the user's folder alone
    assert (kept[0] / "late.txt").read_text() == "mine"


def test_deleting_a_dataset_folder_removes_only_a_dataset_s_files(tmp_path):
    out = tmp_path / "ds"
    build_dataset([corpus(tmp_path / "text")], out)
    (out / "sub").mkdir()
    (out / "sub" / "x.bin").write_text("mine")
    assert build._delete(out) == ["sub"]
    assert sorted(p.name for p in out.iterdir()) == ["sub"] and (out / "sub" / "x.bin").read_text() == "mine"


def test_a_dataset_inside_the_inputs_is_skipped_and_one_named_as_input_is_refused(tmp_path, capfd):
    text = corpus(tmp_path / "corpus")
    build_dataset([text], text / "byte")
    once = tokens(text / "byte")
    build_dataset([text], text / "byte2")  # the first dataset is not read as text
    assert tokens(text / "byte2") == once
    assert "1 folder(s) that luban wrote (a dataset, a run, an export: not text) skipped" in capfd.readouterr().err
    build_dataset([text], text / "byte")  # nor the second: rebuilds do not grow
    assert tokens(text / "byte") == once
    with pytest.raises(LubanError) as refused:
        build_dataset([text / "byte"], tmp_path / "other")
    assert "a folder of text files, not a dataset luban wrote" in str(refused.value)
    assert not (tmp_path / "other").exists()


@pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))
def test_a_subfolder_that_cannot_be_listed_is_one_line(tmp_path):
    base = Path(tempfile.mkdtemp(prefix="luban-unlisted-"))
    try:
        base.chmod(0o755)
        (base / "in" / "locked").mkdir(parents=True)
        (base / "in" / "a.txt").write_text("readable")
        (base / "in" / "locked" / "z.txt").write_text("hidden from nobody")
        (base / "in").chmod(0o755)
        (base / "in" / "locked").chmod(0o000)
        (base / "out").mkdir(mode=0o777)
        os.chmod(base / "out", 0o777)
        code, site = code_paths()
        proc = subprocess.run([*NOBODY, "env", f"PYTHONPATH={code}:{site}", "HOME=/tmp", str(SYSTEM_PYTHON), "-m",
                               "luban", "data", "build", str(base / "in"), "--out", str(base / "out" / "ds")],
                              capture_output=True, text=True, timeout=300, cwd="/tmp")
        assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
        assert proc.stderr.strip() == f"luban: error: INPUTS = '{base / 'in' / 'locked'}': a readable folder " \
                                      "(Permission denied); nothing was changed", proc.stderr
        assert not (base / "out" / "ds").exists()
    finally:
        (base / "in" / "locked").chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


def test_sigterm_during_a_build_removes_the_stage_and_exits_143(tmp_path):
    """SIGTERM (a scheduler's stop) ended the build at once: its stage (as big as the dataset) stayed."""
    import signal
    import time

    from tests.child import Child

    text = tmp_path / "text"
    text.mkdir()
    line = "some words of text to tokenise, " * 320  # 10 KiB
    for i in range(3000):  # 30 MB: a few seconds to build
        (text / f"{i:05d}.txt").write_text(line)
    with Child([sys.executable, "-m", "luban", "data", "build", str(text), "--out", str(tmp_path / "ds")]) as child:
        deadline = time.monotonic() + 120
        while not any((p / ".luban").exists() for p in tmp_path.glob(".ds.building-*")):
            assert child.proc.poll() is None, child.tail()
            assert time.monotonic() < deadline, child.tail()
            time.sleep(0.01)
        child.proc.send_signal(signal.SIGTERM)
        code = child.wait(120)
        output = child.output()
    if code == 0:
        pytest.skip("the build ended before the signal came")  # a fast machine: nothing to test this time
    assert code == 143 and "Traceback" not in output, (code, output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text"], list(tmp_path.iterdir())


def test_a_document_too_big_for_memory_is_one_line(tmp_path):
    """A file is one document, read and tokenised whole: one larger than memory was a MemoryError traceback."""
    big = tmp_path / "in" / "one-line.txt"
    big.parent.mkdir()
    with open(big, "wb") as f:
        f.write(b"x" * (160 << 20))
    code = ("import resource, sys\n"
            "import luban.cli, luban.data.build, numpy\n"
            "size = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmSize:')) * 1024\n"
            "resource.setrlimit(resource.RLIMIT_AS, (size + (400 << 20),) * 2)\n"
            "sys.exit(luban.cli.main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", code, "data", "build", str(big.parent), "--out", str(tmp_path / "ds")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr.strip() == f"luban: error: INPUTS = '{big}': a file this machine can tokenise ({160 << 20} " \
                                  "bytes ran out of memory: each file is one document, read and tokenised whole); " \
                                  "split it into smaller files (the dataset already there is kept)", proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
