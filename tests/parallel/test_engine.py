"""Single-process engine features: recompute, memory accounting, loss scaling, state dicts."""

from __future__ import annotations

import math

import pytest
import torch

from luban.model import flops
from luban.model.presets import get_preset
from luban.parallel.engine import Engine, OptimizerConfig, build_engine
from luban.parallel.layout import ParallelLayout
from luban.parallel.memory import ActivationCounter
from tests.parallel.harness import batch

SGD = OptimizerConfig(name="sgd", weight_decay=0.0)


def engine(preset="tiny", optim=SGD, **layout):
    cfg = get_preset(preset).replace(seq_len=32)
    return build_engine(cfg, ParallelLayout(**layout), optim, 4, seed=0, device=torch.device("cpu")), cfg


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_recompute_modes_give_identical_gradients(preset):
    grads, acts = {}, {}
    for mode in ("none", "selective", "full", "full:2"):
        e, cfg = engine(preset, recompute=mode)
        e.forward_backward(*batch(0, 4, cfg))
        grads[mode] = {n: p.grad.clone() for n, p in e.model.named_parameters()}
        acts[mode] = e.memory_report()["activation_bytes"]
    for mode in ("selective", "full", "full:2"):
        assert all(torch.equal(grads[mode][n], g) for n, g in grads["none"].items()), mode
    assert acts["full"] < acts["full:2"] < acts["none"] and acts["selective"] < acts["none"]


def test_selective_recompute_cache_serves_a_second_backward_on_every_torch():
    """The split-backward schedules recompute each block twice. torch 2.13 keys SAC's cache by call index
    (``_Entries``); torch 2.11-2.12 keep a list per operator that the recompute pops (``_Queue``: read in
    order, never emptied, restarted by ``_Replaying`` at each recompute). The 2.11 path runs in CI only
    through this test; ``bash .ci/torch-floor`` runs the layouts on torch 2.11 itself."""
    from luban.parallel import recompute

    queue = recompute._Queue()
    queue.append("first"), queue.append("second")
    mode = recompute._Replaying(recompute.save_policy, {torch.ops.aten.mm.default: queue}, False)
    for _ in range(2):  # two backward passes
        with mode:
            assert [queue.pop(0), queue.pop(0)] == ["first", "second"] and len(queue) == 2
    entries = recompute._Entries()
    entries[0] = "saved"
    entries[0] = recompute._CONSUMED or "saved"  # torch 2.13 marks a read entry; the mark is not kept
    assert entries == {0: "saved"}


def test_memory_report_is_exact():
    e, cfg = engine("tiny-llama", optim=OptimizerConfig(name="adamw"))
    e.forward_backward(*batch(0, 4, cfg))
    report = e.memory_report()
    assert report["param_bytes"] == 4 * flops.param_count(cfg)
    assert report["grad_bytes"] == report["param_bytes"]
    e.step(1e-3, 1.0)
    assert e.memory_report()["optimizer_bytes"] == 2 * report["param_bytes"]


def test_activation_counter_counts_distinct_storages_once():
    w = torch.nn.Parameter(torch.randn(8, 8))
    layer = torch.nn.Module()
    layer.w = w
    x = torch.randn(4, 8, requires_grad=True)
    counter = ActivationCounter([layer])
    with counter.record():
        h = x @ w  # saves x (and w: a parameter, excluded)
        y = h.tanh()  # saves its output y
        z = y.view(32).sin()  # saves a view of y: same storage, counted once
    z.sum().backward()
    assert counter.total == x.nbytes + y.nbytes


def test_fp16_loss_scaling_skips_overflowing_steps():
    e, cfg = engine(precision="fp16")
    e.forward_backward(*batch(0, 4, cfg))
    before = {n: p.detach().clone() for n, p in e.model.named_parameters()}
    next(e.model.parameters()).grad[0, 0] = math.inf
    scale = e.scaler.scale
    assert not math.isfinite(e.step(0.1, 1.0))
    assert e.scaler.scale == scale / 2
    assert all(torch.equal(before[n], p) for n, p in e.model.named_parameters())
    e.forward_backward(*batch(1, 4, cfg))
    assert math.isfinite(e.step(0.1, 1.0))
    assert any(not torch.equal(before[n], p) for n, p in e.model.named_parameters())


def test_single_process_coordination_and_global_names():
    e, _ = engine()
    assert isinstance(e, Engine) and e.any_rank(True) and not e.any_rank(False)
    e.barrier()
    sd = e.state_dict()
    assert {"tok_emb.weight", "lm_head.weight", "layers.3.mlp.w_down.weight"} <= set(sd["model"])
    assert all(k.startswith(("state.", "param_groups.")) for k in sd["optim"])


def test_tied_embedding_copy_is_initialised_and_saved_under_the_embedding_name():
    """The last stage's tied head (a second copy) starts equal to the embedding, and its optimizer
    state goes to and comes from checkpoints under the embedding's name."""
    from luban.parallel.pipeline import TransformerPipeline
    from luban.parallel.tied import TiedEmbedding

    cfg = get_preset("tiny").replace(seq_len=32)
    model = TransformerPipeline(cfg, seed=0, device=torch.device("cpu"))
    first, last = model.build_stage(0, 2), model.build_stage(1, 2)
    assert torch.equal(first.tok_emb.weight, last.lm_head.weight)
    tied = TiedEmbedding([first], cfg, ParallelLayout(), mesh=None)  # pp = 1 layout: nothing to sync
    assert tied.params == [] and tied.norm_skip() == set()
    assert not tied.is_copy(first) and tied.is_copy(last)
    saved = {"state.lm_head.weight.momentum_buffer": 1, "state.norm.weight.momentum_buffer": 2}
    renamed = tied.save_names(last, saved)
    assert renamed == {"state.tok_emb.weight.momentum_buffer": 1, "state.norm.weight.momentum_buffer": 2}
    assert tied.load_names(last, renamed) == saved and tied.save_names(first, saved) == saved
