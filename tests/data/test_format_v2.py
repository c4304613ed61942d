"""Shard format version 2: the chunk-CRC table has its own CRC, so opening a shard reads the header and
that table, never the document index (8 bytes a document: for a 15-billion-document corpus 120 GB, which
every rank of a run read at start-up in version 1). The index is checked where it is used: ``document(i)``
(its two entries) and ``verify()`` / ``luban data verify`` (all of it). Version-1 shards keep opening,
reading and verifying, with version 1's checks at open."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from luban.data import shards
from luban.data.loader import TokenLoader
from luban.data.manifest import load_manifest, open_dataset, write_manifest
from luban.data.shards import HEADER, HEADER_SIZE, ShardReader, ShardWriter
from luban.errors import LubanError
from tests.data.v1_shards import v1_shard_bytes, write_v1_shard

ROOT = Path(__file__).resolve().parents[2]
SIZES = (5, 100, 0, 37, 64)  # 206 tokens, 13 chunks of 16


def make_shard(path: Path, sizes=SIZES, chunk: int = 16) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 300, n) for n in sizes]
    with ShardWriter(path, np.uint16, chunk_tokens=chunk) as writer:
        for doc in docs:
            writer.add_document(doc)
        writer.close()
    return docs


def flip(path: Path, offset: int, bit: int = 0x40) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= bit
    path.write_bytes(bytes(data))


def header(path: Path) -> dict:
    names = ("magic", "version", "code", "chunk", "tokens", "documents", "tokens_offset", "index_offset",
             "crc_offset", "tail_crc", "header_crc")
    return dict(zip(names, HEADER.unpack(path.read_bytes()[:HEADER_SIZE])))


def resealed(data: bytes) -> bytes:
    """A version-2 shard's bytes with its index CRC, table CRC and header CRC made to match its content (a
    hostile edit, or a writer's bug, rather than damage)."""
    fields = list(HEADER.unpack(data[:HEADER_SIZE]))
    index_offset, crc_offset = fields[7], fields[8]
    out = bytearray(data)
    out[-4:] = struct.pack("<I", zlib.crc32(data[index_offset:crc_offset]))
    fields[9] = zlib.crc32(bytes(out[crc_offset:]))
    head = HEADER.pack(*fields)[:HEADER_SIZE - 4]
    out[:HEADER_SIZE] = head + struct.pack("<I", zlib.crc32(head))
    return bytes(out)


def bytes_read(action) -> int:
    """Bytes this process read from files (``read``/``pread`` system calls: /proc/self/io's ``rchar``) while
    ``action`` ran, less what reading /proc/self/io itself costs; the fewest of three runs."""
    def rchar() -> int:
        return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                        if line.startswith("rchar:")).split()[1])

    def delta(run) -> int:
        before = rchar()
        run()
        return rchar() - before
    return min(delta(action) for _ in range(3)) - min(delta(lambda: None) for _ in range(3))


# -- the layout --------------------------------------------------------------------------------------------
def test_the_writer_writes_version_2_with_the_table_crc_and_index_crc_after_the_table(tmp_path):
    path = tmp_path / "s.bin"
    docs = make_shard(path)
    data, h = path.read_bytes(), header(path)
    k = -(-206 // 16)
    assert h["version"] == shards.FORMAT_VERSION == 2
    assert (h["index_offset"], h["crc_offset"]) == (480, 480 + 5 * 8)  # align8(64 + 206 * 2) = 480
    assert len(data) == h["crc_offset"] + 4 * k + 4
    starts = np.frombuffer(data, "<u8", 5, h["index_offset"])
    assert starts.tolist() == [0, 5, 105, 105, 142]
    table = data[h["crc_offset"]:h["crc_offset"] + 4 * k]
    tokens = np.concatenate(docs).astype("<u2").tobytes()
    assert np.frombuffer(table, "<u4").tolist() == [zlib.crc32(tokens[i:i + 32]) for i in range(0, len(tokens), 32)]
    assert data[-4:] == struct.pack("<I", zlib.crc32(data[h["index_offset"]:h["crc_offset"]]))  # the index CRC
    assert h["tail_crc"] == zlib.crc32(data[h["crc_offset"]:])  # the chunk CRCs and the index CRC
    reader = ShardReader(path)
    assert (reader.version, reader.size, reader.crc_offset) == (2, len(data), h["crc_offset"])
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(reader.document(i), doc)
    reader.verify()


def test_the_header_crc_still_covers_the_whole_file(tmp_path):
    """The manifest records each shard's header CRC to tell a shard swapped for another of the same size: in
    version 2 it still covers every byte but the 0-7 padding bytes after the tokens (which ``verify`` checks
    are zero: test_review_1127), tokens (through the chunk CRCs) and document index (through the index CRC)
    alike."""
    def head_crc(docs) -> int:
        path = tmp_path / "s.bin"
        with ShardWriter(path, np.uint16, chunk_tokens=16) as writer:
            for doc in docs:
                writer.add_document(doc)
            return writer.close().header_crc32
    crcs = {head_crc(docs) for docs in ([[1, 2, 3], [4]], [[1, 2], [3, 4]], [[1, 2], [3, 5]])}
    assert len(crcs) == 3


# -- (1) open reads the header and the chunk-CRC table only ---------------------------------------------------
@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts bytes read by /proc/self/io")
def test_opening_a_shard_reads_the_chunk_crc_table_not_the_document_index(tmp_path):
    """200,000 one-token documents: a 1.6 MB document index, 4 chunks. Opening read all of the index (and
    checked it) in version 1; in version 2 the header, 16 bytes of chunk CRCs and the 4-byte index CRC."""
    path = tmp_path / "s.bin"
    one = np.ones(1, np.uint16)
    with ShardWriter(path, np.uint16) as writer:
        for _ in range(200_000):
            writer.add_document(one)
        writer.close()
    assert header(path)["version"] == 2 and path.stat().st_size > 1_600_000
    opened = bytes_read(lambda: ShardReader(path))
    assert abs(opened - (HEADER_SIZE + 4 * 4 + 4)) <= 8, opened  # 84 bytes, whatever the document count
    reader = ShardReader(path)
    read = bytes_read(lambda: reader.document(123_456))  # the header again (the file's identity), two entries
    assert read <= HEADER_SIZE + 2 * 8 + 2 * 65_536 + 8, read  # and the document's chunk (verified once)
    np.testing.assert_array_equal(reader.document(123_456), one)

    old = tmp_path / "v1.bin"  # the same documents in version 1: open reads (and checks) the whole index
    old.write_bytes(v1_shard_bytes([one] * 200_000, np.uint16, 1 << 16))
    assert bytes_read(lambda: ShardReader(old)) >= 200_000 * 8


# -- (2) the document index: not at open; document(i), verify(), `luban data verify` -----------------------
def test_a_damaged_document_index_is_caught_by_verify_and_by_document_not_at_open(tmp_path):
    path = tmp_path / "s.bin"
    docs = make_shard(path)
    h = header(path)
    flip(path, h["index_offset"] + 3 * 8)  # document 3 starts at 105 ^ 0x40 = 41, before document 2's 105
    reader = ShardReader(path)  # open reads no index
    np.testing.assert_array_equal(reader.read(0, 206), np.concatenate(docs))  # the tokens are fine
    np.testing.assert_array_equal(reader.document(0), docs[0])  # entries 0 and 1 are fine
    with pytest.raises(LubanError) as err:
        reader.document(2)  # entries 2 and 3: out of order
    assert str(err.value).startswith(f"{path}: document index out of order or outside the 206 tokens (document 2")
    assert str(err.value).endswith(f"at byte offset {h['index_offset'] + 2 * 8}")
    with pytest.raises(LubanError) as err:
        reader.verify()
    assert str(err.value) == (f"{path}: document index CRC mismatch (bytes {h['index_offset']}-"
                              f"{h['crc_offset'] - 1}) at byte offset {h['index_offset']}")


def test_document_zero_must_start_at_token_zero(tmp_path):
    path = tmp_path / "s.bin"
    make_shard(path)
    flip(path, header(path)["index_offset"], 0x01)  # document 0 starts at 1
    with pytest.raises(LubanError, match=r"document index out of order or outside the 206 tokens \(document 0"):
        ShardReader(path).document(0)


@pytest.mark.parametrize("entry,value", [(1, 10**12), (3, 104), (4, 0)])
@pytest.mark.parametrize("block", [2, 3, 1 << 20])
def test_verify_checks_the_order_of_the_whole_index_block_by_block(tmp_path, monkeypatch, entry, value, block):
    """An index out of order whose CRCs match (a hostile edit or a writer's bug) is refused by ``verify()``,
    read a bounded block at a time: across a block's boundary too."""
    monkeypatch.setattr(shards, "VERIFY_INDEX_ENTRIES", block)
    path = tmp_path / "s.bin"
    make_shard(path)
    data = bytearray(path.read_bytes())
    at = header(path)["index_offset"] + entry * 8
    data[at:at + 8] = struct.pack("<Q", value)
    path.write_bytes(resealed(bytes(data)))
    reader = ShardReader(path)  # every CRC matches
    with pytest.raises(LubanError, match=f"^{path}: document index out of order or outside the 206 tokens at byte "
                       f"offset {header(path)['index_offset']}$"):
        reader.verify()


def test_luban_data_verify_names_a_damaged_document_index_which_training_does_not_read(dataset_copy):
    manifest = load_manifest(dataset_copy)
    assert manifest["format_version"] == 2
    shard = dataset_copy / manifest["splits"]["train"]["shards"][1]["file"]
    index_offset = header(shard)["index_offset"]
    flip(shard, index_offset + 8 + 1)
    open_dataset(dataset_copy)  # every shard opens: what a rank does at start-up
    with TokenLoader(dataset_copy, seq_len=32, global_batch=4, prefetch=0) as loader:
        next(loader)
    proc = subprocess.run([sys.executable, "-m", "luban", "data", "verify", str(dataset_copy)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"luban: error: {shard}: document index CRC mismatch (bytes {index_offset}-")
    assert lines[0].endswith(f"at byte offset {index_offset}")


# -- (3) the chunk-CRC table and its CRC: at open ----------------------------------------------------------
@pytest.mark.parametrize("where", ["first chunk CRC", "last chunk CRC", "index CRC", "table CRC in the header"])
def test_a_damaged_chunk_crc_table_or_its_crc_is_caught_at_open(tmp_path, where):
    path = tmp_path / "s.bin"
    make_shard(path)
    h, size = header(path), path.stat().st_size
    offset = {"first chunk CRC": h["crc_offset"], "last chunk CRC": size - 5, "index CRC": size - 1,
              "table CRC in the header": 57}[where]
    flip(path, offset)
    if where == "table CRC in the header":  # the header CRC catches it, or...
        with pytest.raises(LubanError, match=f"^{path}: header CRC mismatch"):
            ShardReader(path)
        data = bytearray(path.read_bytes())  # ...a header re-signed over a wrong table CRC: the table's CRC
        data[60:64] = struct.pack("<I", zlib.crc32(bytes(data[:60])))
        path.write_bytes(bytes(data))
    with pytest.raises(LubanError) as err:
        ShardReader(path)
    assert str(err.value) == (f"{path}: chunk-CRC table CRC mismatch (chunk CRCs and the document index's CRC, bytes "
                              f"{h['crc_offset']}-{size - 1}) at byte offset {h['crc_offset']}")


def test_a_shard_with_tokens_and_no_documents_is_refused_at_open(tmp_path):
    path = tmp_path / "s.bin"
    make_shard(path, sizes=(4,))
    data = bytearray(path.read_bytes())
    h = header(path)
    fields = list(HEADER.unpack(bytes(data[:64])))
    fields[5], fields[8] = 0, h["index_offset"]  # no documents, the CRC table where the index was
    body = bytes(data[64:h["index_offset"]]) + bytes(data[h["crc_offset"]:-4]) + struct.pack("<I", zlib.crc32(b""))
    head = HEADER.pack(*fields)[:60]
    path.write_bytes(resealed(head + struct.pack("<I", zlib.crc32(head)) + body))
    with pytest.raises(LubanError, match=f"^{path}: 4 tokens but no documents at byte offset 24$"):
        ShardReader(path)


# -- (5) truncation and trailing bytes -----------------------------------------------------------------------
@pytest.mark.parametrize("cut", [1, 4, 5, 8])
def test_a_version_2_shard_cut_short_is_refused(tmp_path, cut):
    """Cut by 4 bytes a version-2 shard is exactly as long as version 1 would make it: still refused."""
    path = tmp_path / "s.bin"
    make_shard(path)
    size = path.stat().st_size
    assert size == header(path)["crc_offset"] + 13 * 4 + 4
    path.write_bytes(path.read_bytes()[:-cut])
    with pytest.raises(LubanError, match=f"^{path}: truncated: {size - cut} bytes, the header says {size} at byte "
                       f"offset {size - cut}$"):
        ShardReader(path)


def test_trailing_bytes_after_a_version_2_shard_are_refused(tmp_path):
    path = tmp_path / "s.bin"
    make_shard(path)
    size = path.stat().st_size
    assert size == header(path)["crc_offset"] + 13 * 4 + 4
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(LubanError, match=f"^{path}: 1 trailing bytes after the end at byte offset {size}$"):
        ShardReader(path)


def test_a_shard_cut_short_after_open_is_named_by_document(tmp_path):
    path = tmp_path / "s.bin"
    make_shard(path)
    reader = ShardReader(path)
    path.write_bytes(path.read_bytes()[:-30])
    with pytest.raises(LubanError, match=f"^{path}: truncated: "):
        reader.document(4)


# -- (4) version 1 --------------------------------------------------------------------------------------------
def test_a_version_1_shard_opens_reads_and_verifies(tmp_path):
    path = tmp_path / "s.bin"
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 300, n) for n in SIZES]
    entry = write_v1_shard(path, docs)
    reader = ShardReader(path)
    assert (reader.version, reader.tokens, reader.documents, reader.size) == (1, 206, 5, entry["bytes"])
    assert reader.header_crc == entry["header_crc32"]
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(reader.document(i), doc)
    np.testing.assert_array_equal(reader.read(3, 150), np.concatenate(docs)[3:150])
    reader.verify()


@pytest.mark.parametrize("where", ["index", "crc table"])
def test_a_version_1_shard_has_its_index_checked_at_open(tmp_path, where):
    path = tmp_path / "s.bin"
    write_v1_shard(path, [np.arange(n) % 300 for n in SIZES])
    index_offset = header(path)["index_offset"]
    flip(path, index_offset + (3 if where == "index" else 5 * 8 + 2))
    with pytest.raises(LubanError, match=f"^{path}: index CRC mismatch \\(document index and chunk CRCs, bytes "
                       f"{index_offset}-{path.stat().st_size - 1}\\) at byte offset {index_offset}$"):
        ShardReader(path)


def test_a_version_1_shard_out_of_order_is_refused_at_open(tmp_path):
    path = tmp_path / "s.bin"
    write_v1_shard(path, [np.arange(n) % 300 for n in SIZES])
    data = bytearray(path.read_bytes())
    h = header(path)
    data[h["index_offset"] + 8:h["index_offset"] + 16] = struct.pack("<Q", 10**12)
    fields = list(HEADER.unpack(bytes(data[:64])))
    fields[9] = zlib.crc32(bytes(data[h["index_offset"]:]))
    head = HEADER.pack(*fields)[:60]
    path.write_bytes(head + struct.pack("<I", zlib.crc32(head)) + bytes(data[64:]))
    with pytest.raises(LubanError, match=f"^{path}: document index out of order or outside the 206 tokens at byte "
                       f"offset {h['index_offset']}$"):
        ShardReader(path)


@pytest.mark.parametrize("change", ["cut", "trailing"])
def test_a_version_1_shard_cut_short_or_with_trailing_bytes(tmp_path, change):
    path = tmp_path / "s.bin"
    entry = write_v1_shard(path, [np.arange(n) % 300 for n in SIZES])
    size = entry["bytes"]
    path.write_bytes(path.read_bytes()[:-4] if change == "cut" else path.read_bytes() + b"\0\0\0\0")
    message = (f"truncated: {size - 4} bytes, the header says {size} at byte offset {size - 4}" if change == "cut"
               else f"4 trailing bytes after the end at byte offset {size}")
    with pytest.raises(LubanError, match=f"^{path}: {message}$"):
        ShardReader(path)


def as_version_1(dataset: Path, target: Path) -> Path:
    """A copy of ``dataset`` as luban wrote it before format version 2: every shard rewritten in version 1 and
    the manifest saying format_version 1 (with each shard's size and header CRC)."""
    shutil.copytree(dataset, target)
    manifest = load_manifest(target)
    for split in manifest["splits"].values():
        for i, entry in enumerate(split["shards"]):
            reader = ShardReader(target / entry["file"])
            docs = [reader.document(d) for d in range(reader.documents)]
            split["shards"][i] = write_v1_shard(target / entry["file"], docs, reader.dtype, reader.chunk_tokens)
            assert {k: split["shards"][i][k] for k in ("tokens", "documents")} == {
                k: entry[k] for k in ("tokens", "documents")}
    manifest["format_version"] = 1
    write_manifest(target, {k: v for k, v in manifest.items() if k != "checksum"})
    return target


def luban_data(*args):
    return subprocess.run([sys.executable, "-m", "luban", "data", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_a_version_1_dataset_still_trains_verifies_and_describes(small_dataset, tmp_path):
    old = as_version_1(small_dataset, tmp_path / "v1")
    assert {header(p)["version"] for p in old.glob("*.bin")} == {1}
    _, splits = open_dataset(old)
    assert {r.version for readers in splits.values() for r in readers} == {1}
    for ds in (small_dataset, old):  # the same batches from either
        with TokenLoader(ds, seq_len=32, global_batch=4, seed=1, prefetch=0) as loader:
            batches = [next(loader) for _ in range(3)]
        if ds == small_dataset:
            want = batches
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, want))
    verified = luban_data("verify", old)
    assert verified.returncode == 0, verified.stderr
    assert "format v1" in luban_data("info", old).stdout
    assert "format v2" in luban_data("info", small_dataset).stdout

    shard = old / "train-00000.bin"  # and version 1's check at open: a damaged index fails at once
    flip(shard, header(shard)["index_offset"] + 2)
    with pytest.raises(LubanError, match=f"^{shard}: index CRC mismatch"):
        open_dataset(old)


@pytest.mark.parametrize("version", [1, 2])
def test_a_shard_of_the_other_version_than_the_manifest_says_is_refused(small_dataset, tmp_path, version):
    """A shard of a version-1 dataset copied into a version-2 one (or back), with the manifest naming no
    header CRC (datasets built before it was recorded)."""
    new = shutil.copytree(small_dataset, tmp_path / "v2")
    old = as_version_1(small_dataset, tmp_path / "v1")
    target, source = (new, old) if version == 1 else (old, new)
    shutil.copy(source / "val-00000.bin", target / "val-00000.bin")
    manifest = load_manifest(target)
    for split in manifest["splits"].values():
        for entry in split["shards"]:
            del entry["header_crc32"]
            entry["bytes"] = (target / entry["file"]).stat().st_size
    write_manifest(target, {k: v for k, v in manifest.items() if k != "checksum"})
    with pytest.raises(LubanError, match=f"^{target / 'val-00000.bin'}: format version {version}, but manifest.json "
                       f"says {3 - version}; rebuild the dataset$"):
        open_dataset(target)


@pytest.mark.parametrize("value", [0, 3, True, 2.0, "2"])
def test_a_manifest_of_a_format_version_luban_does_not_read_is_refused(dataset_copy, value):
    manifest = json.loads((dataset_copy / "manifest.json").read_text())
    manifest["format_version"] = value
    write_manifest(dataset_copy, {k: v for k, v in manifest.items() if k != "checksum"})
    with pytest.raises(LubanError, match=f"format_version = {value!r}: this luban reads versions 1 and 2; rebuild"):
        load_manifest(dataset_copy)
