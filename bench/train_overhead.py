"""Issue 2 bench (a): ``luban train`` step time on one process vs a bare PyTorch loop.

Same model (same seed), same batches, same fused AdamW, same clipping. The two are run in
alternating blocks within one process so machine noise hits both alike; the ratio of
medians is reported. Goal: <= 1.03.

    .venv/bin/python bench/train_overhead.py [--preset tiny] [--steps 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from luban.config import load_config
from luban.model.transformer import build_model, lm_loss
from luban.parallel.optimizer import OptimizerConfig, build_optimizer
from luban.train.trainer import Trainer


def bare_loop(cfg, batches) -> list[float]:
    model = build_model(cfg.model, seed=cfg.train.seed)
    opt = build_optimizer(model.parameters(), OptimizerConfig(), torch.device("cpu"))
    times = []
    for tokens, labels in batches:
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = cfg.train.lr
        loss = lm_loss(model(tokens), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)
        times.append(time.perf_counter() - t0)
    return times


def luban_loop(overrides, run_dir: Path) -> list[float]:
    cfg = load_config(None, overrides + [f'run.dir="{run_dir}"'])
    Trainer(cfg).train()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [r["time_step_s"] for r in records if "time_step_s" in r]  # step records (not the run's header)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", default="", help="dataset dir (default: the embedded corpus)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    overrides = [f'model.preset="{args.preset}"', f"model.seq_len={args.seq}", f"train.steps={args.steps}",
                 f"train.global_batch={args.batch}", "train.eval_every=0", "train.checkpoint_every=0",
                 "run.tensorboard=false", 'run.progress="none"', f'data.path="{args.data}"', "train.warmup_steps=0",
                 f"parallel.micro_batch={args.batch}"]  # one micro-batch: the bare loop does no accumulation
    cfg = load_config(None, overrides)
    from luban.data.loader import TokenLoader
    from luban.train.resolve import dataset_path

    with TokenLoader(dataset_path(cfg), seq_len=args.seq, global_batch=args.batch, prefetch=0) as loader:
        batches = [next(loader) for _ in range(args.steps)]
    skip = 3  # warm-up steps excluded from both
    luban_t, bare_t = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            luban_t += luban_loop(overrides, Path(tmp) / f"r{r}")[skip:]
            bare_t += bare_loop(cfg, batches)[skip:]
    ratio = statistics.median(luban_t) / statistics.median(bare_t)
    print(json.dumps({"preset": args.preset, "seq": args.seq, "batch": args.batch, "steps": args.steps,
                      "rounds": args.rounds, "luban_median_step_s": statistics.median(luban_t),
                      "bare_median_step_s": statistics.median(bare_t), "ratio": ratio}, indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
