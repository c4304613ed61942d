"""A corpus of very many shards and documents: what every rank keeps per shard stays small.

A 15T-token corpus in 256 MiB shards has ~120,000 shards and ~15 billion documents. Each rank
used to keep every shard memory-mapped (Linux allows 65,530 maps a process) and every shard's
document index in memory (8 bytes a document: ~120 GB a rank). Now a stream keeps at most
``max_open`` shards open (read by ``pread``, none mapped) and a reader keeps only its chunk CRCs.
"""

from __future__ import annotations

import os
import subprocess
import sys
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


def _held(folder: Path) -> tuple[int, int]:
    """(maps, open descriptors) of this process onto files in ``folder``."""
    maps = sum(str(folder) in line for line in Path("/proc/self/maps").read_text().splitlines())
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder))
        except OSError:
            pass
    return maps, fds


def test_a_stream_of_many_shards_keeps_at_most_max_open_of_them_open_and_maps_none(tmp_path):
    paths = _shards(tmp_path, 12, docs=5, doc_tokens=40)
    whole = np.concatenate([ShardReader(p).read(0, 200) for p in paths])
    stream = TokenStream([ShardReader(p) for p in paths], max_open=3)
    rng = np.random.default_rng(1)
    most = 0
    for _ in range(200):  # windows anywhere, some across shard boundaries
        start = int(rng.integers(0, len(whole) - 90))
        np.testing.assert_array_equal(stream.read(start, start + 90), whole[start:start + 90])
        maps, fds = _held(tmp_path)
        assert maps == 0, maps
        most = max(most, fds)
    assert 1 <= most <= 3, most
    np.testing.assert_array_equal(stream.read(0, len(whole)), whole)  # a read wider than max_open shards


def test_an_open_shard_keeps_its_chunk_crcs_but_not_its_document_index(tmp_path):
    path, = _shards(tmp_path, 1, docs=20_000, doc_tokens=2)
    reader = ShardReader(path)
    reader.read(0, 10)
    held = sum(v.nbytes for v in vars(reader).values() if isinstance(v, np.ndarray))
    assert held < 20_000 * 8 // 10, held  # the index alone is 160,000 bytes; 625 chunk CRCs are 2,500
    np.testing.assert_array_equal(reader.document(12_345), reader.read(24_690, 24_692))


def test_a_stream_keeps_no_more_shards_open_than_the_open_file_limit_allows(tmp_path):
    """2026-11-27: each mapped shard held a file descriptor, and a stream kept up to 1,024: at the
    common soft limit of 1,024 open files a corpus of ~1,000 shards failed with "Too many open
    files". The bound is now a share of the soft limit (here 64 files: 8 shards a stream)."""
    paths = _shards(tmp_path, 40, docs=2, doc_tokens=30)
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
            "from luban.data.loader import TokenStream\nfrom luban.data.shards import ShardReader\n"
            "streams = [TokenStream([ShardReader(p) for p in sys.argv[1:]]) for _ in range(3)]\n"
            "for s in streams:\n    s.read(0, s.tokens)\n"
            "print(max(len(s._open) for s in streams))\n")
    proc = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout) == 64 // 8
