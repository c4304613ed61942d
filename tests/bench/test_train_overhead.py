"""bench/train_overhead.py (bench/results/train.md (a)) runs end to end on a few steps: it once
died reading the run's header line of metrics.jsonl as a step record, unnoticed until rerun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_overhead_bench_prints_its_ratio(tmp_path):
    env = {**os.environ, "LUBAN_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "train_overhead.py"), "--steps", "5", "--rounds", "1",
                           "--seq", "32", "--batch", "4"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert result["steps"] == 5 and result["luban_median_step_s"] > 0 and result["bare_median_step_s"] > 0
    assert result["ratio"] == result["luban_median_step_s"] / result["bare_median_step_s"]
