"""A corpus of very many shards and documents: what every rank keeps per shard stays small.

A 15T-token corpus in 256 MiB shards has ~120,000 shards and ~15 billion documents. Each rank
used to keep every shard memory-mapped (Linux allows 65,530 maps a process) and every shard's
document index in memory (8 bytes a document: ~120 GB a rank). Now a stream keeps at most
``max_mapped`` shards mapped and a reader keeps only its chunk CRCs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from luban.data.loader import TokenStream
from luban.data.shards import ShardReader, ShardWriter


def _shards(folder: Path, count: int, docs: int, doc_tokens: int) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for k in range(count):
        path = folder / f"s{k:03d}.bin"
        with ShardWriter(path, np.uint16, chunk_tokens=64) as writer:
            for _ in range(docs):
                writer.add_document(rng.integers(0, 60000, doc_tokens))
            writer.close()
        paths.append(path)
    return paths


def _mapped(folder: Path) -> int:
    """Maps of this process onto files in ``folder`` (what counts against vm.max_map_count)."""
    return sum(str(folder) in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_a_stream_of_many_shards_keeps_at_most_max_mapped_of_them_mapped(tmp_path):
    paths = _shards(tmp_path, 12, docs=5, doc_tokens=40)
    whole = np.concatenate([ShardReader(p).read(0, 200) for p in paths])
    stream = TokenStream([ShardReader(p) for p in paths], max_mapped=3)
    rng = np.random.default_rng(1)
    most = 0
    for _ in range(200):  # windows anywhere, some across shard boundaries
        start = int(rng.integers(0, len(whole) - 90))
        np.testing.assert_array_equal(stream.read(start, start + 90), whole[start:start + 90])
        most = max(most, _mapped(tmp_path))
    assert 1 <= most <= 3, most
    np.testing.assert_array_equal(stream.read(0, len(whole)), whole)  # a read wider than max_mapped shards


def test_an_open_shard_keeps_its_chunk_crcs_but_not_its_document_index(tmp_path):
    path, = _shards(tmp_path, 1, docs=20_000, doc_tokens=2)
    reader = ShardReader(path)
    reader.read(0, 10)
    held = sum(v.nbytes for v in vars(reader).values() if isinstance(v, np.ndarray) and not isinstance(v, np.memmap))
    assert held < 20_000 * 8 // 10, held  # the index alone is 160,000 bytes; 625 chunk CRCs are 2,500
    np.testing.assert_array_equal(reader.document(12_345), reader.read(24_690, 24_692))
