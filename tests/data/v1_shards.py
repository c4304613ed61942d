"""Shard format version 1, written here independently of ``luban.data.shards`` (which writes version 2 now),
so that tests can check that datasets built before version 2 keep opening, reading and verifying.

Version 1: header (64 bytes) | tokens | zero padding to 8 | document index (uint64 each) | chunk CRCs
(uint32 each); the header's CRC field at byte 56 covers [index offset, end of file): the document index
*and* the chunk-CRC table, so opening a version-1 shard reads (and checks) its whole document index.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

V1_HEADER = struct.Struct("<8sHHIQQQQQII")


def v1_shard_bytes(docs, dtype=np.uint16, chunk_tokens: int = 16) -> bytes:
    """The bytes of a version-1 shard holding ``docs`` (lists of token ids), as luban wrote them."""
    dtype = np.dtype(dtype).newbyteorder("<")
    code = {2: 1, 4: 2}[dtype.itemsize]
    arrays = [np.asarray(d, dtype=dtype) for d in docs]
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype)
    starts = np.cumsum([0] + [len(a) for a in arrays[:-1]]).astype("<u8") if arrays else np.zeros(0, "<u8")
    body = tokens.tobytes()
    step = chunk_tokens * dtype.itemsize
    crcs = np.asarray([zlib.crc32(body[i:i + step]) for i in range(0, len(body), step)], "<u4")
    index_offset = (64 + len(body) + 7) // 8 * 8
    tail = starts.tobytes() + crcs.tobytes()
    crc_offset = index_offset + 8 * len(arrays)
    head = V1_HEADER.pack(b"LUBANTOK", 1, code, chunk_tokens, len(tokens), len(arrays), 64, index_offset,
                          crc_offset, zlib.crc32(tail), 0)[:60]
    return head + struct.pack("<I", zlib.crc32(head)) + body + bytes(index_offset - 64 - len(body)) + tail


def write_v1_shard(path: Path, docs, dtype=np.uint16, chunk_tokens: int = 16) -> dict:
    """Write a version-1 shard; returns its manifest entry (file, tokens, documents, bytes, header_crc32)."""
    data = v1_shard_bytes(docs, dtype, chunk_tokens)
    Path(path).write_bytes(data)
    return {"file": Path(path).name, "tokens": sum(len(d) for d in docs), "documents": len(docs),
            "bytes": len(data), "header_crc32": struct.unpack("<I", data[60:64])[0]}
