"""Resume matrix, second review of 2026-11-27: save on one layout, resume on another, compare with
an uninterrupted run (same layout: bitwise; another layout: to rounding).

* fp16: the loss scale meant another thing on every layout. Each rank backpropagated its own mean
  loss times ``scale``, so the gradient of a token's loss was dp·cp times larger than in one process,
  and a pipeline, which backpropagates each micro-batch's loss whole and divides the sum after,
  another n micro-batches times larger: pp 2 x dp 2 overflowed at 8x smaller a scale than one process.
  A checkpoint's scale, right where it was written, overflowed where it was resumed: a run saved by
  one process at scale 2^20 (no overflow there in 4 steps: SGD, tiny) and resumed on pp 2 x dp 2 or
  on dp 4 skipped both steps after the resume (scale 2^18 at the end), and the same run straight
  through on pp 2 x dp 2 skipped three of its four steps.
  Now the backward multiplies each micro-batch's loss by ``LossScaler.backward_scale`` (the scale
  over dp·cp, and over the micro-batches whose sum a pipeline divides after), the factor one process
  uses per token, and ``Engine.step`` divides that out: every layout overflows where one process does
  (fp16 under FSDP2, zero >= 1 on dp·cp > 1, also runs autocast since 2026-11-28:
  tests/parallel/test_review_1128.py).
* a checkpoint of an optimizer that had not stepped yet (fp16: every step so far overflowed, then a
  suspension or ``checkpoint_every`` saved) changed the run: torch's ``get_optimizer_state_dict``
  makes the missing states with a step on zero gradients at lr 0, which counts (AdamW: step 1, its
  bias correction one step ahead ever after) and decays (SGD: momentum buffer = weight_decay *
  weight). The run that saved, and any run resumed from it, parted from the same run straight
  through (tiny, fp16, first step skipped: 1.9e-3 after two more AdamW steps, 1.7e-4 SGD), on the
  device and with ``offload = "optimizer"`` alike. Now ``init_state`` gives such an optimizer the
  state its first step starts from (step 0, zero moments or buffer) before the state dict is built.
* a change of ``precision`` on resume (a ``[parallel]`` key, which a resume may change): an fp16
  checkpoint resumed as bf16 or fp32 loaded its loss scale into the disabled scaler, and the backward
  multiplied every gradient by it, never divided out (``luban train``: grad norm 162569 instead of
  2.48 after the resume; clipping hid it from the weights only while it clipped anyway); an fp32 or
  bf16 checkpoint resumed as fp16 loaded the disabled scaler's 1.0 as its loss scale (fp16 gradients
  underflow, and the scale doubles only every 2000 good steps). Now a disabled scaler loads nothing
  and a checkpoint not written under fp16 leaves the fp16 scaler at its initial scale.

Checked and found bitwise on the same layout (``luban train`` suspended by SIGUSR1 and resumed, 4
ranks, ``test_suspend_and_resume_is_bitwise_where_the_layout_test_did_not_look``): hybrid sharding,
fp16 with the offloaded optimizer under dualpipev (tied embeddings), the zero-bubble split backward
with full recompute, bf16 with ``offload = "params"``; the families of ``test_resume_layouts``
cover the rest.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp

from luban.config import load_config
from luban.parallel.engine import OptimizerConfig, build_engine
from luban.parallel.layout import ParallelLayout
from luban.train.trainer import Trainer
from tests.child import launch as bounded_launch
from tests.parallel import harness
from tests.parallel.harness import batch, full_params, max_diff, merged_params, model_cfg, run_job
from tests.train import test_resume_layouts as layouts

MOMENTUM = {"name": "sgd", "momentum": 0.9}
FP16 = {"preset": "tiny", "optim": MOMENTUM, "global_batch": 8, "init_scale": 2.0**20}
LOADS = {"pp2-dp2": {"pp": 2, "dp": 2, "precision": "fp16"}, "dp4": {"dp": 4, "precision": "fp16"}}
TOL = 3e-4  # a few fp16 roundings of a 4-step SGD run (lr 0.1), other layout than the reference


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """One process saves after 2 steps; one spawn of 4 ranks resumes it on each layout of LOADS and
    trains pp 2 x dp 2 straight through."""
    out = tmp_path_factory.mktemp("review-b")
    ckpt = str(out / "ckpt-fp16")
    run_job({**FP16, "name": "fp16-save", "layout": {"precision": "fp16"}, "steps": 2, "save": ckpt})
    jobs = [{**FP16, "name": f"fp16-to-{name}", "layout": layout, "steps": 2, "load": ckpt, "offset": 2}
            for name, layout in LOADS.items()]
    jobs.append({**FP16, "name": "fp16-pp2-dp2-straight", "layout": LOADS["pp2-dp2"], "steps": 4})
    (out / "jobs.json").write_text(json.dumps(jobs))
    code, output = bounded_launch([out / "jobs.json", out], 4, "tests.parallel.harness", timeout=300,
                                  log=out / "ranks.log")
    return out, code, output


outcome = harness.spawned_results  # every rank's result of one job of the spawn


@pytest.mark.multirank
@pytest.mark.parametrize("name", [f"fp16-to-{n}" for n in LOADS] + ["fp16-pp2-dp2-straight"])
def test_fp16_loss_scale_overflows_where_one_process_does_on_every_layout(spawned, name):
    ref = run_job({**FP16, "name": "ref", "layout": {"precision": "fp16"}, "steps": 4})
    assert ref["scale"] == FP16["init_scale"]  # one process: no step skipped
    per_rank = outcome(spawned, name)
    assert [r["scale"] for r in per_rank] == [ref["scale"]] * 4, "a step was skipped that one process took"
    assert per_rank[0]["losses"] == pytest.approx(ref["losses"][-len(per_rank[0]["losses"]):], abs=1e-3)
    assert max_diff(merged_params(per_rank), ref["params"]) < TOL


def _steps(engine, cfg, steps) -> None:
    for step in steps:
        tokens, labels = batch(step, 8, cfg)
        engine.forward_backward(tokens, labels)
        engine.step(1e-3, 1.0)


@pytest.mark.parametrize("optim", [{"name": "adamw"}, {"name": "sgd", "momentum": 0.9, "weight_decay": 0.1}],
                         ids=["adamw", "sgd-momentum-decay"])
@pytest.mark.parametrize("layout", [{}, {"zero": 1, "offload": "optimizer"}], ids=["device", "offload-optimizer"])
def test_a_checkpoint_before_the_optimizers_first_step_changes_nothing(tmp_path, optim, layout):
    """fp16, one process: the first step overflows (skipped), a checkpoint is saved, the run resumes
    from it; it must end bitwise where the run that did not save ends, and so must the one that
    saved and trained on without resuming."""
    cfg = model_cfg({"preset": "tiny"})

    def engine():
        return build_engine(cfg, ParallelLayout(**layout, precision="fp16"), OptimizerConfig(**optim), 8, seed=0,
                            device=torch.device("cpu"))

    def run(save: str | None, resume: bool):
        e = engine()
        e.scaler.scale = 2.0**40  # overflows: step 1 is skipped, the optimizer has no state yet
        _steps(e, cfg, [0])
        assert not e.optimizers[0].state
        e.scaler.scale = 2.0**10
        if save:
            dcp.save(e.state_dict(), checkpoint_id=save)
        if resume:
            e = engine()
            state = e.state_dict()
            dcp.load(state, checkpoint_id=save)
            e.load_state_dict(state)
        _steps(e, cfg, [1, 2])
        return full_params(e)

    straight = run(None, False)
    for name, resume in (("saved", False), ("resumed", True)):
        other = run(str(tmp_path / name), resume)
        assert all(torch.equal(straight[k], other[k]) for k in straight), \
            (name, max((straight[k] - other[k]).abs().max().item() for k in straight))


TRAIN_CASES = {  # luban train, 4 ranks, global batch 8, suspended after step 2 of 4 (test_resume_layouts)
    "hybrid-2x2-zero3": {**layouts.LLAMA, **layouts._layout(dp=4, dp_replicate=2, zero=3)},
    "dualpipev-fp16-offload-optimizer": {"model.preset": '"tiny"', "model.layers": 4, **layouts._layout(
        pp=2, dp=2, zero=1, schedule="dualpipev", virtual_stages=2, offload="optimizer", precision="fp16")},
    "zero-bubble-full-recompute": {**layouts.LLAMA, "model.layers": 4, **layouts._layout(
        pp=2, dp=2, zero=1, schedule="zero-bubble", virtual_stages=2, recompute="full")},
    "bf16-offload-params": {**layouts.LLAMA, **layouts._layout(dp=4, zero=3, offload="params", precision="bf16")},
}


@pytest.mark.multirank
def test_suspend_and_resume_is_bitwise_where_the_layout_test_did_not_look(small_dataset, tmp_path, monkeypatch):
    cases = [{"name": name, "straight": layouts._overrides(small_dataset, tmp_path / name / "straight", keys),
              "split": layouts._overrides(small_dataset, tmp_path / name / "split", keys), "stop_at": layouts.STOP}
             for name, keys in TRAIN_CASES.items()]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LUBAN_PEAK_FLOPS", "1e12")  # no peak measurement: not what this test is about
    code, output = bounded_launch([tmp_path / "cases.json"], 4, "tests.train.resume_ranks", timeout=300,
                                  log=tmp_path / "ranks.log")
    report = {name: layouts._differences(tmp_path / name / "straight", tmp_path / name / "split")
              for name in TRAIN_CASES if (tmp_path / name / "split").exists()}
    assert code == 0 and len(report) == len(TRAIN_CASES), (code, report, output[-3000:])
    bad = {name: diffs for name, diffs in report.items() if diffs}
    assert not bad, "\n".join(f"{name}: {'; '.join(d)}" for name, d in bad.items())


def _resumed_scale(overrides: list[str]) -> float:
    trainer = Trainer(load_config(None, overrides))
    trainer.resume("auto")
    return trainer.engine.scaler.scale


def test_a_change_of_precision_on_resume_keeps_the_loss_scale_where_it_belongs(tiny, tmp_path):
    """fp32 -> fp16: the fp16 scaler loaded the disabled scaler's scale 1 (gradients underflow; it
    doubles only every 2000 good steps); fp16 -> bf16: the disabled scaler loaded 2^16 and the backward
    multiplied every gradient by it, never divided out (grad norm 2^16 times too large)."""
    Trainer(load_config(None, tiny("fp32", **{"train.steps": 2}))).train()
    assert _resumed_scale(tiny("fp32", **{"train.steps": 4, "parallel.precision": '"fp16"'})) == 2.0**16
    Trainer(load_config(None, tiny("fp16", **{"train.steps": 2, "parallel.precision": '"fp16"'}))).train()
    bf16 = tiny("fp16", **{"train.steps": 3, "parallel.precision": '"bf16"'})
    assert _resumed_scale(bf16) == 1.0
    Trainer(load_config(None, bf16)).train("auto")
    norms = [r["grad_norm"] for line in (tmp_path / "fp16" / "metrics.jsonl").open()
             if "grad_norm" in (r := json.loads(line))]
    assert len(norms) == 3 and norms[2] < 100 * max(n for n in norms[:2] if math.isfinite(n)), norms
