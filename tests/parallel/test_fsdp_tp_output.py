"""Tensor parallel under FSDP2 (tp with dp·cp > 1 needs zero >= 1, e.g. ``cp = 2, tp = 2``): the
model's output must not be a view. It was: the LM head returned ``DTensor.to_local()``, a view,
and FSDP2 printed "FSDP2-wrapped module (FSDPTransformer) returned a view tensor ... will
silently drop the pre-backward hook" on every rank. No gradient was lost (nothing wrote into the
logits in place), so the runs matched one process then as now; the logits now leave the model as
the DTensor that ``loss_parallel`` takes (``luban.parallel.tensor_parallel``). Checked here: no
such warning, and the parameters after 2 SGD steps (so the gradients) equal the single-process
engine's, for ZeRO-1 and ZeRO-3 (where the root's pre-backward hook gathers the head and
embeddings again) and for a pipeline whose last stage returns the DTensor logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel.harness import max_diff, merged_params, results, run_job

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
JOBS = [
    {"name": "cp2-tp2-zero1", "preset": "tiny", "layout": {"cp": 2, "tp": 2, "zero": 1}},
    {"name": "cp2-tp2-zero3-llama", "preset": "tiny-llama", "layout": {"cp": 2, "tp": 2, "zero": 3}},
    {"name": "pp2-tp2", "preset": "tiny", "layout": {"pp": 2, "tp": 2, "micro_batch": 2}},
]


@pytest.mark.multirank
@pytest.mark.timeout(2400)  # one 4-rank spawn of three jobs plus two single-process references
def test_tensor_parallel_output_under_fsdp_is_no_view_and_gradients_match_one_process(tmp_path):
    code = ("import json, sys; from pathlib import Path; from tests.parallel.harness import spawn; "
            "sys.exit(spawn(json.loads(sys.argv[1]), 4, Path(sys.argv[2])))")
    run = subprocess.run([sys.executable, "-c", code, json.dumps(JOBS), str(tmp_path)], cwd=ROOT, env=dict(os.environ),
                         capture_output=True, text=True, timeout=1500)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-5000:]
    assert "returned a view tensor" not in output, output[-5000:]
    refs: dict = {}
    for job in JOBS:
        ref = refs.setdefault(job["preset"], run_job({"name": "ref", "preset": job["preset"]}))
        per_rank = results(job["name"], 4, tmp_path)
        assert max_diff(merged_params(per_rank), ref["params"]) < TOL, job["name"]
        assert per_rank[0]["losses"] == pytest.approx(ref["losses"], abs=TOL), job["name"]
        assert per_rank[0]["norms"] == pytest.approx(ref["norms"], abs=TOL), job["name"]
        assert all(r["eval"] == pytest.approx(ref["eval"], abs=TOL) for r in per_rank), job["name"]
