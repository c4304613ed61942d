"""Review 2026-11-28 (b) of the day's runtime changes (host-sync loop, fp16 FSDP2 autocast, rope
table growth).

1. ``--parallel auto``'s plan check (``plan_vs_measured.json``) measured the median step time of the
   steps after the first three (compiling, allocator warm-up, the optimizer's first states), each
   step drained and timed. With the timing figures now means over the steps since the last logged
   one, a run of ``log_every`` >= its steps had one window, steps 1-N: the first steps' time
   (a compile: tens of seconds) was in every step's mean, so the measured step was that mean.
2. ``train.compile`` with ``recompute = "full"`` did not run (Dynamo refused the block's checkpoint).
3. ``train.compile`` with tp > 1 on a rope model failed in the first backward (the embedding's output reached a
   compiled block as a view of a DTensor's local tensor).
"""

from __future__ import annotations

import json
import math
import time
import types

import pytest
import torch

from luban.config import load_config
from luban.model.presets import get_preset
from luban.parallel.engine import Engine, OptimizerConfig, build_engine
from luban.parallel.layout import ParallelLayout
from luban.train import trainer as trainer_module
from luban.train.plan_check import MEMORY_KEYS
from luban.train.rundir import check_run_dir
from luban.train.trainer import Trainer


def test_plan_check_step_time_leaves_out_the_warm_up_steps_inside_a_log_window(tiny, tmp_path, monkeypatch):
    """A clock that advances 0.25 s per reading (a step reads it 4 times: 0.75 s) and 100 s more inside
    step 1 (a compile); log_every = steps = 10: one log window. The plan check measures the steps after
    the warm-up (0.75 s), not the window's mean with step 1 in it (10.75 s); the metrics record keeps
    the window's mean."""
    clock = {"now": 0.0}

    def perf_counter():
        clock["now"] += 0.25
        return clock["now"]

    forward_backward = Engine.forward_backward

    def slow_first(self, *args, **kwargs):
        if trainer.step == 0:
            clock["now"] += 100.0
        return forward_backward(self, *args, **kwargs)

    overrides = tiny(**{"train.steps": 10, "train.log_every": 10, "train.eval_every": 0})
    cfg = load_config(None, overrides)
    check_run_dir(cfg.run.dir, lock=False)  # as the launcher does before it writes plan.json
    (tmp_path / "run" / "plan.json").write_text(json.dumps({"step_time_s": 1.0, **{k: 1 for k in MEMORY_KEYS}}))
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(
        perf_counter=perf_counter, monotonic=time.monotonic, strftime=time.strftime))
    monkeypatch.setattr(Engine, "forward_backward", slow_first)
    trainer = Trainer(cfg)
    trainer.train()
    rows = json.loads((tmp_path / "run" / "plan_vs_measured.json").read_text())
    assert rows["step_time_s"]["measured"] == 0.75, rows["step_time_s"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["time_step_s"] for r in records if "time_step_s" in r] == [0.75 + 100.0 / 10]


@pytest.mark.slow
@pytest.mark.timeout(2400)  # Inductor compiles C++ kernels (tests/train/test_compile.py)
def test_compile_with_full_recompute_trains_as_eager():
    """``train.compile`` with ``recompute = "full"`` (docs: compile works with recompute) stopped at the
    first forward: each block passed torch's ``noop_context_fn`` as ``checkpoint``'s ``context_fn``, which
    Dynamo 2.13 takes for a user context it cannot trace ("checkpoint not implemented for
    LazyVariableTracker context_fn"). Full recompute now passes none; the loss and gradients are eager's."""
    cfg = get_preset("tiny").replace(layers=2, seq_len=32)
    layout = ParallelLayout(recompute="full")
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab, (4, 32), generator=g) for _ in range(2))
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        engine = build_engine(cfg, layout, OptimizerConfig(name="sgd", weight_decay=0.0), 4, seed=0,
                              device=torch.device("cpu"), compile=compiled)
        loss = engine.forward_backward(x, y)
        runs[compiled] = loss, {n: p.grad.detach().clone() for n, p in engine.model.named_parameters()}
        assert engine.compiled == compiled
    (eager_loss, eager_grads), (comp_loss, comp_grads) = runs[False], runs[True]
    assert math.isclose(comp_loss, eager_loss, rel_tol=1e-4)
    scale = max(value.abs().max().item() for value in eager_grads.values())
    for name, value in eager_grads.items():
        torch.testing.assert_close(comp_grads[name], value, rtol=1e-4, atol=1e-5 * scale, msg=name)


# ---- 3. compile + tensor parallel on a rope model (2 gloo ranks) ---------------------------------
TP_JOBS = [{"name": f"{mode}{sp}", "compile": mode == "compiled", "sp": bool(sp)}
           for sp in ("", "-sp") for mode in ("eager", "compiled")]


def run_tp(job: dict) -> dict:
    """One step of tiny-llama on tp 2 (``sp``: with sequence parallel): the loss and every full gradient."""
    cfg = get_preset("tiny-llama").replace(layers=2, seq_len=32)
    torch._dynamo.reset()
    engine = build_engine(cfg, ParallelLayout(tp=2, sp=job["sp"]), OptimizerConfig(name="sgd", weight_decay=0.0), 4,
                          seed=0, device=torch.device("cpu"), compile=job["compile"])
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab, (4, 32), generator=g) for _ in range(2))
    loss = engine.forward_backward(x, y)
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
             for n, p in engine.model.named_parameters()}
    engine.barrier()
    return {"loss": loss, "grads": grads, "compiled": engine.compiled}


def main(jobs_file: str, out_dir: str) -> int:
    from tests.parallel import harness

    return harness.main(jobs_file, out_dir, run=run_tp)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(2400)  # Inductor compiles C++ kernels on each rank
def test_compile_with_tensor_parallel_on_a_rope_model_trains_as_eager(tmp_path):
    """``train.compile`` with tp 2 on a rope model (tiny-llama) failed in the first backward:
    "'Tensor' object has no attribute '_local_tensor'" (the vocab-parallel embedding's output, a view of a
    DTensor's local tensor, went straight into a compiled block; GPT-2's position embedding is added first,
    so it did not); with sequence parallel too, in the first forward: "unhashable type: non-nested SymInt"
    (the second block's shorter input recompiled the block with symbolic sizes, which DTensor cannot
    hash). Now each compiled run's loss and gradients are its eager run's (to rounding)."""
    from tests.child import launch as bounded_launch
    from tests.parallel import harness

    (tmp_path / "jobs.json").write_text(json.dumps(TP_JOBS))
    spawned = (tmp_path, *bounded_launch([tmp_path / "jobs.json", tmp_path], 2, "tests.train.test_review_1128b",
                                         timeout=1200, log=tmp_path / "ranks.log"))
    for sp in ("", "-sp"):
        (eager, _), (compiled, _) = (harness.spawned_results(spawned, name + sp, nproc=2)
                                     for name in ("eager", "compiled"))
        assert compiled["compiled"] and not eager["compiled"]
        assert math.isclose(compiled["loss"], eager["loss"], rel_tol=1e-4), sp
        scale = max(value.abs().max().item() for value in eager["grads"].values())
        for name, value in eager["grads"].items():
            torch.testing.assert_close(compiled["grads"][name], value, rtol=1e-4, atol=1e-5 * scale, msg=name + sp)


if __name__ == "__main__":
    import sys

    sys.exit(main(*sys.argv[1:]))


def test_a_val_split_that_cannot_be_evaluated_is_refused_before_the_first_step(tmp_path):
    """A dataset built with ``--val-fraction 0`` trained ``eval_every`` steps, then died at its first
    evaluation with nothing saved (2026-11-28); it is refused at start-up, naming ``train.eval_every``."""
    from luban.data.build import build_dataset
    from luban.errors import LubanError

    (tmp_path / "text").mkdir()
    for i in range(8):
        (tmp_path / "text" / f"{i}.txt").write_text(f"document {i} " * 200)
    build_dataset([tmp_path / "text"], tmp_path / "ds", val_fraction=0.0)
    overrides = [f'data.path="{tmp_path / "ds"}"', 'model.preset="tiny"', "model.seq_len=32", "model.layers=1",
                 "train.steps=4", "train.global_batch=2", "train.eval_every=2", "train.checkpoint_every=0",
                 f'run.dir="{tmp_path / "run"}"', "run.tensorboard=false", 'run.progress="none"']
    with pytest.raises(LubanError, match=r"^train\.eval_every = 2: 0 for this dataset, whose validation split "
                                         r"cannot be read \(split = 'val': has 0 tokens"):
        Trainer(load_config(None, overrides)).train()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
