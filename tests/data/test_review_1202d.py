"""What the review of the shard stamp (``shards._stamp``, ``ShardReader._unchanged``) found (2026-12-02, 1202d).

``read`` looked at the stamp *before* reading: a write that landed between that ``fstat`` and the
``pread`` (a rewrite running while the loader reads) gave the new tokens of a verified chunk with no
CRC check, and the stamp, moved by then, was only seen by the next read. The stamp is now looked at
after the read: a write before it, or during it (the kernel moves the status-change time as a write
starts), is seen, and the chunks read are verified again."""

from __future__ import annotations

import os

import pytest

from luban.data.shards import ShardReader
from luban.errors import LubanError
from tests.data.test_inplace_rewrite import _flip_a_token


@pytest.mark.parametrize("span", ["verified", "partly-verified"])
def test_a_rewrite_between_the_stamp_check_and_the_read_is_a_crc_mismatch(dataset_copy, monkeypatch, span):
    path = dataset_copy / "train-00000.bin"
    reader = ShardReader(path)
    assert reader.tokens > 2 * reader.chunk_tokens
    reader.read(0, 3)  # chunk 0 verified; chunk 1 not
    real = os.preadv

    def written_first(fd, buffers, offset):  # the writer wins the race: its write lands just before this read
        monkeypatch.setattr(os, "preadv", real)
        _flip_a_token(path, 1, reader.dtype)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", written_first)
    stop = 3 if span == "verified" else reader.chunk_tokens + 3
    with pytest.raises(LubanError, match=f"{path}: CRC mismatch in chunk 0"):
        reader.read(0, stop)
