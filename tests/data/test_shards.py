"""The shard format: round trip, checksums, truncation and atomic writes."""

from __future__ import annotations

import os

import numpy as np
import pytest

from luban.data.atomic import write_bytes
from luban.data.shards import (HEADER_SIZE, ShardReader, ShardWriter, dtype_for_vocab)
from luban.errors import LubanError

CHUNK = 16


def make_shard(path, dtype=np.uint16, high=300, sizes=(5, 100, 0, 37, 64)):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, high, n) for n in sizes]
    with ShardWriter(path, dtype, chunk_tokens=CHUNK) as writer:
        for doc in docs:
            writer.add_document(doc)
        info = writer.close()
    return docs, info


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("dtype,high", [(np.uint16, 65536), (np.uint32, 1 << 32)])
def test_round_trip(tmp_path, dtype, high):
    path = tmp_path / "s.bin"
    docs, info = make_shard(path, dtype, high)
    reader = ShardReader(path)
    assert reader.dtype == np.dtype(dtype)
    assert (info.tokens, info.documents, info.bytes) == (206, 5, path.stat().st_size)
    assert (reader.tokens, reader.documents, reader.size) == (206, 5, info.bytes)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(reader.document(i), doc)
    np.testing.assert_array_equal(reader.read(3, 150), np.concatenate(docs)[3:150])
    reader.verify()
    with pytest.raises(IndexError):
        reader.read(0, 207)


def test_dtype_follows_vocab_size():
    assert dtype_for_vocab(257) == np.uint16
    assert dtype_for_vocab(65536) == np.uint16
    assert dtype_for_vocab(65537) == np.uint32


def test_writer_rejects_ids_outside_dtype(tmp_path):
    with pytest.raises(ValueError), ShardWriter(tmp_path / "s.bin", np.uint16) as writer:
        writer.add_document([1, 70000])
    assert list(tmp_path.iterdir()) == []


def test_flipped_token_byte_fails_on_first_read_of_its_chunk(tmp_path):
    path = tmp_path / "s.bin"
    make_shard(path)
    flip(path, HEADER_SIZE + 3 * CHUNK * 2 + 5)  # inside chunk 3
    reader = ShardReader(path)  # open checks the header and the chunk-CRC table only
    reader.read(0, 3 * CHUNK)  # chunks 0-2 are fine
    message = f"{path}: CRC mismatch in chunk 3 at byte offset {HEADER_SIZE + 3 * CHUNK * 2}"
    with pytest.raises(LubanError) as err:
        reader.read(3 * CHUNK + 10, 3 * CHUNK + 11)
    assert str(err.value) == message
    with pytest.raises(LubanError) as err:
        ShardReader(path).verify()
    assert str(err.value) == message


@pytest.mark.parametrize("offset,what,reported", [
    (0, "not a luban shard", 0), (8, "format version", 8), (16, "header CRC mismatch", 0),
    (40, "header CRC mismatch", 0), (HEADER_SIZE - 1, "header CRC mismatch", 0)])
def test_flipped_header_byte(tmp_path, offset, what, reported):
    path = tmp_path / "s.bin"
    make_shard(path)
    flip(path, offset)
    with pytest.raises(LubanError, match=f"^{path}: {what}.* at byte offset {reported}$"):
        ShardReader(path)


@pytest.mark.parametrize("where", ["index", "crc table", "index crc"])
def test_flipped_index_or_crc_table_byte(tmp_path, where):
    """The chunk-CRC table (and the index CRC after it) is checked at open; the document index, which open does
    not read (format version 2), by ``verify()`` (tests/data/test_format_v2.py has version 1's checks)."""
    path = tmp_path / "s.bin"
    make_shard(path)
    reader = ShardReader(path)
    index_offset, crc_offset, size = reader.index_offset, reader.crc_offset, reader.size
    flip(path, {"index": index_offset + 3, "crc table": crc_offset + 2, "index crc": size - 1}[where])
    if where == "index":
        reader = ShardReader(path)
        with pytest.raises(LubanError, match=f"^{path}: document index CRC mismatch \\(bytes {index_offset}-"
                           f"{crc_offset - 1}\\) at byte offset {index_offset}$"):
            reader.verify()
        return
    with pytest.raises(LubanError, match=f"^{path}: chunk-CRC table CRC mismatch .* at byte offset "
                       f"{crc_offset}$"):
        ShardReader(path)


@pytest.mark.parametrize("keep", [0, 30, HEADER_SIZE, 200, -1])
def test_truncated_shard(tmp_path, keep):
    path = tmp_path / "s.bin"
    make_shard(path)
    size = path.stat().st_size
    keep = keep % size
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(LubanError, match=f"^{path}: truncated: {keep} bytes, .* at byte offset "
                       f"{keep}$"):
        ShardReader(path)


def test_trailing_bytes(tmp_path):
    path = tmp_path / "s.bin"
    _, info = make_shard(path)
    path.write_bytes(path.read_bytes() + b"xx")
    with pytest.raises(LubanError, match=f"2 trailing bytes after the end at byte offset "
                       f"{info.bytes}$"):
        ShardReader(path)


def test_missing_shard_named(tmp_path):
    with pytest.raises(LubanError, match="s.bin: shard file is missing"):
        ShardReader(tmp_path / "s.bin")


def test_failed_write_keeps_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "s.bin"
    docs, _ = make_shard(path)
    before = path.read_bytes()
    with pytest.raises(RuntimeError), ShardWriter(path, np.uint16, CHUNK) as writer:
        writer.add_document(docs[1])
        raise RuntimeError("crash in the middle of a shard")
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"]


def test_unclosed_writer_never_shows_under_the_final_name(tmp_path):
    writer = ShardWriter(tmp_path / "s.bin", np.uint16, CHUNK)
    writer.add_document([1, 2, 3])  # "killed" here: never closed
    names = [p.name for p in tmp_path.iterdir()]
    assert names == [f".s.bin.tmp-{os.getpid()}"]
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_write_bytes_replaces_atomically(tmp_path):
    path = tmp_path / "m.json"
    write_bytes(path, b"one")
    write_bytes(path, b"two")
    assert path.read_bytes() == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]
