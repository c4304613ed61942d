"""`luban data` used the way a hostile, careless or unlucky user would (a hostile sweep, 2026-11-27,
the second of the day): each case was a traceback, a wrong exit code, a leak or a silent acceptance."""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest

from luban.data.build import build_dataset
from luban.data.loader import TokenLoader
from luban.data.manifest import load_manifest, write_manifest
from luban.data.shards import HEADER, HEADER_CRC_OFFSET, ShardReader, ShardWriter
from luban.errors import LubanError

ROOT = Path(__file__).resolve().parents[2]


def luban_data(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "luban", "data", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, **kwargs)


def assert_one_line(proc, code: int, *fragments: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1 and lines[0].startswith("luban: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_an_unreadable_input_is_named_as_the_input(tmp_path, write_docs, tokenizer):
    """An input file whose read fails (EIO here; a file deleted or made unreadable mid-build alike) was
    reported as the *dataset* failing to be written ('free space', exit 74), or was a traceback."""
    text = write_docs(tmp_path / "text", n_docs=3)
    old = build_dataset([text], tmp_path / "ds")
    (text / "mem.txt").symlink_to("/proc/self/mem")  # a regular file whose first read fails with EIO
    proc = luban_data("build", text, "--out", tmp_path / "ds", "--tokenizer", tokenizer)
    assert_one_line(proc, 2, f"INPUTS = '{text / 'mem.txt'}': a readable text file (Input/output error)")
    assert load_manifest(tmp_path / "ds") == old and not list(tmp_path.glob(".ds.*"))


@pytest.mark.parametrize("target", ["ds", "nowhere"])
def test_an_output_that_is_a_symbolic_link_is_refused_untouched(tmp_path, write_docs, target):
    """`--out LINK` (to a dataset, or dangling) was a traceback after the whole build: the rename
    swapped the link itself, leaving a stray link behind (or failed with ENOTDIR)."""
    text = write_docs(tmp_path / "text", n_docs=3)
    old = build_dataset([text], tmp_path / "ds")
    (tmp_path / "link").symlink_to(tmp_path / target)
    proc = luban_data("build", text, "--out", tmp_path / "link")
    assert_one_line(proc, 2, f"--out = '{tmp_path / 'link'}': a folder, not a symbolic link")
    assert os.readlink(tmp_path / "link") == str(tmp_path / target) and not list(tmp_path.glob(".link*"))
    assert load_manifest(tmp_path / "ds") == old


def test_an_output_ending_in_dot_dot_is_refused_and_nothing_made(tmp_path, write_docs):
    """`--out e/sub/..` made e/sub, built, then failed to rename onto '..' (EBUSY): a traceback."""
    text = write_docs(tmp_path / "text", n_docs=3)
    (tmp_path / "e").mkdir()
    proc = luban_data("build", text, "--out", f"{tmp_path}/e/sub/..")
    assert_one_line(proc, 2, "--out = ", "(not the current folder, '..' or '/')")
    assert list((tmp_path / "e").iterdir()) == []


def test_a_stage_that_cannot_even_be_marked_is_removed(tmp_path, write_docs):
    """A storage refusal at the stage's marker (a full disk at start; here EFBIG) left a hidden
    `.ds.building-PID` holding `.luban.tmp-PID` that no later build would remove, and said exit 2."""
    text = write_docs(tmp_path / "text", n_docs=3)

    def no_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    proc = luban_data("build", text, "--out", tmp_path / "ds", preexec_fn=no_files)
    assert_one_line(proc, 74, "could not be written (File too large)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text"]


def test_a_users_folder_named_as_this_builds_stage_is_kept(tmp_path, write_docs):
    """The build deleted `.NAME.building-<its pid>` before making its stage, whatever it held."""
    text = write_docs(tmp_path / "text", n_docs=3)
    theirs = tmp_path / f".ds.building-{os.getpid()}"
    theirs.mkdir()
    (theirs / "thesis.tex").write_text("mine")
    with pytest.raises(LubanError, match="--out = "):
        build_dataset([text], tmp_path / "ds")
    assert (theirs / "thesis.tex").read_text() == "mine"


def test_one_huge_document_is_held_in_the_shard_token_type(tmp_path):
    """A document's ids were appended their EOS as int64 (8 bytes per byte of text: a 2 GB line needed
    over 24 GB and the build was killed for memory); now uint16 (peak about 4 bytes per byte)."""
    size = 8 << 20
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "line.txt").write_bytes(b"x" * size)
    tracemalloc.start()
    try:
        build_dataset([tmp_path / "text"], tmp_path / "ds", val_fraction=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6 * size, peak / size
    assert load_manifest(tmp_path / "ds")["splits"]["train"]["tokens"] == size + 1


def _shard(path: Path) -> bytes:
    with ShardWriter(path, np.uint16, 16) as w:
        for i in range(4):
            w.add_document(np.arange(i * 7 + 3) % 257)
        w.close()
    return path.read_bytes()


def _resigned(data: bytes, index_crc: bool = False, **fields) -> bytes:
    """``data`` with header fields replaced and its CRCs made to match (a hostile, not a random, edit); with
    ``index_crc``, the document index's CRCs too (format version 2: the index CRC after the chunk-CRC table,
    and the header's CRC of that table and index CRC; version 1: the header's CRC of index and table)."""
    names = ("magic", "version", "code", "chunk", "tokens", "documents", "tokens_offset", "index_offset",
             "crc_offset", "index_crc", "header_crc")
    values = dict(zip(names, HEADER.unpack(data[:64])), **fields)
    if index_crc and values["version"] == 1:
        values["index_crc"] = zlib.crc32(data[values["index_offset"]:])
    elif index_crc:
        data = data[:-4] + struct.pack("<I", zlib.crc32(data[values["index_offset"]:values["crc_offset"]]))
        values["index_crc"] = zlib.crc32(data[values["crc_offset"]:])
    head = HEADER.pack(*values.values())[:HEADER_CRC_OFFSET]
    return head + struct.pack("<I", zlib.crc32(head)) + data[64:]


def _unordered_index(data: bytes) -> bytes:
    index_offset = HEADER.unpack(data[:64])[7]
    out = bytearray(data)
    out[index_offset + 8:index_offset + 16] = struct.pack("<Q", 10**12)  # document 1 starts past the end
    return _resigned(bytes(out), index_crc=True)


@pytest.mark.parametrize("edit,message", [
    (lambda d: _resigned(d, documents=64), "section offsets"),
    (lambda d: _resigned(d, code=2), "section offsets"),
    (lambda d: _resigned(d, index_offset=200), "section offsets"),
    (lambda d: _resigned(d, documents=1 << 63), "section offsets"),
    (_unordered_index, "document index out of order"),
])
def test_a_crafted_shard_header_is_named_not_a_traceback(tmp_path, edit, message):
    """Header fields that agree with their CRCs but not with each other were ValueError, OverflowError
    or IndexError tracebacks (numpy reading past the index, a memmap past the file)."""
    path = tmp_path / "s.bin"
    path.write_bytes(edit(_shard(path)))
    with pytest.raises(LubanError, match=message):
        reader = ShardReader(path)
        reader.verify()
        [reader.document(i) for i in range(reader.documents)]


def test_shards_swapped_on_disk_are_caught(tmp_path):
    """Two shards of the same size swapped (or one replaced by another dataset's of the same size)
    verified and trained on, in another order: the manifest now records each shard's header CRC."""
    (tmp_path / "text").mkdir()
    for i in range(4):
        (tmp_path / "text" / f"d{i}.txt").write_text(chr(ord("a") + i) * 3000)
    build_dataset([tmp_path / "text"], tmp_path / "ds", shard_size_mb=0.005, val_fraction=0)
    first, second = tmp_path / "ds" / "train-00000.bin", tmp_path / "ds" / "train-00001.bin"
    assert first.stat().st_size == second.stat().st_size
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(b)
    second.write_bytes(a)
    assert_one_line(luban_data("verify", tmp_path / "ds"), 2, f"{first}: {{'header_crc32': ",
                    "disagrees with manifest.json")
    with pytest.raises(LubanError, match="header_crc32"):
        TokenLoader(tmp_path / "ds", seq_len=8, global_batch=2)
    manifest = load_manifest(tmp_path / "ds")  # a dataset built before the CRC was recorded: checked without it
    for shard in manifest["splits"]["train"]["shards"]:
        del shard["header_crc32"]
    write_manifest(tmp_path / "ds", {k: v for k, v in manifest.items() if k != "checksum"})
    assert luban_data("verify", tmp_path / "ds").returncode == 0


@pytest.mark.parametrize("change,message", [
    (lambda m: m["tokenizer"].update(sha256=None), "tokenizer.sha256 = None: the 64 hex digits"),
    (lambda m: m["tokenizer"].update(sha256=7), "tokenizer.sha256 = 7: the 64 hex digits"),
    (lambda m: m.update(source=None), "source = None: a table with kind"),
    (lambda m: m.update(source=[]), "source = []: a table with kind"),
    (lambda m: m["source"].update(files="many"), "source.files = 'many': an integer from 0 to 9223372036854775807"),
    (lambda m: m.pop("val_fraction"), "val_fraction = None: a number in [0, 1)"),
    (lambda m: m.pop("seed"), "seed = None: an integer >= 0"),
])
@pytest.mark.parametrize("action", ["verify", "info"])
def test_a_manifest_description_is_checked(tmp_path, write_docs, change, message, action):
    """Re-checksummed manifests whose tokenizer.sha256, source, val_fraction or seed had another type
    were TypeError/KeyError tracebacks in `luban data verify` or `info` (and `ensure_default_dataset`)."""
    build_dataset([write_docs(tmp_path / "text", n_docs=4)], tmp_path / "ds", tokenizer="bpe", vocab_size=300)
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    change(manifest)
    write_manifest(tmp_path / "ds", {k: v for k, v in manifest.items() if k != "checksum"})
    assert_one_line(luban_data(action, tmp_path / "ds"), 2, message)


@pytest.mark.parametrize("name", ["manifest.json", "tokenizer.json"])
def test_a_users_folder_called_manifest_json_is_not_luban_s(tmp_path, write_docs, name):
    """A folder holding a *folder* named manifest.json (or tokenizer.json) passed for luban's own dataset:
    the build swapped it out and deleted it, with the user's files in it."""
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    (out / name / "thesis.tex").write_text("mine")
    if name != "manifest.json":
        build_dataset([write_docs(tmp_path / "old", n_docs=2)], tmp_path / "ds")
        (tmp_path / "ds" / name).mkdir()  # beside a real manifest
        (tmp_path / "ds" / name / "thesis.tex").write_text("mine")
        out = tmp_path / "ds"
    proc = luban_data("build", write_docs(tmp_path / "text", n_docs=3), "--out", out)
    assert_one_line(proc, 2, f"holds '{name}', which luban did not write")
    assert (out / name / "thesis.tex").read_text() == "mine"


def test_a_racing_build_removing_a_dead_stage_meanwhile(tmp_path, write_docs, monkeypatch):
    """Builds racing into one folder after a killed one: each sweeps the dead stage, and the slower
    one's stat of it was a FileNotFoundError traceback (3 racing builds: 5 of 30 failed)."""
    from luban import owned

    text = write_docs(tmp_path / "text", n_docs=3)
    build_dataset([text], tmp_path / "dead")
    dead = tmp_path / ".ds.building-999998"  # a complete build killed before its swap
    (tmp_path / "dead").rename(dead)
    real = owned.owner

    def swept_meanwhile(path):
        found = real(path)
        if Path(path) == dead:
            import shutil
            shutil.rmtree(dead)  # the other build's recover() at this very moment
        return found
    monkeypatch.setattr(owned, "owner", swept_meanwhile)
    assert build_dataset([text], tmp_path / "ds", seed=5)["seed"] == 5


def test_a_live_builds_complete_stage_is_not_taken(tmp_path, write_docs):
    """A build starting while another (alive) was between its manifest and its swap moved the other's
    stage to NAME as if it were a dead build's, then deleted it as the old copy; the other then failed."""
    text = write_docs(tmp_path / "text", n_docs=3)
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE) as alive:
        try:
            stage = tmp_path / f".ds.building-{alive.pid}"
            build_dataset([text], stage)
            before = load_manifest(stage)
            assert build_dataset([text], tmp_path / "ds", seed=5)["seed"] == 5
            assert load_manifest(stage) == before
        finally:
            alive.communicate(timeout=60)


def test_the_hundred_thousandth_shard_is_luban_s(tmp_path):
    """Shard 100000 is named `train-100000.bin` (`{:05d}`), which luban's rule for its own file names
    (five digits) did not match: a rebuild of a dataset of that many shards (many small files and a tiny
    --shard-size-mb) was refused as holding a file luban did not write."""
    from luban.data.build import dataset_file

    for name in ("train-00000.bin", "val-100000.bin"):
        (tmp_path / name).write_bytes(b"")
        assert dataset_file(tmp_path / name)
    assert not dataset_file(tmp_path / "train-0000.bin")


SLOW_REMOVAL = """
import os, signal, sys, time
from luban.data import build
from luban.cli import main

real_remove = build._remove
def slow_remove(stage):  # a stage of thousands of shards takes seconds to delete
    time.sleep(2)
    real_remove(stage)
def interrupted_build(*args):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during the build
    time.sleep(30)
build._remove, build._build_into = slow_remove, interrupted_build
sys.argv = ["luban", "data", "build", sys.argv[1], "--out", sys.argv[2]]
sys.exit(main())
"""


def test_ctrl_c_removes_the_whole_stage_even_when_removal_is_slow(tmp_path, write_docs):
    """Ctrl-C in a build of thousands of shards: `luban: interrupted`, exit 130, but the forced exit
    GRACE_S later cut the except's removal of the stage short, leaving part of it (kept until the next
    build of NAME; forever when its marker had gone first)."""
    text = write_docs(tmp_path / "text", n_docs=2)
    proc = subprocess.run([sys.executable, "-c", SLOW_REMOVAL, str(text), str(tmp_path / "ds")], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 130 and proc.stderr == "luban: interrupted\n", proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text"]


def test_a_rebuild_into_the_input_folder_does_not_read_itself(tmp_path, write_docs):
    """`luban data build corpus --out corpus/ds` run twice tokenised the first dataset's shards and
    manifest as documents: every rebuild grew by the one before."""
    text = write_docs(tmp_path / "text", n_docs=3)
    first = build_dataset([text], text / "ds", val_fraction=0)
    again = build_dataset([text], text / "ds", val_fraction=0)
    assert again["source"]["files"] == first["source"]["files"] == 3
    assert again["splits"] == first["splits"]


TRUNCATED_WHILE_READ = """
import os, sys
from pathlib import Path
from luban.cli import error_line
from luban.errors import LubanError

case, ds = sys.argv[1], Path(sys.argv[2])
shard = ds / "train-00000.bin"
try:
    if case == "loader":  # what training runs: windows anywhere, read in the prefetch thread
        from luban.data.loader import TokenLoader
        from luban.data.manifest import load_manifest
        with TokenLoader(ds, seq_len=64, global_batch=32, prefetch=2) as loader:
            next(loader)  # every train shard is open now (and the thread is reading ahead)
            for entry in load_manifest(ds)["splits"]["train"]["shards"]:
                os.truncate(ds / entry["file"], 4096)  # the pages past the first are gone
            for _ in range(2 * loader.samples_per_epoch):
                next(loader)
    else:
        from luban.data.loader import TokenStream
        from luban.data.shards import ShardReader
        other = ShardReader(ds / "train-00001.bin")
        stream = TokenStream([ShardReader(shard), other], max_open=1)
        reader = stream.readers[0]
        end = reader.tokens
        stream.read(0, end if case == "read" else 10)  # open; every chunk verified ("read") or one
        if case == "remap":
            stream.read(end, end + 10)  # opens the other shard and closes this one
        os.truncate(shard, 4096)
        if case == "verify":
            reader.verify()  # the unverified chunks' CRCs
        else:
            stream.read(end - 10, end)  # verified chunks: no CRC is computed, the file is read as is
    print("read a truncated shard without an error")
except LubanError as err:
    print(error_line(err), file=sys.stderr)
    sys.exit(err.exit_code)
"""


@pytest.mark.parametrize("case", ["read", "verify", "remap", "loader"])
def test_a_shard_truncated_while_read_is_named_not_a_bus_error(dataset_copy, case):
    """A shard cut short (or rewritten shorter) while a reader had it memory-mapped: reading the pages that
    had gone killed the whole training process with SIGBUS ("Bus error", core dumped, no message, in the
    middle of whatever it was doing), or a remap of it was a ValueError traceback. Reads are now
    ``pread``s: a short one names the shard in one line, with no window for a SIGBUS."""
    proc = subprocess.run([sys.executable, "-c", TRUNCATED_WHILE_READ, case, str(dataset_copy)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != -7, "killed by SIGBUS"
    assert_one_line(proc, 2, f"{dataset_copy / 'train-0000'}", ".bin: truncated: 4096 bytes, the header says ",
                    "at byte offset 4096")


@pytest.mark.parametrize("by", ["shorter", "longer"])
def test_a_shard_replaced_by_rename_while_open(dataset_copy, by):
    """A shard renamed over (a rebuild of the dataset) while a run has it open: the descriptor keeps the old
    file, whole, so reading on is safe; but once it was given back, opening the path again read the other
    shard there now (trained on it with the CRCs of the first: a shorter one was a ValueError traceback, a
    longer one read silently where the chunks were already verified). Now the other file is refused."""
    path = dataset_copy / "train-00000.bin"
    reader = ShardReader(path)
    before = reader.read(0, reader.tokens)
    sizes = {p: p.stat().st_size for p in dataset_copy.glob("train-*.bin") if p != path}
    other = (min if by == "shorter" else max)(sizes, key=sizes.get)
    assert (sizes[other] < reader.size) == (by == "shorter")
    os.replace(other, path)
    np.testing.assert_array_equal(reader.read(0, reader.tokens), before)  # the old file, still open
    reader.close()  # (a stream of many shards gives the least recently read back)
    message = "truncated: " if by == "shorter" else "replaced or changed since this process opened it"
    with pytest.raises(LubanError, match=f"{path}: {message}"):
        reader.read(0, 10)
