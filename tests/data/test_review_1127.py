"""Regression tests for the hostile review (2026-11-27) of 68132a5 (shards read by pread, a bounded number
open) and 00b807b (shard format version 2). Each test failed before its fix; its docstring says what was
wrong and what is true now."""

from __future__ import annotations

import copy
import errno
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from luban.data import shards
from luban.data.build import build_dataset
from luban.data.loader import TokenLoader
from luban.data.shards import HEADER_SIZE, MAX_CHUNK_TOKENS, ShardReader, ShardWriter
from luban.errors import LubanError
from tests.data.v1_shards import write_v1_shard

ROOT = Path(__file__).resolve().parents[2]


def _shard(path: Path, tokens: int, chunk: int, doc: int = 1000) -> np.ndarray:
    data = (np.arange(tokens) % 50_000).astype(np.uint16)
    with ShardWriter(path, np.uint16, chunk_tokens=chunk) as writer:
        for i in range(0, tokens, doc):
            writer.add_document(data[i:i + doc])
        writer.close()
    return data


# -- 1. `luban data verify` held every shard open -------------------------------------------------------------
def test_luban_data_verify_holds_one_shard_open_at_a_time(tmp_path, write_docs):
    """Was (to 2026-11-27): ``ShardReader.verify()`` and the token-id scan after it opened each shard's
    descriptor and nothing gave it back, while ``open_dataset`` kept every reader: ``luban data verify`` of a
    ~1,000-shard corpus at ``ulimit -n 1024`` failed "cannot open the shard: Too many open files".
    Now ``luban.data.cli._verify`` closes each reader once done with it (``try/finally``), and ``verify()``
    gives back a descriptor it opened itself. Here 100 shards at a limit of 64 files."""
    text = write_docs(tmp_path / "text", n_docs=100)
    manifest = build_dataset([text], tmp_path / "ds", shard_size_mb=0.0005, val_fraction=0)
    assert len(manifest["splits"]["train"]["shards"]) >= 90
    code = ("import resource, runpy, sys\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
            "sys.argv = ['luban', 'data', 'verify', sys.argv[1]]\n"
            "runpy.run_module('luban', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ds")], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-500:]
    assert proc.stdout.count("ok ") >= 91  # every shard (and the tokenizer) verified


def test_verify_gives_back_a_descriptor_it_opened_and_keeps_one_it_found_open(tmp_path):
    """Now: ``verify()`` on a reader with no descriptor leaves it with none; on one a stream has open, it
    leaves it open (the stream's bound on open shards counts it)."""
    path = tmp_path / "s.bin"
    data = _shard(path, 5000, chunk=1024)
    reader = ShardReader(path)
    reader.verify()
    assert reader._fd is None
    np.testing.assert_array_equal(reader.read(0, 10), data[:10])
    fd = reader._fd
    assert fd is not None
    reader.verify()
    assert reader._fd == fd
    reader.close()


def test_closing_a_loader_gives_back_its_shards_descriptors(small_dataset):
    """Now: ``TokenLoader.close()`` gives back the descriptors of the shards it read (before, they stayed open
    until the readers were garbage-collected)."""
    loader = TokenLoader(small_dataset, seq_len=64, global_batch=4, prefetch=1)
    next(loader)
    readers = loader._make.stream.readers
    assert any(r._fd is not None for r in readers)
    loader.close()
    assert all(r._fd is None for r in readers)


# -- 2. a read longer than one preadv returns was called "truncated" ------------------------------------------
def _capped_preadv(monkeypatch, cap: int) -> list[int]:
    """Make ``os.preadv`` transfer at most ``cap`` bytes a call, as Linux does past 0x7ffff000; returns the
    list of the buffer sizes asked for."""
    real, asked = os.preadv, []

    def capped(fd, buffers, offset, *rest):
        (buf,) = buffers
        asked.append(memoryview(buf).nbytes)
        return real(fd, [memoryview(buf)[:cap]], offset, *rest)

    monkeypatch.setattr(os, "preadv", capped)
    return asked


def test_a_read_longer_than_one_preadv_returns_is_continued_not_called_truncated(tmp_path, monkeypatch):
    """Was (to 2026-11-27): ``ShardReader._pread`` read a span with ONE ``os.preadv`` and called any short
    count a truncation. Linux transfers at most 0x7ffff000 bytes per read/preadv (read(2)), so a chunk > 2 GiB
    (``--chunk-tokens 2**30`` uint16: the first read of any of its tokens reads it whole), or ``verify()``'s 64
    chunks at a time > 2 GiB, of a healthy shard was refused: "truncated: 2147483728 bytes, the header says
    2147483728". Now ``_pread`` loops ``preadv`` into the rest of the buffer; only a 0-byte return before the
    end is the truncation. Here the kernel's cap is emulated at 4 KiB."""
    path = tmp_path / "s.bin"
    data = _shard(path, 20_000, chunk=8192)  # 16 KiB chunks
    asked = _capped_preadv(monkeypatch, 4096)
    reader = ShardReader(path)
    np.testing.assert_array_equal(reader.read(0, 10), data[:10])  # the whole first chunk, 4 KiB a call
    assert len(asked) >= 4
    np.testing.assert_array_equal(reader.read(0, len(data)), data)
    reader.verify()


def test_a_shard_cut_short_is_still_called_truncated_when_reads_are_capped(tmp_path, monkeypatch):
    """Now as before: the read that returns 0 bytes before the end is the truncation, one line."""
    path = tmp_path / "s.bin"
    _shard(path, 20_000, chunk=8192)
    _capped_preadv(monkeypatch, 4096)
    reader = ShardReader(path)
    reader.read(0, 10)  # open
    os.truncate(path, HEADER_SIZE + 2 * 10_000)
    with pytest.raises(LubanError, match=r"truncated: 20064 bytes, the header says"):
        reader.read(15_000, 15_010)


@pytest.mark.parametrize("chunk", [16, 4096, MAX_CHUNK_TOKENS])
def test_verify_reads_a_bounded_number_of_bytes_at_a_time_whatever_the_chunk_size(tmp_path, monkeypatch, chunk):
    """Was (to 2026-11-27): ``verify()`` read 64 chunks at a time, whatever their size: up to 64 * (2**32 - 1)
    tokens in one buffer. Now it reads ``VERIFY_BYTES`` at a time (whole chunks where they fit, else a chunk's
    CRC over pieces of it), and still finds a damaged chunk. Here ``VERIFY_BYTES`` is 1 KiB."""
    monkeypatch.setattr(shards, "VERIFY_BYTES", 1024, raising=False)  # (raising: VERIFY_BYTES is new)
    path = tmp_path / "s.bin"
    _shard(path, 5000, chunk=chunk)
    asked = _capped_preadv(monkeypatch, 1 << 30)  # (records the sizes only)
    ShardReader(path).verify()
    assert asked and max(asked) <= 1024
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + 2 * 4321] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(LubanError, match="CRC mismatch in chunk"):
        ShardReader(path).verify()


def test_a_build_makes_chunks_of_at_most_2_24_tokens_and_a_reader_reads_any_the_header_can_store(tmp_path,
                                                                                               write_docs):
    """Now: ``luban data build --chunk-tokens`` (``build_dataset``) accepts 1 to ``MAX_BUILD_CHUNK_TOKENS``
    (2**24): a chunk is read whole on its first read, and 2**30 tokens made that a 2-4 GiB read. A shard of
    larger chunks (up to the header's 2**32 - 1) still opens, reads and verifies."""
    assert shards.MAX_BUILD_CHUNK_TOKENS == 1 << 24
    with pytest.raises(LubanError, match=r"^--chunk-tokens = 16777217: an integer from 1 to 16777216$"):
        build_dataset([write_docs(tmp_path / "t", n_docs=2)], tmp_path / "ds", chunk_tokens=(1 << 24) + 1)
    path = tmp_path / "s.bin"
    data = _shard(path, 5000, chunk=MAX_CHUNK_TOKENS)
    reader = ShardReader(path)
    assert reader.chunk_tokens == MAX_CHUNK_TOKENS
    np.testing.assert_array_equal(reader.read(10, 20), data[10:20])
    reader.verify()


# -- 3. an OSError reading a shard was a traceback ------------------------------------------------------------
def _raise(code: int):
    def fail(*_a, **_k):
        raise OSError(code, os.strerror(code))
    return fail


@pytest.mark.parametrize("call,patched", [
    ("read", "preadv"),       # every token read: ``_pread``
    ("verify", "preadv"),     # the chunks ``verify`` reads
    ("verify", "pread"),      # the document index ``verify`` reads (``_verify_index``)
    ("document", "pread"),    # the two index entries of ``document``
    ("read", "fstat"),        # opening the descriptor again (``_file``)
])
@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE])
def test_an_io_error_reading_a_shard_is_one_line_naming_it(tmp_path, monkeypatch, call, patched, code):
    """Was (to 2026-11-27): ``ShardReader.__init__`` and ``_file``'s ``open`` turned ``OSError`` into a
    ``LubanError`` naming the shard, but ``_pread`` (every read, ``verify``), ``document``, ``_verify_index``
    and ``_file``'s ``fstat``/``pread`` did not: EIO from a failing disk, or ESTALE on NFS (what a shard
    renamed over by another client gives an open descriptor), was a bare ``OSError`` traceback, out of the
    prefetch thread too. Now each is the one line docs/data.md promises: "PATH: cannot read the shard:
    <strerror> at byte offset N"."""
    path = tmp_path / "s.bin"
    _shard(path, 5000, chunk=1024)
    reader = ShardReader(path)
    reader.read(0, 10)  # the descriptor open: the failing call is the one named, not ``_file``'s
    if patched == "fstat":
        reader.close()  # (``_file`` opens the path again: ``fstat`` then ``pread`` of the header)
    failing = type("FailingOs", (), {"__getattr__": lambda _self, name: getattr(os, name),
                                     patched: staticmethod(_raise(code))})()
    monkeypatch.setattr(shards, "os", failing)  # (shards' calls only: pytest's capture calls os.fstat too)
    run = {"read": lambda: reader.read(0, 10), "verify": reader.verify, "document": lambda: reader.document(1)}
    with pytest.raises(LubanError, match=rf"^{re.escape(str(path))}: cannot read the shard: "
                                         rf"{re.escape(os.strerror(code))} at byte offset \d+$"):
        run[call]()


def test_an_io_error_in_the_prefetch_thread_reaches_the_caller_as_one_line(small_dataset, monkeypatch):
    """Now: the loader's ``next()`` raises the ``LubanError`` (naming the shard), not an ``OSError``."""
    with TokenLoader(small_dataset, seq_len=64, global_batch=4, prefetch=2) as loader:
        monkeypatch.setattr(os, "preadv", _raise(errno.ESTALE))
        with pytest.raises(LubanError, match=r"train-\d{5}\.bin: cannot read the shard: Stale file handle"):
            next(loader)


# -- 4. the padding bytes were checked by nothing -------------------------------------------------------------
@pytest.mark.parametrize("version", [1, 2])
def test_verify_checks_the_padding_between_the_tokens_and_the_index_is_zero(tmp_path, version):
    """Was (to 2026-11-27): docs/data.md and shards.py said the header CRC "still covers every byte of the
    file", but the 0-7 zero padding bytes between the tokens and the document index are in no CRC and were
    checked by nothing, not even ``verify()``: a shard differing from the built one in them passed every check.
    Now ``verify()`` checks they are zero (one small read), and the docs say the CRCs cover every byte but the
    padding."""
    path = tmp_path / "s.bin"
    if version == 1:
        write_v1_shard(path, [[1, 2, 3, 4, 5, 6, 7]])
    else:
        with ShardWriter(path, np.uint16, chunk_tokens=16) as writer:  # 7 tokens: 64 + 14 = 78, padded to 80
            writer.add_document([1, 2, 3, 4, 5, 6, 7])
            writer.close()
    ShardReader(path).verify()  # as built
    data = bytearray(path.read_bytes())
    assert data[HEADER_SIZE + 14:HEADER_SIZE + 16] == b"\0\0"
    data[HEADER_SIZE + 15] = 0x5A
    path.write_bytes(bytes(data))
    reader = ShardReader(path)  # opens: the padding is checked by ``verify`` only
    np.testing.assert_array_equal(reader.read(0, 7), [1, 2, 3, 4, 5, 6, 7])
    with pytest.raises(LubanError, match=r"padding bytes 78-79 \(between the tokens and the document index\) "
                                         r"are not zero at byte offset 79$"):
        reader.verify()


# -- 5. a copied reader shared the raw descriptor number ------------------------------------------------------
@pytest.mark.parametrize("twin_of", [copy.copy, copy.deepcopy, lambda r: pickle.loads(pickle.dumps(r))],
                         ids=["copy", "deepcopy", "pickle"])
def test_a_copied_reader_opens_the_shard_itself(tmp_path, twin_of):
    """Was (to 2026-11-27): a ``ShardReader`` carried its raw descriptor number in ``_fd`` and ``copy.copy``
    (or pickling into a spawned worker) gave the twin the same number. Once the original gave it back
    (``close``, LRU eviction, ``__del__``) the next ``open`` reused the number, and the twin read *that* file at
    the shard's offsets with no check (its chunks were marked verified), then closed it from ``__del__``.
    Now ``__getstate__`` (which copy, deepcopy and pickle all use) drops ``_fd``: the twin opens the path
    itself, through ``_file``'s size and header-CRC check."""
    path = tmp_path / "a.bin"
    data = _shard(path, 5000, chunk=1024)
    reader = ShardReader(path)
    reader.read(0, reader.tokens)  # open, every chunk verified
    twin = twin_of(reader)
    assert twin._fd is None and reader._fd is not None
    reader.close()
    other = tmp_path / "other.bin"
    other.write_bytes(bytes(range(256)) * 64)
    fd = os.open(other, os.O_RDONLY)  # the lowest free number: the one just given back
    try:
        np.testing.assert_array_equal(twin.read(0, 10), data[:10])
        assert twin._fd not in (None, fd)
        twin.close()
        assert os.fstat(fd).st_size == other.stat().st_size  # the test's descriptor is still open, still other's
    finally:
        if twin._fd == fd:  # (before the fix: do not let the twin close the test's descriptor)
            twin._fd = None
        os.close(fd)
    np.testing.assert_array_equal(reader.read(4990, 5000), data[4990:])  # the original reads on
