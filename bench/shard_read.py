"""Shard read path: ``ShardReader.read`` (one ``pread`` into a fresh array, chunks verified) against a
copy out of an ``np.memmap`` of the same file (the read path before 2026-11-27, which a shard cut
short under it turned into a SIGBUS), side by side in one run; and ``verify`` of a whole shard.

    .venv/bin/python bench/shard_read.py [--tokens N] [--reads N]
"""

from __future__ import annotations

import argparse
import tempfile
import timeit
from pathlib import Path

import numpy as np

from luban.data.shards import HEADER_SIZE, ShardReader, ShardWriter


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
        print(f"| verify (open + every chunk CRC) | {reader.tokens:,} | {whole * 1e3:.2f} ms | |")


if __name__ == "__main__":
    main()
