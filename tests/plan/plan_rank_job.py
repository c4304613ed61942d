"""One rank of the planner's multi-rank memory checks (run by ``luban.parallel.launch``):
``python -m tests.plan.plan_rank_job JOBS.json OUT_DIR``. Each job builds luban's engine for a
layout, trains one AdamW step and writes this rank's ``memory_report()`` as JSON.

A job names a ``preset`` (with ``seq`` and ``vocab``) or gives a whole ``model`` config (the
``ModelConfig`` fields); with ``"activations_only": true`` it runs one forward/backward and no
optimizer step (saved activations do not depend on the optimizer's state), so a sweep over
hundreds of layouts stays cheap, and writes every such job's report into one file per rank
(``activations.rank<R>.json``: name -> report, with the rank's pipeline stage)."""

import json
import os
import sys
from pathlib import Path

import torch

from luban.model.config import ModelConfig
from luban.model.presets import get_preset
from luban.parallel.engine import OptimizerConfig, build_engine
from luban.parallel.layout import ParallelLayout


def model_config(job: dict) -> ModelConfig:
    if "model" in job:
        return ModelConfig(**job["model"])
    return get_preset(job["preset"]).replace(seq_len=job["seq"], vocab=job["vocab"])


def run(job: dict) -> dict:
    cfg = model_config(job)
    layout = ParallelLayout(**job["layout"])
    batch = job["global_batch"]
    engine = build_engine(cfg, layout, OptimizerConfig(name="adamw"), batch, seed=0, device=torch.device("cpu"))
    data = torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    rows = slice(engine.dp_rank * batch // layout.dp, (engine.dp_rank + 1) * batch // layout.dp)
    engine.forward_backward(data[rows, :-1], data[rows, 1:])
    if job.get("activations_only") and layout.pp > 1:  # a pipeline's first step is not measured (see Engine)
        engine.forward_backward(data[rows, :-1], data[rows, 1:])
    if not job.get("activations_only"):
        engine.step(1e-3, 1.0)
        engine.forward_backward(data[rows, :-1], data[rows, 1:])  # gradients and activations of a step with state
    report = {**engine.memory_report(), "pp_rank": engine.pp_rank}
    engine.barrier()
    return report


def main(jobs_file: str, out_dir: str) -> int:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    swept = {}
    for job in json.loads(Path(jobs_file).read_text()):
        if job.get("activations_only"):
            swept[job["name"]] = run(job)
        else:
            Path(out_dir, f"{job['name']}.rank{rank}.json").write_text(json.dumps(run(job)))
    if swept:
        Path(out_dir, f"activations.rank{rank}.json").write_text(json.dumps(swept))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
