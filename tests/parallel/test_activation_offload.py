"""``offload = "activations"`` composes with every layout and changes nothing but where saved
tensors live: each layout trains bit for bit like the same layout without offload (SGD, 2 steps,
clipping active), no saved activation stays on the device (but selective recompute's cache of
GEMM and attention outputs, which is not behind saved-tensor hooks), and the bytes moved to the
host per micro-batch plus those left are exactly the activation bytes the run without offload keeps (which
the planner predicts: tests/plan/test_runtime_multirank.py, and below for the offload layout)."""

from __future__ import annotations

import pytest
import torch

from luban.model.presets import get_preset
from luban.parallel.layout import ParallelLayout, check_layout
from luban.errors import LubanError
from tests.parallel.harness import merged_params, results, run_job, spawn

LAYOUTS = {  # name: (preset, model keys, layout), all on 2 ranks but "single*"
    "dp2-ddp": ("tiny-llama", {}, {"dp": 2}),
    "dp2-zero3": ("tiny-llama", {}, {"dp": 2, "zero": 3}),
    "tp2-sp": ("tiny-llama", {}, {"tp": 2, "sp": True}),
    "pp2-1f1b": ("tiny", {}, {"pp": 2, "micro_batch": 2}),
    "pp2-interleaved": ("tiny", {}, {"pp": 2, "virtual_stages": 2, "schedule": "interleaved-1f1b", "micro_batch": 2}),
    "cp2": ("tiny-llama", {}, {"cp": 2}),
    "dp2-ep2-moe": ("tiny-moe", {"layers": 3}, {"dp": 2, "ep": 2}),
    "dp2-full-recompute": ("tiny-llama", {}, {"dp": 2, "recompute": "full"}),
}
SINGLE = {"single-selective": ("tiny", {}, {"recompute": "selective", "micro_batch": 2})}


def jobs(table):
    out = []
    for name, (preset, model, layout) in table.items():
        for offload in ("none", "activations"):
            out.append({"name": f"{name}-{offload}", "preset": preset, "model": model, "global_batch": 8,
                        "layout": {**layout, "offload": offload}, "steps": 2})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("actoff")
    code = spawn(jobs(LAYOUTS), 2, out)
    single = {j["name"]: [run_job(j)] for j in jobs(SINGLE)}
    return out, code, single


@pytest.mark.multirank
@pytest.mark.parametrize("name", [*LAYOUTS, *SINGLE])
def test_offloaded_activations_train_bit_for_bit_and_leave_the_device(runs, name):
    out, code, single = runs
    get = (lambda n: single[n]) if name in SINGLE else (lambda n: results(n, 2, out))
    plain, off = get(f"{name}-none"), get(f"{name}-activations")
    p_plain, p_off = merged_params(plain), merged_params(off)
    assert set(p_plain) == set(p_off)
    assert all(torch.equal(p_plain[k], p_off[k]) for k in p_plain), name
    assert [r["losses"] for r in plain] == [r["losses"] for r in off]
    for r_plain, r_off in zip(plain, off):
        saved, device, host = (r_plain["memory"]["activation_bytes"], r_off["memory"]["activation_bytes"],
                               r_off["memory"]["host_activation_bytes"])
        assert saved > 0
        if "selective" in name:  # selective recompute's cache (GEMM, attention outputs) stays on the device
            assert 0 < device < saved and host > 0, r_off["memory"]
        else:
            assert device == 0, r_off["memory"]  # nothing saved stays on the device
        assert device + host == saved


def test_runtime_refuses_the_planner_only_block_tier_and_allows_activations_with_ep():
    cfg = get_preset("tiny-moe")
    check_layout(ParallelLayout(dp=2, ep=2, offload="activations"), cfg, 8, 2)
    with pytest.raises(LubanError, match="parallel.offload = 'blocks': this runtime offloads"):
        check_layout(ParallelLayout(offload="blocks"), cfg, 8, 1)


def test_parameter_rule_is_exact_and_rarely_rebuilds_the_parameter_set():
    """``is_activation`` counts exactly the saved storages that are not parameters (brute force
    over the same saved tensors), and only leaf-rooted saved tensors (op outputs never are
    parameters) make it rebuild the parameter set: far fewer rebuilds than saved tensors."""
    from luban.model.transformer import Transformer
    from luban.parallel.memory import ActivationCounter

    torch.manual_seed(0)
    for preset in ("tiny", "tiny-llama", "tiny-moe"):
        model = Transformer(get_preset(preset))
        tokens = torch.randint(0, model.cfg.vocab, (2, 16))
        saved = []
        counter = ActivationCounter([model])
        pack = counter._pack
        counter._pack = lambda t: pack(saved.append(t) or t)  # see every saved tensor the rule sees
        with counter.record():
            model(tokens).float().mean()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        expected = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
                    if t.untyped_storage().data_ptr() not in params}
        assert counter.total == sum(expected.values()) > 0, preset
        assert any(t.untyped_storage().data_ptr() in params for t in saved), preset  # weights were saved too
        assert counter.refreshes * 3 < len(saved), (preset, counter.refreshes, len(saved))


def test_cuda_path_prefetches_in_backward_order_with_cpu_stand_ins(monkeypatch):
    """The CUDA path's bookkeeping (side-stream copies back, ``PREFETCH`` ahead, each waited for
    once, the entry's device copy handed over and dropped) run with CPU stand-ins for CUDA's
    streams and events: the stream semantics are CUDA's, the order and contents are checked here."""
    from luban.parallel.activation_offload import ActivationOffload

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: torch.cpu.Stream())
    monkeypatch.setattr(torch.cuda, "stream", torch.cpu.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: torch.cpu.current_stream())
    monkeypatch.setattr(torch.cuda, "Event", torch.cpu.Event)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    off = ActivationOffload([], torch.device("cuda"), prefetch=2)
    off.pin = False  # no pinned memory without CUDA
    saved = [torch.full((4 + i,), float(i)) for i in range(6)]
    with off.hooks():
        entries = [off._host_copy(t) for t in saved]
    assert [e.index for e in entries] == list(range(6)) and all(e.order is entries[0].order for e in entries)
    assert [ref() for ref in entries[0].order] == entries  # weak: an entry dies with what autograd saved
    started = []
    real_start = off._start_fetch
    monkeypatch.setattr(off, "_start_fetch", lambda e, d: started.append(e.index) or real_start(e, d))
    for i in reversed(range(6)):  # backward: the last saved first
        storage = off._fetch(entries[i], torch.device("cpu"))
        got = torch.empty(0).set_(storage, 0, saved[i].shape, saved[i].stride())
        assert torch.equal(got, saved[i]) and entries[i].device is None
    # each copied back once, in backward order, up to 2 ahead of the one needed
    assert started == [5, 4, 3, 2, 1, 0]
    assert entries[0].fetched is not None
    off._fetch(entries[3], torch.device("cpu"))  # a second view of a storage already handed over:
    assert started[6:] == [3]  # fetched again, alone (the earlier ones were brought back before)
    import weakref

    gone = weakref.ref(entries[5])
    del entries[5]
    assert gone() is None  # no reference cycle keeps a dropped entry's host copy alive
