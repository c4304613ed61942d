"""luban's own trainer under the scheduler: preempted by a high-priority job (SIGUSR1 ->
checkpoint -> exit 75), requeued, resumed with --resume auto, and finished with weights
bitwise equal to an uninterrupted run. No user code: the trainer speaks the protocol itself."""

from __future__ import annotations

import re

import pytest

from luban.train import checkpoint
from tests.child import Child
from tests.cluster.conftest import PYTHON, ROOT, wait_for

CONFIG = """
[model]
preset = "tiny"
layers = 1
hidden = 64
heads = 2
[data]
path = ""
[train]
steps = {steps}
global_batch = 2
warmup_steps = 2
seed = 0
checkpoint_every = {every}
eval_every = 1000
[run]
dir = "{run}"
"""


def weights(run_dir):
    """The final checkpoint's tensors (torch DCP), as raw bytes per name."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    final = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    flat = run_dir / "final.pt"
    dcp_to_torch_save(final, flat)
    state = torch.load(flat, weights_only=False)
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, torch.Tensor):
            out[prefix] = value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()

    walk("", state.get("model", state))
    return final.name, out


@pytest.mark.slow
def test_luban_training_is_preempted_resumes_and_matches_an_uninterrupted_run(service, tmp_path):
    """Deterministic order: the job's step-4 checkpoint write is held (``LUBAN_TEST_HOLD_CHECKPOINT_WRITE``),
    so it cannot get past step 8 (whose save waits for step 4's) and finish before the preemption
    lands; the write is released only once the launcher has forwarded SIGUSR1 to the trainer. (Before,
    the test waited for step 3 and hoped: a 24-step run of this model takes ~0.1 s, so it often
    finished first, and the retry ran ~12 s worth of steps behind an unread stdout pipe, which filled
    and hung the reference run.)"""
    svc = service("--nodes", "1", "--tick", "0.1", "--suspend-timeout", "300")
    alice_token, alice = svc.user("alice", {"LOW": 1})
    _, bob = svc.user("bob", {"HIGH": 1})
    steps, hold = 24, tmp_path / "hold"
    hold.mkdir()
    ref_cfg, job_cfg = tmp_path / "ref.toml", tmp_path / "job.toml"
    ref_cfg.write_text(CONFIG.format(run=tmp_path / "ref", steps=steps, every=4))
    job_cfg.write_text(CONFIG.format(run=tmp_path / "job", steps=steps, every=4))
    with Child([PYTHON, "-m", "luban", "train", str(ref_cfg), "--resume", "auto"], log=tmp_path / "ref.log",
               cwd=ROOT) as reference:
        out = svc.cli("submit", "-p", "LOW", "--name", "train", "--workdir", str(ROOT),
                      "--env", f"{checkpoint.HOLD_ENV}={hold}", "--env", f"{checkpoint.HOLD_STEP_ENV}=4",
                      "--", PYTHON, "-m", "luban", "train", str(job_cfg), "--resume", "auto", token=alice_token).stdout
        job = int(re.search(r"submitted job (\d+)", out).group(1))
        wait_for(lambda: (hold / "held").exists() or alice.job(job)["state"] not in ("queued", "starting", "running"),
                 600, 0.05, "the step-4 checkpoint write to be held")
        assert (hold / "held").exists(), alice.logs(job)["text"][-3000:]
        high = bob.submit({"name": "urgent", "command": "true", "priority": "HIGH"})["id"]
        wait_for(lambda: "SIGUSR1 forwarded" in alice.logs(job)["text"], 600, 0.05, "the suspend signal")
        (hold / "release").write_text("")
        assert bob.wait(high, timeout=600)["state"] == "succeeded"
        final = alice.wait(job, timeout=600)
        log = alice.logs(job)["text"]
        assert final["state"] == "succeeded", log[-3000:]
        reference.finish(600)
    assert final["restart_count"] == 1, log[-3000:]
    first = [j for j in alice.jobs(all_attempts=True) if j["chain_id"] == final["chain_id"]][0]
    assert first["state"] == "suspended" and first["exit_code"] == 75 and "PREEMPTED" in first["stop_reasons"]
    assert re.search(r"resumed from .*step_\d+ at step \d+", log), log[-3000:]

    ref_step, ref_weights = weights(tmp_path / "ref")
    job_step, job_weights = weights(tmp_path / "job")
    assert ref_step == job_step == f"step_{steps:07d}"
    assert ref_weights.keys() == job_weights.keys() and ref_weights
    assert all(ref_weights[k] == job_weights[k] for k in ref_weights), "weights differ after preemption"


def trained_world_size(run_dir) -> int:
    import json

    final = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return json.loads((final / "meta.json").read_text())["world_size"]


def _train_in_a_job(svc, tmp_path, nproc_flag, group="default", nodes=1):
    """A job running luban train on 2 ranks in all: 1 node of 2 "GPUs", or 2 nodes of one rank each."""
    token, alice = svc.user("alice", {"NORMAL": nodes}, node_group=group)
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG.format(run=tmp_path / "run", steps=3, every=1000).replace("[data]", "[parallel]\ndp = 2\n[data]"))
    out = svc.cli("submit", "-n", str(nodes), "--name", "train", "--workdir", str(ROOT), "--", PYTHON, "-m",
                  "luban", "train", str(cfg), *nproc_flag, token=token).stdout
    job = int(re.search(r"submitted job (\d+)", out).group(1))
    final = alice.wait(job, timeout=600)
    assert final["state"] == "succeeded", alice.logs(job)["text"][-3000:]
    assert trained_world_size(tmp_path / "run") == 2


@pytest.mark.slow
@pytest.mark.parametrize("nproc_flag", [["--nproc", "2"], [], ["--parallel", "auto"]],
                         ids=["nproc2", "one-rank-per-gpu", "parallel-auto"])
def test_luban_train_uses_the_nodes_gpus_inside_a_job(service, tmp_path, nproc_flag):
    _train_in_a_job(service("--nodes", "1", "--gpus", "2", "--tick", "0.2"), tmp_path, nproc_flag)
    if "auto" in nproc_flag:  # the planner chose a layout for the job's n x g = 2 ranks
        import json

        layout = json.loads((tmp_path / "run" / "plan.json").read_text())["layout"]
        assert layout["dp"] * layout["tp"] * layout["pp"] * layout["cp"] == 2, layout


@pytest.mark.slow
def test_the_readmes_multi_node_command_trains_on_all_nodes(service, tmp_path):
    """`luban submit -n 2 -- luban train config.toml` (docs/platform.md): one rank per node here."""
    _train_in_a_job(service("--nodes", "2", "--tick", "0.2"), tmp_path, [], nodes=2)


@pytest.mark.slow
@pytest.mark.exclusive("slurm")  # the run's one Slurm cluster (tests/cluster/test_slurm.py)
def test_luban_train_nproc2_inside_a_slurm_job(service, tmp_path):
    from tests.cluster.test_slurm import slurm_nodes

    from tests.cluster.conftest import require

    require(bool(slurm_nodes()), "a Slurm cluster (sinfo lists idle nodes)")
    svc = service("--executor", "slurm", "--tick", "0.3")
    _train_in_a_job(svc, tmp_path, ["--nproc", "2"], group=svc.admin().nodes()[0]["node_group"])
