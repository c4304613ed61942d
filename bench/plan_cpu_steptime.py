"""Planner step time vs luban's measured CPU step time, layout by layout.

For each (model, layout) it runs the real trainer (``luban train --nproc N --parallel config
--set parallel.…``, global batch 16, seq 128, a few steps) and compares the median step time
over steps 4+ (as ``luban/train/plan_check.py`` does for ``--parallel auto``) with
``luban.plan.estimate`` on this machine's probed profile (``luban.plan.probe.cached_profile``,
``--reprobe`` measures it again first). Prints one table row per run, with the measured
forward+backward and optimizer medians next to the predicted ones.

    .venv/bin/python bench/plan_cpu_steptime.py [--steps 8] [--only tiny] [--reprobe]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from luban.model.config import ModelConfig
from luban.parallel.layout import ParallelLayout
from luban.plan.estimate import estimate
from luban.plan.system import System

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH, SEQ = 16, 128
LAYOUTS = {  # name: (ranks, layout)
    "1 rank mb4": (1, dict(micro_batch=4)),
    "dp2 zero0 mb4": (2, dict(dp=2, micro_batch=4)),
    "dp2 zero2 mb4": (2, dict(dp=2, zero=2, micro_batch=4)),
    "tp2 mb4": (2, dict(tp=2, micro_batch=4)),
    "pp2 1f1b mb4": (2, dict(pp=2, schedule="1f1b", micro_batch=4)),
    "dp4 zero2 mb2": (4, dict(dp=4, zero=2, micro_batch=2)),
}
MODELS = {"tiny": ("tiny", {}), "tiny-llama": ("tiny-llama", {}), "gpt-h256": ("tiny", {"hidden": 256})}


def model_config(name: str):
    """The model exactly as the trainer builds it from ``--set model.…`` (derived widths re-derived)."""
    preset, changes = MODELS[name]
    return ModelConfig.from_dict({"preset": preset, **changes})


def measure(model: str, ranks: int, layout: dict, steps: int) -> dict:
    """Median step, forward+backward and optimizer seconds over steps 4+ of a real run."""
    with tempfile.TemporaryDirectory() as tmp:
        preset, changes = MODELS[model]
        sets = {"model.preset": preset, **{f"model.{k}": v for k, v in changes.items()},
                "train.steps": steps, "train.global_batch": GLOBAL_BATCH, "model.seq_len": SEQ,
                "train.eval_every": 0, "train.checkpoint_every": 0, "run.progress": "none", "run.dir": tmp,
                **{f"parallel.{k}": v for k, v in layout.items()}}
        args = [sys.executable, "-m", "luban", "train", "--parallel", "config", "--nproc", str(ranks)]
        for k, v in sets.items():
            args += ["--set", f"{k}={json.dumps(v) if isinstance(v, str) else v}"]
        proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "time_step_s" in r][3:]
        return {k: statistics.median(r[f"time_{k}_s"] for r in rows) for k in ("step", "fwd_bwd", "optimizer")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--only", nargs="*", default=list(MODELS), help="models to run")
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS), help="layouts to run")
    ap.add_argument("--reprobe", action="store_true", help="measure this machine again before predicting")
    args = ap.parse_args()
    from luban.plan import probe

    if args.reprobe:
        probe.cache_path().unlink(missing_ok=True)
    t0 = time.perf_counter()
    system = System.from_dict(probe.cached_profile(), source="probe")
    print(f"probe: {time.perf_counter() - t0:.1f} s; load average {os.getloadavg()}")
    print("| model | layout | ranks | predicted s | measured s | error | measured fwd+bwd / optimizer s | "
          "predicted optimizer s |\n|---|---|---|---|---|---|---|---|")
    errors = []
    for model in args.only:
        cfg = model_config(model)
        for name in args.layouts:
            ranks, knobs = LAYOUTS[name]
            layout = ParallelLayout(**knobs)
            est = estimate(cfg, system, layout, global_batch=GLOBAL_BATCH, seq=SEQ, gpus=ranks, runtime="luban")
            got = measure(model, ranks, knobs, args.steps)
            err = (est.step_time_s - got["step"]) / got["step"]
            errors.append(abs(err))
            print(f"| {model} | {name} | {ranks} | {est.step_time_s:.3f} | {got['step']:.3f} | {100 * err:+.0f}% | "
                  f"{got['fwd_bwd']:.3f} / {got['optimizer']:.3f} | {est.time_breakdown_s['optimizer']:.3f} |",
                  flush=True)
    print(f"mean |error| {100 * statistics.mean(errors):.0f}%, max {100 * max(errors):.0f}%, "
          f"within 30%: {sum(e <= 0.3 for e in errors)}/{len(errors)}; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
