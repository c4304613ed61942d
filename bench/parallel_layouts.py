"""Step time of luban's parallel layouts on 4 CPU ranks (gloo).

    python bench/parallel_layouts.py [--nproc 4] [--steps 5] [--out bench/results/parallel.md]

Starts the ranks with ``luban.parallel.launch`` (this file re-runs itself as
``python -m bench.parallel_layouts --worker``), builds an ``Engine`` per layout, runs 2 warm-up
steps and times ``forward_backward + step`` for ``--steps`` steps (median; every rank agrees
through a barrier). Model: ``tiny`` (GPT-2 shape, 4 layers, h=128) at seq 128, global batch 16,
AdamW. On CPU this measures the overhead of each mechanism, not GPU throughput.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = [
    {"dp": 4}, {"dp": 4, "zero": 1}, {"dp": 4, "zero": 2}, {"dp": 4, "zero": 3},
    {"dp": 4, "dp_replicate": 2, "zero": 3},
    {"tp": 4}, {"tp": 2, "dp": 2, "zero": 1}, {"tp": 2, "sp": True, "dp": 2, "zero": 1},
    {"pp": 4, "schedule": "1f1b"}, {"pp": 2, "dp": 2, "schedule": "gpipe"}, {"pp": 2, "dp": 2, "schedule": "1f1b"},
    {"pp": 2, "dp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2},
    {"pp": 2, "dp": 2, "zero": 1, "schedule": "zero-bubble", "virtual_stages": 2},
    {"pp": 2, "dp": 2, "zero": 1, "schedule": "dualpipev", "virtual_stages": 2},
    {"cp": 4}, {"cp": 2, "dp": 2}, {"pp": 2, "tp": 2}, {"cp": 2, "tp": 2, "zero": 1},
    {"dp": 4, "zero": 3, "recompute": "full"},
]
GLOBAL_BATCH, SEQ, PRESET = 16, 128, "tiny"
NOTES = """
Notes:
* The 4 ranks oversubscribe a 2-core machine that other jobs share, so timings are noisy
  (tens of percent) and communication-heavy layouts (tp, cp: collectives per layer over
  gloo/TCP) look far worse than on GPUs with NVLink. Read these as relative CPU overheads.
* ZeRO-1/2/3 (FSDP2) keep parameters sharded between steps at every stage, hence the same
  parameter column; the stages differ in gradient memory while accumulating (ZeRO-1 keeps
  full gradients until the last micro-batch) and in all-gathers per step.
* Gradients are measured after ``forward_backward``, before ``step``; a pipeline stage's
  tied or vocab-parallel embedding gradient may still be replicated then.
* GPU MFU (``bench/gpu_check.py``: GPT-2 124M, Llama 1B and a MoE against HF and a bare loop, bf16,
  compiled) has NOT been measured: no GPU was available to this task.
"""


def worker(nproc: int, steps: int, out: str) -> int:
    import torch

    from luban.model.presets import get_preset
    from luban.parallel.engine import OptimizerConfig, build_engine
    from luban.parallel.layout import ParallelLayout

    torch.set_num_threads(1)
    cfg = get_preset(PRESET).replace(seq_len=SEQ)
    rows = []
    for raw in LAYOUTS:
        layout = ParallelLayout.from_dict({"micro_batch": 2, **raw})
        engine = build_engine(cfg, layout, OptimizerConfig(), GLOBAL_BATCH, seed=0, device=torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        data = torch.randint(0, cfg.vocab, (GLOBAL_BATCH, SEQ + 1), generator=gen)
        per = GLOBAL_BATCH // layout.dp
        x, y = (t[engine.dp_rank * per:(engine.dp_rank + 1) * per] for t in (data[:, :-1], data[:, 1:]))
        times = []
        for i in range(2 + steps):
            engine.barrier()
            start = time.perf_counter()
            engine.forward_backward(x, y)
            engine.step(1e-3, 1.0)
            engine.barrier()
            if i >= 2:
                times.append(time.perf_counter() - start)
        mem = engine.memory_report()
        rows.append({"layout": raw, "step_s": statistics.median(times), "memory": mem})
    if engine.rank == 0:
        Path(out).write_text(json.dumps(rows))
    return 0


def render(rows: list[dict], nproc: int, steps: int, command: str) -> str:
    lines = [
        "# Parallel layouts: step time on CPU ranks", "",
        f"Date: {datetime.date.today().isoformat()}. Machine: {platform.machine()}, {os.cpu_count()} CPU cores "
        f"({platform.processor() or 'unknown CPU'}), {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, torch {__import__('torch').__version__}, gloo.", "",
        f"Command: `{command}`", "",
        f"{nproc} ranks, one thread each; model `{PRESET}` (4 layers, h=128, V=257) at seq {SEQ}, global batch "
        f"{GLOBAL_BATCH}, micro-batch 2, AdamW; median of {steps} steps after 2 warm-up steps "
        "(forward_backward + step). Memory columns are rank 0's bytes (exact, from tensor storages).", "",
        "| layout | step time (s) | params (KiB) | grads (KiB) | optimizer (KiB) | activations / micro-batch (KiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        m = row["memory"]
        name = " ".join(f"{k}={v}" for k, v in row["layout"].items())
        lines.append(f"| {name} | {row['step_s']:.3f} | {m['param_bytes'] / 1024:.0f} | {m['grad_bytes'] / 1024:.0f} | "
                     f"{m['optimizer_bytes'] / 1024:.0f} | {m['activation_bytes'] / 1024:.0f} |")
    return "\n".join(lines) + "\n" + NOTES


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="bench/results/parallel.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.nproc, args.steps, args.worker)
    from luban.parallel.launch import launch

    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = str(Path(tmp) / "rows.json")
        code = launch(["--nproc", str(args.nproc), "--steps", str(args.steps), "--worker", rows_file],
                      nproc=args.nproc, module="bench.parallel_layouts")
        if code:
            return code
        rows = json.loads(Path(rows_file).read_text())
    command = "python " + " ".join(sys.argv)
    Path(args.out).write_text(render(rows, args.nproc, args.steps, command))
    print(Path(args.out).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
