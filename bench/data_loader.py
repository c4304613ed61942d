"""Data-layer benchmark: build throughput and TokenLoader throughput from packed shards.

Builds the default corpus (Python stdlib sources) with the byte and the BPE tokenizer, checks
every CRC of the byte build, then reads it with ``TokenLoader`` with and without the prefetch thread, both as fast as possible
and with a simulated training step (``--compute-ms`` of sleep, which like an accelerator step
releases the GIL) so the overlap prefetching buys is visible; last, each sample-order version
without prefetch, side by side, and the loader with and without the per-read check that a shard was
not written since its chunks were verified. Prints a markdown table.

    .venv/bin/python bench/data_loader.py [--max-bytes N] [--steps N] [--seq-len N] ...
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from luban.data.build import build_dataset
from luban.data.loader import TokenLoader
from luban.data.manifest import open_dataset
from luban.data.order import ORDER_RULES, ORDER_VERSION
from luban.data.shards import ShardReader


def bench_build(out: Path, max_bytes: int, tokenizer: str, vocab_size: int | None) -> str:
    started = time.perf_counter()
    manifest = build_dataset(None, out, tokenizer=tokenizer, vocab_size=vocab_size,
                             max_bytes=max_bytes)
    seconds = time.perf_counter() - started
    size = manifest["source"]["bytes"]
    tokens = sum(s["tokens"] for s in manifest["splits"].values())
    name = tokenizer if vocab_size is None else f"{tokenizer} (vocab {vocab_size})"
    return (f"| build, {name} | {size / 2**20:.1f} MiB text, {tokens:,} tokens | {seconds:.2f} s "
            f"| {size / seconds / 2**20:.1f} MiB/s, {tokens / seconds / 1e6:.2f} M tokens/s |")


def bench_verify(data: Path) -> str:
    started = time.perf_counter()
    _, splits = open_dataset(data)
    size = 0
    for reader in (r for readers in splits.values() for r in readers):
        reader.verify()
        size += reader.size
    seconds = time.perf_counter() - started
    return (f"| verify (open + every chunk CRC) | {size / 2**20:.1f} MiB of shards | "
            f"{seconds:.3f} s | {size / seconds / 2**20:.0f} MiB/s |")


def bench_loader(data: Path, args, prefetch: int, compute_ms: float, order_version: int = ORDER_VERSION,
                 what: str = "") -> str:
    with TokenLoader(data, seq_len=args.seq_len, global_batch=args.batch, prefetch=prefetch,
                     order_version=order_version) as ld:
        next(ld)  # start the thread / touch the first chunks
        started = time.perf_counter()
        for _ in range(args.steps):
            tokens, _ = next(ld)
            if compute_ms:
                time.sleep(compute_ms / 1e3)
        seconds = time.perf_counter() - started
    rate = args.steps * tokens.numel() / seconds
    ideal = f", ideal {tokens.numel() / (compute_ms / 1e3) / 1e6:.2f}" if compute_ms else ""
    return (f"| loader, order v{order_version}, prefetch={prefetch}, step compute {compute_ms:g} ms{what} | {args.steps} steps "
            f"x [{args.batch}, {args.seq_len}] | {seconds:.2f} s | "
            f"{rate / 1e6:.2f} M tokens/s{ideal} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", type=int, default=8 << 20, help="corpus cap (byte build)")
    parser.add_argument("--bpe-max-bytes", type=int, default=2 << 20)
    parser.add_argument("--bpe-vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--compute-ms", type=float, default=2.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = ["| what | size | time | throughput |", "| --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "byte"
        rows.append(bench_build(data, args.max_bytes, "byte", None))
        rows.append(bench_build(Path(tmp) / "bpe", args.bpe_max_bytes, "bpe", args.bpe_vocab))
        rows.append(bench_verify(data))
        for compute_ms in (0.0, args.compute_ms):
            for prefetch in (0, 2):
                rows.append(bench_loader(data, args, prefetch, compute_ms))
        for version in sorted(ORDER_RULES):  # the order rules side by side (luban.data.order), no prefetch
            rows.append(bench_loader(data, args, 0, 0.0, version))
        # what a read's check that the shard was not written since its chunks were verified costs (one
        # fstat a read, ShardReader._unchanged), against the same loader without it, no prefetch
        rows.append(bench_loader(data, args, 0, 0.0, what=", shard stamp checked (as shipped)"))
        checked = ShardReader._unchanged
        ShardReader._unchanged = lambda self: True
        try:
            rows.append(bench_loader(data, args, 0, 0.0, what=", shard stamp not checked"))
        finally:
            ShardReader._unchanged = checked
    print("\n".join(rows))


if __name__ == "__main__":
    main()
