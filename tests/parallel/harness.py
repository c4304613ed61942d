"""Run training jobs under any layout and compare them with the single-process engine.

A *job* is a dict: name, preset, seq, layout (``[parallel]`` keys), global_batch, steps,
optim (``OptimizerConfig`` keys), and optionally ``save``/``load`` (a DCP directory: save
after the steps / load before them) and ``offset`` (index of the first step, for resumed
runs). ``python -m tests.parallel.harness JOBS.json OUT`` runs the jobs on every rank of a
``luban.parallel.launch`` spawn; each rank writes ``OUT/<job>.rank<r>.pt`` with its full
(gathered) parameters, the losses, grad norms and memory report.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

from luban.model.presets import get_preset
from luban.parallel.engine import OptimizerConfig, build_engine, unwrap
from luban.parallel.launch import launch
from luban.parallel.layout import ParallelLayout

LR, MAX_NORM = 0.1, 1.0


def model_cfg(job):
    return get_preset(job.get("preset", "tiny")).replace(seq_len=job.get("seq", 32), vocab=job.get("vocab", 257))


def batch(step: int, global_batch: int, cfg):
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, cfg.vocab, (global_batch, cfg.seq_len + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def full_params(engine) -> dict[str, torch.Tensor]:
    out = {}
    for part in engine.model_parts:
        for name, p in unwrap(part).named_parameters(remove_duplicate=False):
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def run_job(job: dict) -> dict:
    import torch.distributed.checkpoint as dcp

    cfg = model_cfg(job)
    layout = ParallelLayout.from_dict(job.get("layout", {}))
    optim = OptimizerConfig(**{"name": "sgd", "weight_decay": 0.0, **job.get("optim", {})})
    gb = job.get("global_batch", 8)
    engine = build_engine(cfg, layout, optim, gb, seed=0, device=torch.device("cpu"))
    if job.get("load"):
        sd = engine.state_dict()
        dcp.load(sd, checkpoint_id=job["load"])
        engine.load_state_dict(sd)
    losses, norms = [], []
    per_dp = gb // layout.dp
    for step in range(job.get("offset", 0), job.get("offset", 0) + job.get("steps", 3)):
        tokens, labels = batch(step, gb, cfg)
        rows = slice(engine.dp_rank * per_dp, (engine.dp_rank + 1) * per_dp)
        losses.append(engine.forward_backward(tokens[rows], labels[rows]))
        norms.append(engine.step(LR, job.get("max_norm", MAX_NORM)))
    memory = engine.memory_report()
    if job.get("save"):
        dcp.save(engine.state_dict(), checkpoint_id=job["save"])
    agree = engine.any_rank(engine.rank == engine.world_size - 1)
    engine.barrier()
    return {"params": full_params(engine), "losses": losses, "norms": norms, "memory": memory, "any_rank": agree}


def main(jobs_file: str, out_dir: str) -> int:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    for job in json.loads(Path(jobs_file).read_text()):
        try:
            result = run_job(job)
        except Exception:  # record and go on: one broken layout must not hide the others
            result = {"error": traceback.format_exc()}
            print(f"[rank {rank}] {job['name']}: {result['error']}", file=sys.stderr)
            torch.save(result, Path(out_dir) / f"{job['name']}.rank{rank}.pt")
            return 1
        torch.save(result, Path(out_dir) / f"{job['name']}.rank{rank}.pt")
    return 0


def spawn(jobs: list[dict], nproc: int, out_dir: Path) -> int:
    """Run ``jobs`` in order in one spawn of ``nproc`` gloo ranks."""
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs_file = out_dir / f"jobs-{nproc}.json"
    jobs_file.write_text(json.dumps(jobs))
    os.environ["OMP_NUM_THREADS"] = "1"
    return launch([str(jobs_file), str(out_dir)], nproc=nproc, module="tests.parallel.harness")


def results(name: str, nproc: int, out_dir: Path) -> list[dict]:
    return [torch.load(out_dir / f"{name}.rank{r}.pt", weights_only=False) for r in range(nproc)]


def merged_params(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    merged = {}
    for res in per_rank:
        assert "error" not in res, res["error"]
        merged.update(res["params"])
    return merged


def max_diff(params: dict, ref: dict) -> float:
    assert set(params) <= set(ref) and params, sorted(set(params) - set(ref))
    return max((params[k] - ref[k]).abs().max().item() for k in params)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
