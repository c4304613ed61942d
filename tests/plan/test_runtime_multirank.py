"""runtime="luban" predictions against luban's distributed engine on 2 gloo ranks.

Each job trains one AdamW step under a layout (ZeRO, TP, TP+SP, PP, CP, optimizer offload); every
rank reports its bytes of parameters, gradients and optimizer state on the device and on the host
(storages of its local shards) and the
activations autograd saved per micro-batch. The planner's per-pipeline-rank figures must match
within 2% (model states) and 10% (activations). The ranks run ``tests/plan/plan_rank_job.py``.

The vocabulary is 256 (even): with an odd one DTensor shards unevenly and the measured LM-head
gradient is a view whose storage is the whole padded buffer, which storage counting cannot
split. Pipeline activations are compared per micro-batch too: the engine's counter keeps what
it counted alive while it records, so addresses freed by one micro-batch's backward and reused by
a later forward are not merged. With ``offload = "activations"`` the planner puts two layers of
one micro-batch on the device (computing + in transfer) and every in-flight micro-batch in the
tier; the engine measures nothing saved on the device (but selective recompute's cache of GEMM
and attention outputs, which the planner keeps on the device: ``activation_resident``) and the
bytes it copied to the host.
"""

import json

import numpy as np
import pytest

from luban.model.presets import get_preset
from luban.parallel.layout import ParallelLayout
from luban.plan.grid import Grid
from luban.plan.memory import memory
from luban.plan.problem import Problem
from luban.plan.system import load_system
from tests.child import launch

GLOBAL_BATCH = 4
VOCAB = 256
SEQ = 32
LAYOUTS = {
    "zero0-dp2": dict(dp=2), "zero1-dp2": dict(dp=2, zero=1), "zero2-dp2": dict(dp=2, zero=2),
    "zero3-dp2": dict(dp=2, zero=3), "tp2": dict(tp=2), "tp2-sp": dict(tp=2, sp=True),
    "pp2": dict(pp=2, micro_batch=1), "cp2": dict(cp=2), "zero2-dp2-offload-optimizer": dict(dp=2, zero=2, offload="optimizer"),
    "zero1-dp2-offload-activations": dict(dp=2, zero=1, offload="activations"),
    "pp2-offload-activations": dict(pp=2, micro_batch=1, offload="activations"),
}
# selective recompute (op-level SAC: GEMM, attention and collective outputs saved; under cp the
# ring attention core recomputed) on the layouts that change what it saves
SELECTIVE = {f"{name}-selective": dict(LAYOUTS[name], recompute="selective")
             for name in ("zero0-dp2", "zero3-dp2", "tp2", "tp2-sp", "pp2", "cp2", "zero1-dp2-offload-activations")}
LAYOUTS.update(SELECTIVE)
MOE_LAYOUTS = {"moe-zero1-dp2": dict(dp=2, zero=1), "moe-zero1-dp2-ep2": dict(dp=2, zero=1, ep=2),
               "moe-zero3-dp2-ep2": dict(dp=2, zero=3, ep=2), "moe-dp2-ep2": dict(dp=2, ep=2),
               "moe-dp2-ep2-selective": dict(dp=2, ep=2, recompute="selective")}
LAYOUTS.update(MOE_LAYOUTS)
# the Llama shape under every layout; the GPT-2 shape (LayerNorm, GELU, tied head) where it differs; the
# MoE shape (routed experts split by ep, replicated over expert data parallel) with and without ep
CASES = ([(name, "tiny-llama") for name in LAYOUTS if name not in MOE_LAYOUTS]
         + [(name, "tiny") for name in ("zero3-dp2", "tp2-sp", "pp2", "cp2", "tp2-sp-selective")]
         + [(name, "tiny-moe") for name in MOE_LAYOUTS])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan-multirank")
    jobs = [{"name": f"{name}-{preset}", "preset": preset, "layout": layout, "global_batch": GLOBAL_BATCH,
             "vocab": VOCAB, "seq": SEQ} for name, preset in CASES for layout in [LAYOUTS[name]]]
    (out / "jobs.json").write_text(json.dumps(jobs))
    code, output = launch([out / "jobs.json", out], 2, "tests.plan.plan_rank_job", log=out / "ranks.log")
    assert code == 0, output[-3000:]
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("name,preset", CASES)
def test_per_rank_memory_matches_engine(runs, name, preset):
    layout = ParallelLayout(**LAYOUTS[name])
    cfg = get_preset(preset).replace(seq_len=SEQ, vocab=VOCAB)
    problem = Problem(cfg, load_system("dgx-a100-80g"), 2, cfg.seq_len, GLOBAL_BATCH, runtime="luban")
    with np.errstate(all="ignore"):
        mem = memory(problem, Grid.from_layout(layout))
    for rank in range(2):
        measured = json.loads((runs / f"{name}-{preset}.rank{rank}.json").read_text())
        stage = mem["last"] if layout.pp > 1 and rank == 1 else mem["first"]
        assert float(stage["weights_total"]) == pytest.approx(measured["param_bytes"], rel=0.02), rank
        assert float(stage["gradients"]) == pytest.approx(measured["grad_bytes"], rel=0.02), rank
        assert float(stage["optimizer"]) == pytest.approx(measured["optimizer_bytes"], rel=0.02), rank
        measured_host = measured.get("host_optimizer_bytes", 0) + measured["host_activation_bytes"] * float(stage["in_flight"])
        # (activations to 2% of what a rank saves: under selective recompute the host holds what
        # its cache does not, so the cache's small error would be a larger share of the host's bytes)
        saved = float(stage["activation_per_microbatch"]) * float(stage["in_flight"])
        assert float(stage["host"]) == pytest.approx(measured_host, rel=0.02, abs=0.02 * saved), rank
        if layout.offload == "activations":  # nothing saved stays on the device but selective recompute's cache
            assert measured["activation_bytes"] == pytest.approx(float(stage["activation_resident"]), rel=0.10)
            assert (measured["activation_bytes"] > 0) == (layout.recompute == "selective")
            assert float(stage["activation_per_microbatch"]) == pytest.approx(
                measured["host_activation_bytes"] + measured["activation_bytes"], rel=0.10)
        else:
            assert float(stage["activation_per_microbatch"]) == pytest.approx(measured["activation_bytes"], rel=0.10)
