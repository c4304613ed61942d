"""MoE models under every parallel dimension, with and without expert parallel, train like
the single-process engine (SGD, 2 steps, clipping active, to 1e-5), and resume across ep.

tiny-moe: 3 layers (the first dense), 8 experts, top-2, one shared expert, sigmoid router
with auxiliary-loss-free balancing (its bias is compared too) and the Switch aux loss.
Under context parallel the aux loss counts the routing of the whole sequence, so it equals
the unsplit model's too.
"""

from __future__ import annotations

import pytest

from tests.parallel.harness import max_diff, merged_params, results, run_job, run_phases, world

TOL = 1e-5
MOE = {"layers": 3}
STRONG_AUX = {**MOE, "aux_loss_coef": 1.0}  # cp: a per-shard aux loss would be visible at 1e-5
CAPACITY = {**MOE, "capacity_factor": 1.0}  # GShard's fixed buffers through the all-to-all: drops tokens


def job(name, model=MOE, **layout):
    return {"name": name, "preset": "tiny-moe", "model": model, "layout": layout, "global_batch": 8}


MATRIX = {
    2: [job("moe-dp2", dp=2), job("moe-zero3-dp2", dp=2, zero=3), job("moe-tp2-sp", tp=2, sp=True),
        job("moe-pp2", pp=2, micro_batch=2), job("moe-cp2", STRONG_AUX, cp=2),
        job("dp2-ep2", dp=2, ep=2), {**job("dp2-ep2-grouped", dp=2, ep=2), "grouped": True},
        job("dp2-ep2-capacity", CAPACITY, dp=2, ep=2)],
    4: [job("dp4-ep2", dp=4, ep=2), job("dp4-ep4-zero1", dp=4, ep=4, zero=1), job("dp4-ep4-zero3", dp=4, ep=4, zero=3),
        job("dp4-ep2-zero3", dp=4, ep=2, zero=3), job("dp2-ep2-tp2-zero1", dp=2, ep=2, tp=2, zero=1),
        job("dp2-ep2-tp2-sp-zero1", dp=2, ep=2, tp=2, sp=True, zero=1),
        job("dp2-ep2-pp2", dp=2, ep=2, pp=2, micro_batch=2), job("cp2-dp2-ep4-zero1", STRONG_AUX, cp=2, dp=2, ep=4, zero=1)],
}

# resuming across ep changes: (name, save layout, load layout); SGD with momentum (state matters)
RESHARD = [("ep2-to-ep4", {"dp": 2, "ep": 2}, {"dp": 4, "ep": 4, "zero": 1}),
           ("ep4-to-none", {"dp": 4, "ep": 4, "zero": 3}, {}),
           ("none-to-ep2-pp2", {"micro_batch": 2}, {"dp": 2, "ep": 2, "pp": 2, "micro_batch": 2})]
MOMENTUM = {"name": "sgd", "momentum": 0.9}

REFS: dict = {}


def reference(spec, optim=None, steps=2):
    """The single-process run with the same micro-batches (the aux loss is per micro-batch)."""
    key = (str(spec["model"]), spec["layout"].get("micro_batch", 1), str(optim), steps)
    if key not in REFS:
        REFS[key] = run_job({"name": "ref", "preset": "tiny-moe", "model": spec["model"], "global_batch": 8,
                             "layout": {"micro_batch": key[1]}, "optim": optim or {}, "steps": steps})
    return REFS[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Single-process savers, the 2- and 4-rank spawns (each loader after its saver), single loaders."""
    out = tmp_path_factory.mktemp("moe")
    common = {"preset": "tiny-moe", "model": MOE, "global_batch": 8, "optim": MOMENTUM, "steps": 2}
    return run_phases(MATRIX, [(name, save, load, common) for name, save, load in RESHARD], out)


def outcome(runs, name, nproc):
    return runs["single"][name] if nproc == 1 else results(name, nproc, runs["out"])


@pytest.mark.multirank
@pytest.mark.parametrize("nproc,spec", [(n, j) for n, js in MATRIX.items() for j in js],
                         ids=lambda x: x if isinstance(x, int) else x["name"])
def test_moe_layout_matches_single_process(runs, nproc, spec):
    per_rank = outcome(runs, spec["name"], nproc)
    ref = reference(spec)
    params = merged_params(per_rank)
    assert set(params) == set(ref["params"])
    assert max_diff(params, ref["params"]) < TOL
    assert per_rank[0]["losses"] == pytest.approx(ref["losses"], abs=TOL)
    assert per_rank[0]["norms"] == pytest.approx(ref["norms"], rel=TOL)
    bias = [k for k in params if k.endswith("expert_bias")]
    assert bias and all(params[k].abs().sum() > 0 for k in bias)  # balancing ran, identically
    ep = spec["layout"].get("ep", 1)
    if ep > 1:
        assert all(n == 8 // ep for r in per_rank for n in r["local_experts"])  # each rank holds experts/ep
    assert all(r["moe"]["moe_tokens_per_expert"] == ref["moe"]["moe_tokens_per_expert"]  # global batch, all stages
               for r in per_rank)

@pytest.mark.multirank
@pytest.mark.parametrize("name,save,load", RESHARD, ids=[r[0] for r in RESHARD])
def test_resume_across_ep_changes(runs, name, save, load):
    """2 steps under one ep, 2 more after loading the checkpoint under another = 4 straight steps."""
    saved = outcome(runs, f"{name}-save", world(save))
    loaded = outcome(runs, f"{name}-load", world(load))
    ref = reference({"model": MOE, "layout": {"micro_batch": load.get("micro_batch", 1)}}, MOMENTUM, steps=4)
    assert saved[0]["losses"] == pytest.approx(ref["losses"][:2], abs=TOL)
    assert loaded[0]["losses"] == pytest.approx(ref["losses"][2:], abs=TOL)
    assert max_diff(merged_params(loaded), ref["params"]) < TOL


@pytest.mark.parametrize("layout, message", [
    ({"dp": 2, "ep": 4}, "parallel.ep = 4: must divide dp*cp = 2"),
    ({"dp": 4, "ep": 3}, "parallel.ep = 3: must divide dp*cp = 4"),
    ({"dp": 2, "zero": 1, "ep": 2, "offload": "optimizer"}, "parallel.offload = 'optimizer': not with ep = 2"),
])
def test_ep_key_rules(layout, message):
    from luban.errors import LubanError
    from luban.parallel.layout import ParallelLayout

    with pytest.raises(LubanError, match=message.replace("*", r"\*")):
        ParallelLayout.from_dict(layout)


@pytest.mark.parametrize("model, message", [
    ({}, "parallel.ep = 2: must divide experts = 0 (a dense model has none)"),
    ({"experts": 6, "experts_per_token": 2}, "parallel.ep = 4: must divide experts = 6"),
])
def test_ep_model_rules(model, message):
    from luban.errors import LubanError
    from luban.model import get_preset
    from luban.parallel.layout import ParallelLayout, check_layout

    cfg = get_preset("tiny-llama").replace(**model)
    ep = 2 if not model else 4
    with pytest.raises(LubanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_layout(ParallelLayout.from_dict({"dp": 4, "ep": ep}), cfg, 8, world_size=4)
