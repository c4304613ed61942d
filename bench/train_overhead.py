"""Issue 2 bench (a): ``luban train`` step time on one process vs a bare PyTorch loop.

Same model (same seed), same batches, same fused AdamW, same clipping. The two are run in
alternating blocks within one process so machine noise hits both alike; the ratio of
medians is reported. Goal: <= 1.03.

``--log-every N`` runs luban with ``train.log_every = N`` (its records then carry the mean
time of the steps since the previous one: each counts for its steps). ``host_reads_per_step``
counts the tensor values luban's loop reads to the host (``float``, ``.item()``, ...) per step
in one more run: on a GPU each one stalls the host until the device drains (docs/training.md,
"What a step waits for"); with log_every = N it should be (2 per logged step) / N. CPU figures
only: the GPU step time with and without the reads is not measured here.

    .venv/bin/python bench/train_overhead.py [--preset tiny] [--steps 30] [--rounds 3] [--log-every 1]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
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
        float(loss.detach())  # read every step, as a plain loop that prints its loss does
        times.append(time.perf_counter() - t0)
    return times


def luban_loop(overrides, run_dir: Path) -> list[float]:
    """Seconds per step: each record's mean, once for each step it stands for (``log_every``)."""
    cfg = load_config(None, overrides + [f'run.dir="{run_dir}"'])
    Trainer(cfg).train()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    records = [r for r in records if "time_step_s" in r]  # step records (not checkpoint lines)
    steps = [r["step"] for r in records]
    return [r["time_step_s"] for r, before in zip(records, [0] + steps) for _ in range(r["step"] - before)]


READS = ("__float__", "item", "tolist", "__bool__", "__int__", "__index__")  # a tensor's value to the host


@contextlib.contextmanager
def counting_reads():
    """Count host reads of tensor values by the step that makes them (from one ``forward_backward`` to
    the next); yields the Counter."""
    from luban.parallel.engine import Engine

    counts, step = collections.Counter(), [0]
    saved = {name: getattr(torch.Tensor, name) for name in READS}
    forward_backward = Engine.forward_backward

    def counted(self, *args, **kwargs):
        step[0] += 1
        return forward_backward(self, *args, **kwargs)

    def reader(original):
        def read(self, *args, **kwargs):
            if step[0]:
                counts[step[0]] += 1
            return original(self, *args, **kwargs)
        return read

    Engine.forward_backward = counted
    for name, original in saved.items():
        setattr(torch.Tensor, name, reader(original))
    try:
        yield counts
    finally:
        Engine.forward_backward = forward_backward
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", default="", help="dataset dir (default: the embedded corpus)")
    ap.add_argument("--log-every", type=int, default=1, help="luban's train.log_every")
    args = ap.parse_args()
    torch.set_num_threads(2)
    overrides = [f'model.preset="{args.preset}"', f"model.seq_len={args.seq}", f"train.steps={args.steps}",
                 f"train.global_batch={args.batch}", "train.eval_every=0", "train.checkpoint_every=0",
                 "run.tensorboard=false", 'run.progress="none"', f'data.path="{args.data}"', "train.warmup_steps=0",
                 f"parallel.micro_batch={args.batch}",  # one micro-batch: the bare loop does no accumulation
                 f"train.log_every={args.log_every}"]
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
        with counting_reads() as reads:
            luban_loop(overrides, Path(tmp) / "reads")
    ratio = statistics.median(luban_t) / statistics.median(bare_t)
    print(json.dumps({"preset": args.preset, "seq": args.seq, "batch": args.batch, "steps": args.steps,
                      "rounds": args.rounds, "luban_median_step_s": statistics.median(luban_t),
                      "bare_median_step_s": statistics.median(bare_t), "ratio": ratio, "log_every": args.log_every,
                      "host_reads_per_step": sum(reads.values()) / args.steps,
                      "gpu_step_s": "not measured"}, indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
