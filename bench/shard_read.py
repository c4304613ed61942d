"""Shard read path: ``ShardReader.read`` (one ``pread`` into a fresh array, chunks verified) against a
copy out of an ``np.memmap`` of the same file (the read path before 2026-11-27, which a shard cut
short under it turned into a SIGBUS), side by side in one run; ``verify`` of a whole shard; and
what opening a shard costs in format version 2 against version 1 (the same documents; version 1
written by ``tests/data/v1_shards.py``): bytes read (/proc/self/io ``rchar``) and time.

    .venv/bin/python bench/shard_read.py [--tokens N] [--reads N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import timeit
from pathlib import Path

import numpy as np

from luban.data.shards import DEFAULT_CHUNK_TOKENS, HEADER_SIZE, ShardReader, ShardWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/data/v1_shards.py: the version-1 writer


def rchar() -> int:
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("rchar:")).split()[1])


def open_cost(path: Path) -> tuple[int, float]:
    """(bytes read by one open, less what reading /proc/self/io costs; best time of 5 x 20 opens)."""
    def delta(action) -> int:
        before = rchar()
        action()
        return rchar() - before
    read = min(delta(lambda: ShardReader(path)) for _ in range(3)) - min(delta(lambda: None) for _ in range(3))
    return read, min(timeit.repeat(lambda: ShardReader(path), number=20, repeat=5)) / 20


def bench_open(folder: Path) -> None:
    from tests.data.v1_shards import v1_shard_bytes

    print("\n| documents | version 2: bytes read | version 1: bytes read | version 2: open | version 1: open |")
    print("| --- | --- | --- | --- | --- |")
    for docs in (1_000, 200_000):
        v2, v1 = folder / f"v2-{docs}.bin", folder / f"v1-{docs}.bin"
        with ShardWriter(v2, np.uint16) as writer:
            for _ in range(docs):
                writer.add_document(np.ones(1, np.uint16))
            writer.close()
        v1.write_bytes(v1_shard_bytes([[1]] * docs, np.uint16, chunk_tokens=DEFAULT_CHUNK_TOKENS))
        (b2, t2), (b1, t1) = open_cost(v2), open_cost(v1)
        print(f"| {docs:,} | {b2:,} | {b1:,} | {t2 * 1e6:.0f} µs | {t1 * 1e6:.0f} µs |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--reads", type=int, default=50_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.bin"
        rng = np.random.default_rng(0)
        with ShardWriter(path, np.uint16) as writer:
            for _ in range(args.tokens // 5000):
                writer.add_document(rng.integers(0, 60000, 4999))
            writer.close()
        reader = ShardReader(path)
        reader.verify()
        mapped = np.memmap(path, reader.dtype, "r", offset=HEADER_SIZE, shape=(reader.tokens,))
        print("| read | tokens | ShardReader.read (pread) | np.array(memmap[a:b]) |")
        print("| --- | --- | --- | --- |")
        for size in (1025, 8193, 65537):
            starts = iter(rng.integers(0, reader.tokens - size, args.reads * 10).tolist())
            times = []
            for read in (lambda s: reader.read(s, s + size), lambda s: np.array(mapped[s:s + size])):
                times.append(min(timeit.repeat(lambda: read(next(starts)), number=args.reads // 10, repeat=5))
                             / (args.reads // 10))
            print(f"| random window | {size:,} | {times[0] * 1e6:.2f} µs | {times[1] * 1e6:.2f} µs |")
        whole = min(timeit.repeat(lambda: ShardReader(path).verify(), number=3, repeat=3)) / 3
        print(f"| verify (open, document index, every chunk CRC) | {reader.tokens:,} | {whole * 1e3:.2f} ms | |")
        bench_open(Path(tmp))


if __name__ == "__main__":
    main()
