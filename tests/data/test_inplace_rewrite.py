"""A shard rewritten in place, its size and header kept, after a reader verified its chunks.

2026-12-02: a verified chunk was never read with its CRC again, and a file opened again was checked
only for its size and header CRC: tokens changed in place (a careless ``dd conv=notrunc``, a second
build writing into the same folder, a bad sync tool) were read silently, the loader training on
tokens no CRC had seen. The reader now keeps the file's status-change time, inode and size
(``shards._stamp``) and verifies every chunk again once they move."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from luban.data.shards import HEADER_SIZE, ShardReader
from luban.errors import LubanError


# Linux stamps a write with its coarse clock (one jiffy: 1-10 ms) unless the file system has multigrain
# timestamps (6.13+): a write in the same jiffy as the stamp read may keep the status-change time. The tests
# pin that, as a rewrite during a run does not: they write a jiffy at HZ=100 after the stamp.
COARSE_CLOCK_S = 0.011


def _flip_a_token(path, token: int, dtype) -> None:
    """Token ``token`` changed in place: same size, same header, same tail (its CRCs now wrong)."""
    time.sleep(COARSE_CLOCK_S)
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + token * dtype.itemsize)
        byte = f.read(1)
        f.seek(HEADER_SIZE + token * dtype.itemsize)
        f.write(bytes([byte[0] ^ 1]))


@pytest.mark.parametrize("reopened", [False, True], ids=["while-open", "after-close"])
def test_tokens_changed_in_place_after_their_chunk_was_verified_are_a_crc_mismatch(dataset_copy, reopened):
    path = dataset_copy / "train-00000.bin"
    reader = ShardReader(path)
    assert reader.tokens > reader.chunk_tokens  # at least two chunks: the second stays as it was
    whole = reader.read(0, reader.tokens)  # every chunk verified
    size, head = path.stat().st_size, path.read_bytes()[:HEADER_SIZE]
    if reopened:
        reader.close()
    _flip_a_token(path, 5, reader.dtype)
    assert (path.stat().st_size, path.read_bytes()[:HEADER_SIZE]) == (size, head)
    np.testing.assert_array_equal(reader.read(reader.chunk_tokens, reader.chunk_tokens + 3),
                                  whole[reader.chunk_tokens:reader.chunk_tokens + 3])  # an unchanged chunk
    with pytest.raises(LubanError, match=f"{path}: CRC mismatch in chunk 0 at byte offset {HEADER_SIZE}"):
        reader.read(0, 3)  # token 5 is not read: its chunk is
    with pytest.raises(LubanError, match="CRC mismatch in chunk 0"):
        reader.verify()


def test_a_file_touched_but_not_changed_reads_on(dataset_copy):
    """A chmod or utime moves the status-change time too: the chunks are verified again, and agree."""
    path = dataset_copy / "train-00000.bin"
    reader = ShardReader(path)
    whole = reader.read(0, reader.tokens)
    os.chmod(path, 0o444)
    os.utime(path, (0, 0))
    np.testing.assert_array_equal(reader.read(0, reader.tokens), whole)
    assert reader._verified.all()
