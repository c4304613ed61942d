"""Run training jobs under any layout and compare them with the single-process engine.

A *job* is a dict: name, preset, seq, layout (``[parallel]`` keys), global_batch, steps,
optim (``OptimizerConfig`` keys), and optionally ``save``/``load`` (a DCP directory: save
after the steps / load before them) and ``offset`` (index of the first step, for resumed
runs). ``python -m tests.parallel.harness JOBS.json OUT`` runs the jobs on every rank of a
``luban.parallel.launch`` spawn; each rank writes ``OUT/<job>.rank<r>.pt`` with its full
(gathered) parameters, the losses, grad norms and memory report.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from pathlib import Path

import torch

from luban.model.presets import get_preset
from luban.parallel.engine import OptimizerConfig, build_engine, unwrap
from luban.parallel.layout import ParallelLayout
from tests.child import launch as bounded_launch

LR, MAX_NORM = 0.1, 1.0


def model_cfg(job):
    return get_preset(job.get("preset", "tiny")).replace(seq_len=job.get("seq", 32), **job.get("model", {}))


def batch(step: int, global_batch: int, cfg):
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, cfg.vocab, (global_batch, cfg.seq_len + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def full_params(engine) -> dict[str, torch.Tensor]:
    out = {}
    for part in engine.model_parts:
        for name, p in unwrap(part).named_parameters(remove_duplicate=False):
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        saved = unwrap(part).state_dict().keys()
        out.update({name: b.detach().clone() for name, b in unwrap(part).named_buffers() if name in saved})
    return out


class ToyModel:
    """A user model that is not luban's transformer: a stack of Linear+Tanh layers with a
    HAI-platform-style ``build_stage`` hook (``luban.parallel.pipeline.PipelineModel``)."""

    def __init__(self, width: int = 16, depth: int = 8):
        torch.manual_seed(0)
        self.layers = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(depth)]

    def build_stage(self, stage_id: int, num_stages: int) -> torch.nn.Module:
        per = len(self.layers) // num_stages
        return copy.deepcopy(torch.nn.Sequential(*self.layers[stage_id * per:(stage_id + 1) * per]))


def run_toy_pipeline(job: dict) -> dict:
    """Every schedule on a 2-rank pipeline of ``ToyModel``: max |grad - single-process grad|."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from luban.parallel.launch import init_distributed
    from luban.parallel.pipeline import Pipeline
    from luban.parallel.schedules import NAMES as SCHEDULES

    init_distributed("cpu")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    toy, n_micro = ToyModel(), 4
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    loss_fn = torch.nn.functional.mse_loss
    full = torch.nn.Sequential(*copy.deepcopy(toy.layers))
    ref_loss = sum(loss_fn(full(a), b) for a, b in zip(x.chunk(n_micro), y.chunk(n_micro))) / n_micro
    ref_loss.backward()
    ref = {f"{i}.{k}": p.grad for i, layer in enumerate(full) for k, p in layer.named_parameters()}
    diffs = {}
    for schedule in SCHEDULES:
        pipe = Pipeline(toy, mesh, schedule, 1 if schedule in ("gpipe", "1f1b") else 2, n_micro, torch.device("cpu"))
        loss = pipe.forward_backward(x, y, loss_fn)
        per = len(toy.layers) // pipe.num_stages
        diff = abs(loss.item() - ref_loss.item())
        for sid, part in zip(pipe.stage_ids, pipe.parts):
            for name, p in part.named_parameters():
                i, rest = name.split(".", 1)
                diff = max(diff, (p.grad - ref[f"{sid * per + int(i)}.{rest}"]).abs().max().item())
        diffs[schedule] = diff
    return {"params": {}, "toy_diffs": diffs}


GROUPED_GEMM_OK: dict = {}  # luban's own predicate, kept across jobs in one process


def run_job(job: dict) -> dict:
    import torch.distributed.checkpoint as dcp

    if job.get("kind") == "toy_pipeline":
        return run_toy_pipeline(job)

    cfg = model_cfg(job)
    from luban.model import moe

    # "grouped": the experts through torch._grouped_mm (ATen's CPU fallback of the Hopper path)
    original = GROUPED_GEMM_OK.setdefault("luban", moe.grouped_gemm_ok)
    moe.grouped_gemm_ok = (lambda *args: True) if job.get("grouped") else original
    layout = ParallelLayout.from_dict(job.get("layout", {}))
    optim = OptimizerConfig(**{"name": "sgd", "weight_decay": 0.0, **job.get("optim", {})})
    gb = job.get("global_batch", 8)
    engine = build_engine(cfg, layout, optim, gb, seed=0, device=torch.device("cpu"))
    if job.get("init_scale"):  # fp16: a loss scale that overflows the first backward
        engine.scaler.scale = job["init_scale"]
    if job.get("load"):
        sd = engine.state_dict()
        dcp.load(sd, checkpoint_id=job["load"])
        engine.load_state_dict(sd)
    losses, norms = [], []
    per_dp = gb // layout.dp
    rows = slice(engine.dp_rank * per_dp, (engine.dp_rank + 1) * per_dp)
    for step in range(job.get("offset", 0), job.get("offset", 0) + job.get("steps", 2)):
        tokens, labels = batch(step, gb, cfg)
        losses.append(engine.forward_backward(tokens[rows], labels[rows]))
        norms.append(engine.step(LR, job.get("max_norm", MAX_NORM)))
    tokens, labels = batch(0, gb, cfg)
    eval_loss = engine.eval_loss(tokens[rows], labels[rows])
    moe_metrics = engine.moe_metrics()
    from luban.model.moe import moe_layers

    local_experts = [getattr(m.experts.w_up, "_local_tensor", m.experts.w_up).shape[0]
                     for _, m in moe_layers(engine.model_parts)]
    memory = engine.memory_report()
    if job.get("save"):
        dcp.save(engine.state_dict(), checkpoint_id=job["save"])
    agree = engine.any_rank(engine.rank == engine.world_size - 1) and not engine.any_rank(False)
    engine.barrier()
    return {"params": full_params(engine), "losses": losses, "norms": norms, "memory": memory, "any_rank": agree,
            "eval": eval_loss, "scale": engine.scaler.scale, "moe": moe_metrics,
            "local_experts": local_experts}


def main(jobs_file: str, out_dir: str, run=None) -> int:
    """Each rank: every job of ``jobs_file`` through ``run`` (default ``run_job``), its result saved
    per rank in ``out_dir``; the first job that raises ends the rank (exit 1)."""
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    for job in json.loads(Path(jobs_file).read_text()):
        try:
            result = (run or run_job)(job)
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
    code, output = bounded_launch([str(jobs_file), str(out_dir)], nproc, "tests.parallel.harness",
                                  log=out_dir / f"ranks-{nproc}.log")
    print(output[-20000:])  # pytest shows it when the test fails
    return code


def world(layout: dict) -> int:
    return layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)


def run_phases(jobs: dict[int, list[dict]], reshard: list[tuple[str, dict, dict, dict]], out: Path) -> dict:
    """Single-process savers, then one spawn per world size, then single-process loaders
    (every loader's checkpoint is written by an earlier phase). ``reshard`` rows are
    ``(name, save_layout, load_layout, common_job_keys)``."""
    jobs = {n: list(js) for n, js in jobs.items()}
    for name, save, load, common in reshard:
        ckpt = str(out / f"ckpt-{name}")
        jobs.setdefault(world(save), []).append({**common, "name": f"{name}-save", "layout": save, "save": ckpt})
        jobs.setdefault(world(load), []).append({**common, "name": f"{name}-load", "layout": load, "load": ckpt,
                                                 "offset": 2})
    singles = jobs.pop(1, [])
    single = {j["name"]: [run_job(j)] for j in singles if "save" in j}
    codes = {n: spawn(js, n, out) for n, js in sorted(jobs.items())}
    single.update({j["name"]: [run_job(j)] for j in singles if "load" in j})
    return {"out": out, "codes": codes, "single": single}


def spawned_results(spawned: tuple, name: str, nproc: int = 4) -> list[dict]:
    """Every rank's result of job ``name`` of a spawn (``(out_dir, exit code, output)``), failing with
    the ranks' output where a rank wrote none or raised."""
    out, code, output = spawned
    per_rank = []
    for r in range(nproc):
        path = Path(out) / f"{name}.rank{r}.pt"
        assert path.exists(), f"{name}: no result from rank {r} (exit {code})\n{output[-3000:]}"
        per_rank.append(torch.load(path, weights_only=False))
        assert "error" not in per_rank[-1], per_rank[-1]["error"]
    return per_rank


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
