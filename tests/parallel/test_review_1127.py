"""Layouts that were accepted and then crashed, computed something else than one process, or
ignored what they asked for (review of luban.parallel, 2026-11-27).

* hybrid sharding with cp > 1 and cp before dp in ``mesh_order`` (``cp,dp,pp,tp``): accepted, then
  every rank died in ``LayoutMesh`` with torch's ``KeyError: Invalid mesh_dim_names
  ('dp_replicate', 'dp_shard_cp') ... ascending order``; now refused by ``check_keys``;
* a MoE ``capacity_factor`` under context parallel: each cp rank cut its own half of the
  sequence at a per-shard capacity, so other tokens were dropped than in one process (loss 7.6e-4
  off after 2 steps on tiny-moe); now refused by ``check_layout``;
* a vocabulary that leaves a tensor-parallel rank no rows (vocab 9 on tp 4 is cut 3,3,3,0):
  accepted, then torch's vocab-parallel loss failed on that rank (``index 0 is out of bounds``)
  and its peers lost their connection; now refused;
* ``seq_len`` not divisible by tp under sequence parallel was refused as ``parallel.cp = 1 ...
  nearest: []``; now it names ``parallel.sp`` and the tp values that work;
* evaluation without a pipeline ran this rank's whole share of the batch in one forward: the
  logits and activations of all its micro-batches at once, and, with a MoE capacity, another
  capacity cut than training and than other layouts (dp 2: eval loss 5.42855, one process
  5.42825, pp 2: 5.42832); now the same micro-batches as training (``MicroBatchLoop.evaluate``);
* ``offload = "params"`` (zero 3) with dp·cp = 1 but several ranks (tp or pp alone): FSDP2 was
  not applied, so the parameters stayed on the device although the planner and the memory
  check counted them on the host; now FSDP2 wraps the parts over the one-rank data-parallel mesh;
* resuming into dualpipev with tied embeddings (any GPT-2 preset), even on the same layout: rank 0
  holds the embedding's stage and the tied head's copy, both optimizers loaded the checkpoint's
  one state tensor and kept it, so the two copies' momentum / Adam moments were one tensor updated
  twice a step (``luban train`` resumed at step 2 of tiny: step 4 loss 4.6704 instead of 4.6741);
  now each copy loads its own (``TiedEmbedding.load_names``);
* ``offload = "params"`` in one process (zero 3): no FSDP2 either, silently; now a one-process group;
* qk-norm (Qwen3's per-head RMSNorm) under tensor parallel: its weight was a plain parameter on
  every tp rank, each rank's gradient covered only its own heads and was never summed over tp, so
  the tp ranks' copies parted (1.3e-4 after 2 steps on tiny-llama, tp 2) and the global gradient
  norm was off (2.461906 instead of 2.461914); now the weight is replicated over tp as a DTensor
  with its input sharded on the head dimension (``apply_tensor_parallel``), like the norms under sp;
* ``build_engine`` checked the sequence rules against ``model.seq_len``, not the length trained
  on (``[data] seq_len``): it takes ``seq_len`` now (the trainer has to pass it).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from luban.errors import LubanError
from luban.model.presets import get_preset
from luban.parallel.layout import ParallelLayout, check_layout
from tests.child import launch as bounded_launch
from tests.parallel import harness
from tests.parallel.harness import LR, MAX_NORM, batch, full_params, max_diff, merged_params, model_cfg, run_job

TOL = 1e-5
CAPACITY = {"layers": 3, "capacity_factor": 1.0}  # tiny-moe with a GShard capacity: drops tokens


def job(name, preset="tiny", model=None, **layout):
    return {"name": name, "preset": preset, "model": model or {}, "layout": layout, "global_batch": 8}


JOBS = [  # 4 ranks, one spawn
    job("moe-capacity-dp4", "tiny-moe", CAPACITY, dp=4),
    job("moe-capacity-pp2-dp2", "tiny-moe", CAPACITY, pp=2, dp=2, zero=1),
    job("pp2-tp2-zero3-offload-params", pp=2, tp=2, zero=3, offload="params"),
    {**job("cp4-data-seq-32-model-seq-130", "tiny-llama", cp=4), "seq": 130, "data_seq": 32},
    job("qk-norm-tp2-sp-dp2-zero3", "tiny-llama", {"qk_norm": True}, tp=2, sp=True, dp=2, zero=3),
]


MOMENTUM = {"name": "sgd", "momentum": 0.9}
DUALPIPEV = {"pp": 2, "dp": 2, "zero": 1, "schedule": "dualpipev", "virtual_stages": 2}  # tiny: tied embeddings
RESUMES = [  # (name, save layout or None for one process, load layout): 2 steps, save, 2 more after loading
    ("single-to-dualpipev", None, DUALPIPEV),
    ("dualpipev-to-dualpipev", DUALPIPEV, DUALPIPEV),
]


def resume_jobs(out: Path) -> tuple[list[dict], list[dict]]:
    """(single-process savers, 4-rank jobs in order: each saver before its loader)."""
    singles, spawned = [], []
    for name, save, load in RESUMES:
        common = {"preset": "tiny", "optim": MOMENTUM, "steps": 2, "global_batch": 8}
        saver = {**common, "name": f"{name}-save", "layout": save or {}, "save": str(out / f"ckpt-{name}")}
        (singles if save is None else spawned).append(saver)
        spawned.append({**common, "name": f"{name}-load", "layout": load, "load": saver["save"], "offset": 2})
    return singles, spawned


def run(job: dict) -> dict:
    """``harness.run_job``'s training (2 SGD steps, clipping active, then an eval), plus whether
    FSDP2 wraps each model part, on sequences of ``data_seq`` tokens if given (the model's
    ``seq_len`` may be longer, as ``[data] seq_len`` allows)."""
    from torch.distributed.fsdp import FSDPModule

    from luban.parallel.engine import OptimizerConfig, build_engine

    if "save" in job or "load" in job:
        return run_job(job)
    cfg = model_cfg(job)
    seq = job.get("data_seq", cfg.seq_len)
    layout = ParallelLayout.from_dict(job["layout"])
    gb = job["global_batch"]
    engine = build_engine(cfg, layout, OptimizerConfig(name="sgd", weight_decay=0.0), gb, seed=0,
                          device=torch.device("cpu"), seq_len=seq)
    per_dp = gb // layout.dp
    rows = slice(engine.dp_rank * per_dp, (engine.dp_rank + 1) * per_dp)
    data = cfg.replace(seq_len=seq)
    losses, norms = [], []
    for step in range(2):
        tokens, labels = batch(step, gb, data)
        losses.append(engine.forward_backward(tokens[rows], labels[rows]))
        norms.append(engine.step(LR, MAX_NORM))
    tokens, labels = batch(0, gb, data)
    result = {"losses": losses, "norms": norms, "eval": engine.eval_loss(tokens[rows], labels[rows]),
              "fsdp": [isinstance(p, FSDPModule) for p in engine.model_parts], "params": full_params(engine)}
    engine.barrier()
    return result


def main(jobs_file: str, out_dir: str) -> int:
    return harness.main(jobs_file, out_dir, run=run)


def reference(spec: dict) -> dict:
    """One process, the same micro-batches (a MoE capacity cuts per micro-batch), the same data."""
    return run_job({"name": "ref", "preset": spec["preset"], "model": spec["model"], "seq": spec.get("data_seq", 32),
                    "global_batch": spec["global_batch"],                    "layout": {"micro_batch": spec["layout"].get("micro_batch", 1)}})


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("review")
    singles, resumes = resume_jobs(out)
    for saver in singles:
        run_job(saver)
    (out / "jobs.json").write_text(json.dumps(JOBS + resumes))
    code, output = bounded_launch([out / "jobs.json", out], 4, "tests.parallel.test_review_1127", timeout=300,
                                  log=out / "ranks.log")
    return out, code, output


outcome = harness.spawned_results  # every rank's result of one job of the spawn


@pytest.mark.multirank
@pytest.mark.parametrize("spec", JOBS, ids=[j["name"] for j in JOBS])
def test_layout_trains_and_evaluates_like_one_process(spawned, spec):
    per_rank = outcome(spawned, spec["name"])
    ref = reference(spec)
    assert max_diff(merged_params(per_rank), ref["params"]) < TOL
    assert per_rank[0]["losses"] == pytest.approx(ref["losses"], abs=TOL)
    assert per_rank[0]["norms"] == pytest.approx(ref["norms"], abs=TOL)
    assert all(r["eval"] == pytest.approx(ref["eval"], abs=TOL) for r in per_rank), [r["eval"] for r in per_rank]


@pytest.mark.multirank
@pytest.mark.parametrize("name", [r[0] for r in RESUMES])
def test_resume_into_a_v_schedule_with_tied_embeddings_continues_the_run(spawned, name):
    """dualpipev holds the embedding's stage and the last stage (the tied head's copy) on rank 0: both
    optimizers loaded the checkpoint's one state tensor and updated it twice a step (SGD momentum:
    1e-3 off two steps after the resume; AdamW: loss 9.27 instead of 8.77)."""
    loaded = outcome(spawned, f"{name}-load")
    ref = run_job({"name": "ref", "preset": "tiny", "optim": MOMENTUM, "steps": 4, "global_batch": 8})
    assert loaded[0]["losses"] == pytest.approx(ref["losses"][2:], abs=TOL)
    assert max_diff(merged_params(loaded), ref["params"]) < TOL


@pytest.mark.multirank
def test_params_offload_wraps_every_part_in_fsdp_without_data_parallel(spawned):
    """pp 2 x tp 2, zero 3, offload = params: FSDP2 (and its CPUOffloadPolicy) on every stage."""
    assert all(all(r["fsdp"]) for r in outcome(spawned, "pp2-tp2-zero3-offload-params"))


ONE_PROCESS_OFFLOAD = """
import torch
from torch.distributed.fsdp import FSDPModule
import luban.parallel.engine as engine
from tests.parallel.harness import max_diff, run_job

parts = []
build = engine.build_engine
engine.build_engine = lambda *a, **k: (e := build(*a, **k), parts.extend(e.model_parts))[0]
import tests.parallel.harness as harness
harness.build_engine = engine.build_engine
ref = run_job({"name": "ref", "preset": "tiny", "layout": {}})
parts.clear()
off = run_job({"name": "off", "preset": "tiny", "layout": {"zero": 3, "offload": "params"}})
assert parts and all(isinstance(p, FSDPModule) for p in parts), parts
assert max_diff(off["params"], ref["params"]) < 1e-6 and off["losses"] == ref["losses"], (off["losses"], ref["losses"])
print("OFFLOADED")
"""


def test_params_offload_in_one_process_is_fsdp2():
    """One process, zero 3, offload = params: FSDP2 wraps the model over a one-process group (it
    ran unwrapped, the parameters on the device) and trains like the plain engine. In a child:
    the process group outlives the engine."""
    from tests.child import run as run_child

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    output = run_child([sys.executable, "-c", ONE_PROCESS_OFFLOAD], timeout=120, env=env,
                       cwd=Path(__file__).resolve().parents[2])
    assert "OFFLOADED" in output, output[-3000:]


CFG = get_preset("tiny").replace(seq_len=32)


def refusal(model=CFG, global_batch=8, **layout) -> str:
    with pytest.raises(LubanError) as err:
        check_layout(ParallelLayout(**layout), model, global_batch)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_hybrid_sharding_with_context_parallel_needs_dp_before_cp():
    hybrid = dict(dp=2, dp_replicate=2, zero=2, cp=2)
    assert refusal(**hybrid, mesh_order="cp,dp,pp,tp").startswith("parallel.mesh_order = 'cp,dp,pp,tp': hybrid")
    assert refusal(**hybrid, mesh_order="tp,cp,pp,dp").startswith("parallel.mesh_order")
    for order in ("pp,dp,cp,tp", "tp,dp,cp,pp", "dp,tp,pp,cp"):
        check_layout(ParallelLayout(**hybrid, mesh_order=order), CFG, 8)
    check_layout(ParallelLayout(dp=4, dp_replicate=2, zero=2, mesh_order="cp,dp,pp,tp"), CFG, 8)  # cp = 1


def test_moe_capacity_with_context_parallel_is_refused():
    moe = get_preset("tiny-moe").replace(seq_len=32, capacity_factor=1.0)
    assert refusal(moe, cp=2).startswith("model.capacity_factor = 1.0: not with cp = 2")
    check_layout(ParallelLayout(cp=2), moe.replace(capacity_factor=0.0), 8)  # dropless
    check_layout(ParallelLayout(dp=2, ep=2), moe, 8)  # dp, ep, tp and pp cut no sequence


def test_vocabulary_must_reach_every_tensor_parallel_rank():
    assert refusal(CFG.replace(vocab=9), tp=4) == (
        "parallel.tp = 4: vocab = 9 leaves a tensor-parallel rank no vocabulary rows (shards of 3); nearest: [1, 2]")
    refusal(CFG.replace(vocab=1), tp=2)
    check_layout(ParallelLayout(tp=4), CFG.replace(vocab=10), 8)  # 3, 3, 3, 1
    check_layout(ParallelLayout(tp=4), CFG, 8)  # 257: 65, 65, 65, 62


def test_sequence_parallel_refusal_names_sp_and_the_tp_that_works():
    assert refusal(CFG.replace(seq_len=33), tp=2, sp=True) == (
        "parallel.sp = True: seq_len = 33 must split into 2 equal sequence shards (tp); set sp = false")
    assert refusal(CFG.replace(seq_len=6), tp=4, sp=True).endswith("set sp = false, or tp in [2]")
    check_layout(ParallelLayout(tp=2), CFG.replace(seq_len=33), 8)  # tp without sp cuts no sequence


def test_engine_checks_the_sequences_it_trains_on():
    """``build_engine(seq_len=...)``: the rules apply to ``[data] seq_len``, not to a longer model's
    (multi-rank: the cp 4 job above, model seq_len 130 with 32-token sequences)."""
    with pytest.raises(LubanError, match="seq_len = 130"):
        check_layout(ParallelLayout(cp=4), get_preset("tiny-llama").replace(seq_len=130), 8)
    check_layout(ParallelLayout(cp=4), get_preset("tiny-llama").replace(seq_len=130), 8, seq_len=32)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
