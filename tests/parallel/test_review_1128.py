"""Mixed precision across layouts, review of 2026-11-28 (tiny, 2 gloo ranks, one spawn).

* fp16 under FSDP2 (zero >= 1 on dp·cp > 1) ran FSDP2's ``MixedPrecisionPolicy(param_dtype=fp16)``:
  the whole forward in fp16 (embeddings, residual stream, norms, and the norm and embedding
  gradients, sums over every token), where one process and DDP use autocast and keep those fp32.
  It overflowed where one process did not: at loss scale 2^20 one process trained (grad norm 2.7)
  and zero 1/2/3 on dp 2 and zero 1 on cp 2 skipped the step (norm nan, scale halved; the largest
  scale that trained on zero 2 was 2^18), and after one AdamW step zero 1/2/3 parted from one process
  by 2·lr on some weights (Adam's first step is lr·sign(g), and fp16 rounding flipped the sign of
  near-zero gradients). Now fp16 under FSDP2 gathers the fp32 weights and runs autocast
  (``precision.FSDP_PARAM_DTYPE``): one process's arithmetic, the same weights to fp32 rounding.
* bf16 + AdamW, weights ~5e-3 apart across layouts after a few steps at lr 1e-3: not a defect.
  Every layout keeps fp32 weights, gradients and optimizer state and reduces in fp32; the
  gradients of every layout are a few bf16 roundings (unit roundoff 2^-8) from fp32's. AdamW's
  first update is lr·sign(g) per element, so an element whose gradient is below the rounding noise
  (the attention key bias, whose exact gradient is 0: softmax ignores a per-query constant) moves
  by ±lr with the sign of the noise: 2·lr apart after one step, up to ~lr more per step after
  (docs/training.md, "Precision").
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from luban.parallel.engine import OptimizerConfig, build_engine, unwrap
from luban.parallel.layout import ParallelLayout
from luban.parallel.memory import local
from tests.child import launch as bounded_launch
from tests.parallel import harness
from tests.parallel.harness import LR, MAX_NORM, batch, full_params, max_diff, merged_params, model_cfg

ADAMW = {"name": "adamw", "weight_decay": 0.1}
BF16_ROUNDOFF = 2.0**-8  # unit roundoff of bf16 (8 significand bits)
OVERFLOW_SCALE = 2.0**20  # one process trains at this fp16 loss scale (tiny, micro_batch 1); the old FSDP2 fp16 did not
ZERO = {"zero1-dp2": {"dp": 2, "zero": 1}, "zero2-dp2": {"dp": 2, "zero": 2}, "zero3-dp2": {"dp": 2, "zero": 3}}
OVERFLOWS = {**ZERO, "zero1-cp2": {"cp": 2, "zero": 1}}
PRESETS = {**{name: "tiny" for name in ZERO}, "zero3-dp2-llama": "tiny-llama"}  # llama: RMSNorm, SwiGLU, rope
BF16 = {"dp2": {"dp": 2}, "zero2-dp2": {"dp": 2, "zero": 2}, "tp2": {"tp": 2}}


def job(name, layout, precision, steps=1, optim=None, preset="tiny", **extra):
    return {"name": name, "preset": preset, "layout": {**layout, "precision": precision}, "steps": steps,
            "optim": optim or {"name": "sgd", "weight_decay": 0.0}, **extra}


JOBS = ([job(f"adamw-fp16-{n}", ZERO[n.removesuffix("-llama")], "fp16", optim=ADAMW, preset=preset)
         for n, preset in PRESETS.items()]
        + [job(f"overflow-fp16-{n}", layout, "fp16", init_scale=OVERFLOW_SCALE) for n, layout in OVERFLOWS.items()]
        + [job(f"adamw-bf16-{n}", layout, "bf16", optim=ADAMW, grads=True) for n, layout in BF16.items()])


def run(job: dict) -> dict:
    """``harness.run_job``'s training, plus (``grads``) the full gradients of the first step before the
    optimizer, and the dtypes of every local weight, gradient and optimizer-state tensor."""
    cfg = model_cfg(job)
    layout = ParallelLayout.from_dict(job["layout"])
    gb = job.get("global_batch", 8)
    engine = build_engine(cfg, layout, OptimizerConfig(**job["optim"]), gb, seed=0, device=torch.device("cpu"))
    if job.get("init_scale"):
        engine.scaler.scale = job["init_scale"]
    per_dp = gb // layout.dp
    rows = slice(engine.dp_rank * per_dp, (engine.dp_rank + 1) * per_dp)
    grads, dtypes, norms = {}, set(), []
    for step in range(job["steps"]):
        tokens, labels = batch(step, gb, cfg)
        engine.forward_backward(tokens[rows], labels[rows])
        for part in engine.model_parts:
            for name, p in unwrap(part).named_parameters():
                dtypes |= {("weight", local(p).dtype), ("gradient", local(p.grad).dtype)}
                if job.get("grads") and step == 0:
                    grads[name] = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        norms.append(engine.step(LR, MAX_NORM))
    dtypes |= {(key, local(v).dtype) for opt in engine.optimizers for state in opt.state.values()
               for key, v in state.items() if torch.is_tensor(v) and key != "step"}
    result = {"params": full_params(engine), "grads": grads, "norms": norms, "scale": engine.scaler.scale,
              "dtypes": sorted((k, str(d)) for k, d in dtypes)}
    engine.barrier()
    return result


def main(jobs_file: str, out_dir: str) -> int:
    return harness.main(jobs_file, out_dir, run=run)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("precision-review")
    (out / "jobs.json").write_text(json.dumps(JOBS))
    code, output = bounded_launch([out / "jobs.json", out], 2, "tests.parallel.test_review_1128", timeout=300,
                                  log=out / "ranks.log")
    return out, code, output


def outcome(spawned, name):
    return harness.spawned_results(spawned, name, nproc=2)


def one_process(precision, **extra):
    return run(job("ref", {}, precision, **extra))


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(OVERFLOWS))
def test_fp16_fsdp2_overflows_where_one_process_does(spawned, name):
    """Loss scale 2^20: one process trains; FSDP2's fp16 residual stream and norms overflowed (nan,
    the step skipped, scale 2^19)."""
    per_rank = outcome(spawned, f"overflow-fp16-{name}")
    single = one_process("fp16", init_scale=OVERFLOW_SCALE)
    assert single["scale"] == OVERFLOW_SCALE and torch.isfinite(torch.tensor(single["norms"])).all()
    assert [r["scale"] for r in per_rank] == [OVERFLOW_SCALE] * 2, [r["norms"] for r in per_rank]
    assert per_rank[0]["norms"] == pytest.approx(single["norms"], rel=1e-4)  # cp: another attention arithmetic


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(PRESETS))
def test_fp16_fsdp2_computes_what_one_process_computes(spawned, name):
    """One AdamW step (lr 0.1): the weights of one process to fp32 rounding (before: 0.2 = 2·lr apart
    where fp16 rounding flipped a gradient's sign)."""
    per_rank = outcome(spawned, f"adamw-fp16-{name}")
    single = one_process("fp16", optim=ADAMW, preset=PRESETS[name])
    assert max_diff(merged_params(per_rank), single["params"]) < 1e-5  # 2e-6: fp32 rounding through AdamW's 1/|g|
    assert all(r["dtypes"] == single["dtypes"] for r in per_rank), [r["dtypes"] for r in per_rank]


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(BF16))
def test_bf16_adamw_layouts_part_only_by_rounding(spawned, name):
    """fp32 weights, gradients and AdamW moments on every layout; each parameter's gradient within a
    few bf16 roundings of fp32's (measured at most 1.4e-2 = 3.6·2^-8, FSDP2; one process 9.8e-3); after
    one step (lr 0.1) under 1% of the weights differ from one process's, by at most 2·lr (AdamW's
    first update is lr·sign(g): the sign of a gradient below the rounding noise is the noise's)."""
    per_rank = outcome(spawned, f"adamw-bf16-{name}")
    single, exact = one_process("bf16", optim=ADAMW, grads=True), one_process("fp32", optim=ADAMW, grads=True)
    fp32 = {"torch.float32"}
    assert {d for r in per_rank for _, d in r["dtypes"]} == fp32, [r["dtypes"] for r in per_rank]
    assert {k for r in per_rank for k, _ in r["dtypes"]} == {"weight", "gradient", "exp_avg", "exp_avg_sq"}
    grads = merged_params([{"params": r["grads"]} for r in per_rank])
    for key, ref in exact["grads"].items():
        if ref.norm() < 1e-6:  # attn.wk.bias: 0 in exact arithmetic (fp32: 1e-10), all noise
            continue
        for got in (grads[key], single["grads"][key]):
            assert (got - ref).norm() / ref.norm() < 6 * BF16_ROUNDOFF, key
    params = merged_params(per_rank)
    apart = sum(int(((params[k] - v).abs() > LR / 2).sum()) for k, v in single["params"].items())
    assert apart < 0.01 * sum(v.numel() for v in params.values())
    assert max_diff(params, single["params"]) <= 2 * LR * (1 + 1e-3)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
