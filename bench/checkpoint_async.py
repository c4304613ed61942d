"""Issue 12 item 6 bench: the training stall of an asynchronous checkpoint vs a synchronous one.

On the GPT-2 124M model + AdamW state (the real ``luban.train.checkpoint`` and ``Engine``), in
training: every save follows a real step (forward/backward + AdamW) on random tokens.

* sync: ``checkpoint.save`` (DCP write + fsync + CRC32 manifest + atomic rename); training is
  blocked for all of it.
* async: ``AsyncCheckpointer.save`` captures the small state and returns; a background thread
  copies the tensors to host memory while the next step's forward/backward runs, and that
  step's optimizer waits for the copy (``Engine.before_update``). The stall is what the trainer
  reports in metrics.jsonl: the capture plus that wait. Steps then go on until the background
  write ends; ``extra step time`` is their time over as many steps with no save in flight
  (the mean of the round's two plain steps): the copy and the write share the cores with
  training, which is not blocked but slower. It is noisy on a shared machine.

Rounds alternate plain steps, sync and async so machine noise hits all alike; medians.
Goal: async stall <= 10% of the sync save time.

    .venv/bin/python bench/checkpoint_async.py [--preset gpt2-124m] [--seq 256] [--batch 1]
                                               [--dir /tmp] [--rounds 3]
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence of the training steps")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cfg = get_preset(args.preset)
    engine = Engine(cfg, ParallelLayout(), OptimizerConfig(), args.batch, 0, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)

    def fwd_bwd() -> float:
        tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=gen)
        t0 = time.perf_counter()
        engine.forward_backward(tokens[:, :-1], tokens[:, 1:])
        return time.perf_counter() - t0

    def step() -> float:
        t0 = time.perf_counter()
        fwd_bwd()
        engine.step(1e-4, 1.0)
        return time.perf_counter() - t0

    step()  # AdamW states exist from here on
    root = Path(tempfile.mkdtemp(dir=args.dir))
    writer = checkpoint.AsyncCheckpointer(root / "async", keep=1)
    engine.before_update = writer.wait_staged  # as the trainer does
    plain, sync, stall, capture, overlapped, write, slowdown = [], [], [], [], [], [], []
    try:
        for r in range(1, args.rounds + 1):
            base = [step(), step()]
            plain += base
            step()
            t0 = time.perf_counter()
            checkpoint.save(root / "sync", r, engine.state_dict(), {"step": r, "world_size": 1}, keep=1)
            sync.append(time.perf_counter() - t0)
            step()
            t0 = time.perf_counter()
            state = engine.state_dict()  # inside the timer, as for the sync save (and in the trainer)
            before = time.perf_counter() - t0
            record = writer.save(r, state, {"step": r, "world_size": 1})
            record.stall_s += before  # wait_staged adds the wait at the next optimizer step
            capture.append(record.stall_s)
            during = [step()]  # the copy runs under this step's forward/backward; its optimizer waits
            overlapped.append(during[0])
            stall.append(record.stall_s)
            while not writer.pending[0].done():  # training goes on while the write runs
                during.append(step())
            writer.wait()
            write.append(record.write_s)
            slowdown.append(sum(during) - len(during) * statistics.mean(base))  # this round's plain steps
        nbytes = sum(f.stat().st_size for f in (root / "sync" / f"step_{args.rounds:07d}").iterdir())
    finally:
        writer.close()
        shutil.rmtree(root, ignore_errors=True)
    p, s, a, c, o, w, d = (statistics.median(x) for x in (plain, sync, stall, capture, overlapped, write, slowdown))
    print(f"{args.preset}: checkpoint {nbytes / 1e9:.2f} GB; steps of {args.batch} x {args.seq} tokens; "
          f"{args.rounds} rounds (medians)")
    print("per round: sync " + " ".join(f"{x:.3f}" for x in sync) + " | stall " + " ".join(f"{x:.3f}" for x in stall)
          + " | extra step time " + " ".join(f"{x:.2f}" for x in slowdown))
    print(f"plain step (no save in flight)   {p:.3f} s")
    print(f"sync save (training blocked)     {s:.3f} s")
    print(f"async stall (capture + wait)     {a:.3f} s   of which capture {c:.3f} s")
    print(f"step overlapping the copy        {o:.3f} s   (stall included)")
    print(f"background copy + write          {w:.3f} s   extra step time while it ran {d:.3f} s (stall included)")
    print(f"async stall / sync save          {a / s:.3f}   (goal <= 0.10)")


if __name__ == "__main__":
    main()
