"""Issue 2 bench (c): checkpoint save and load throughput vs the disk's own write speed.

Saves a model + AdamW state (DCP files, fsync, CRC32 manifest, atomic rename — the real
``luban.train.checkpoint.save``), loads it back (``checkpoint.load`` + CRC verification as
``--resume auto`` does), and compares with writing the same number of bytes with plain
``write`` + ``fsync``, in one run.

    .venv/bin/python bench/checkpoint_io.py [--preset gpt2-124m] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from luban.model import get_preset
from luban.parallel.engine import Engine, OptimizerConfig
from luban.parallel.layout import ParallelLayout
from luban.train import checkpoint


def disk_write_gbps(path: Path, nbytes: int) -> float:
    block = os.urandom(64 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < nbytes:
            f.write(block)
            written += len(block)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return written / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cfg = get_preset(args.preset)
    engine = Engine(cfg, ParallelLayout(), OptimizerConfig(), 1, 0, torch.device("cpu"))
    state = engine.state_dict()  # initialises AdamW state (exp_avg, exp_avg_sq)
    root = Path(tempfile.mkdtemp(dir=args.dir))
    saves, loads, disks = [], [], []
    try:
        for r in range(args.rounds):  # alternate so that machine noise hits all three alike
            t0 = time.perf_counter()
            ckpt = checkpoint.save(root / "ckpt", r + 1, state, {"step": r + 1, "world_size": 1}, keep=1)
            saves.append(time.perf_counter() - t0)
            nbytes = sum(f.stat().st_size for f in ckpt.iterdir())
            t0 = time.perf_counter()
            assert checkpoint.verify(ckpt) is None
            checkpoint.load(ckpt, engine.state_dict())
            loads.append(time.perf_counter() - t0)
            disks.append(disk_write_gbps(root / "dd.bin", nbytes))
    finally:
        shutil.rmtree(root)
    save_gbps = nbytes / statistics.median(saves) / 1e9
    disk = statistics.median(disks)
    print(json.dumps({"preset": args.preset, "bytes": nbytes, "rounds": args.rounds, "disk_write_GBps": disk,
                      "save_GBps": save_gbps, "load_verify_GBps": nbytes / statistics.median(loads) / 1e9,
                      "save_vs_disk": save_gbps / disk}, indent=1))


if __name__ == "__main__":
    main()
