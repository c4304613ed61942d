"""Memory formulas against hand-computed cases (Korthikanti 2022 Table 2, ZeRO Sec. 5)."""

import numpy as np
import pytest

from luban.model.config import ModelConfig
from luban.model.flops import param_count
from luban.parallel.layout import ParallelLayout
from luban.plan.estimate import estimate
from luban.plan.grid import Grid
from luban.plan.memory import activation_bytes, in_flight, model_state_bytes, rank_params

from plan_helpers import make_problem

GPT = ModelConfig(name="g", hidden=1024, layers=8, heads=16, vocab=51200, seq_len=2048)
S, B, H, A = 2048, 2, 1024, 16


def per_layer(layout, model=GPT):
    g = Grid.from_layout(layout)
    act = activation_bytes(make_problem(model, gpus=layout.world_size, seq=S, batch=64), g)
    return float(act["per_token"]) * B * S / layout.cp


@pytest.mark.parametrize("t,sp,rc,formula", [
    (1, False, "none", S * B * H * (34 + 5 * A * S / H)),
    (4, False, "none", S * B * H * (10 + 24 / 4 + 5 * A * S / (H * 4))),
    (4, True, "none", S * B * H * (34 / 4 + 5 * A * S / (H * 4))),
    (4, False, "selective", S * B * H * (10 + 24 / 4)),
    (4, True, "selective", S * B * H * 34 / 4),
    (1, False, "full", 2 * S * B * H),
])
def test_korthikanti_table2(t, sp, rc, formula):
    layout = ParallelLayout(tp=t, sp=sp, recompute=rc, precision="fp16", micro_batch=B)
    assert per_layer(layout) == pytest.approx(formula)


def test_context_parallel_divides_tokens_and_keys():
    base = per_layer(ParallelLayout(precision="bf16", micro_batch=B))
    cp2 = per_layer(ParallelLayout(precision="bf16", micro_batch=B, cp=2))
    assert cp2 == pytest.approx(S / 2 * B * H * (34 + 5 * A * (S / 2) / H))
    assert cp2 < base / 2


def test_zero_stages_match_paper_formulas():
    psi, nd = 7.5e9, 64
    w, g, o = (float(x) for x in model_state_bytes(psi, 2.0, 2.0, 12.0, np.array(0), nd))
    assert w + g + o == 16 * psi
    assert sum(model_state_bytes(psi, 2.0, 2.0, 12.0, np.array(1), nd)) == pytest.approx(4 * psi + 12 * psi / nd)
    assert sum(model_state_bytes(psi, 2.0, 2.0, 12.0, np.array(2), nd)) == pytest.approx(2 * psi + 14 * psi / nd)
    assert sum(model_state_bytes(psi, 2.0, 2.0, 12.0, np.array(3), nd)) == pytest.approx(16 * psi / nd)


def test_single_rank_holds_exactly_param_count():
    for name in ("gpt2-124m", "llama-1b", "llama-8b"):
        p = make_problem(name, gpus=1, seq=1024, batch=1)
        first, last = rank_params(p, Grid.from_layout(ParallelLayout()))
        assert float(first) == float(last) == param_count(p.model)


def test_pipeline_ranks_split_layers_and_embeddings():
    p = make_problem("gpt3-175b", gpus=8, batch=64)
    first, last = rank_params(p, Grid.from_layout(ParallelLayout(pp=8)))
    cfg = p.model
    layer = param_count(cfg.replace(layers=2)) - param_count(cfg.replace(layers=1))
    assert float(first) == pytest.approx(12 * layer + cfg.vocab * cfg.hidden + cfg.seq_len * cfg.hidden)
    assert float(last) == pytest.approx(12 * layer + cfg.vocab * cfg.hidden + 2 * cfg.hidden)


@pytest.mark.parametrize("schedule,v,m,first,last", [
    ("1f1b", 1, 64, 8, 1), ("gpipe", 1, 64, 64, 64), ("1f1b", 1, 4, 4, 1),
    ("interleaved-1f1b", 3, 64, 8 * (1 + 7 / 24), (2 * 8 + 1) / 3),
    ("zero-bubble", 2, 64, 8, (8 + 1) / 2), ("dualpipev", 2, 64, 9, 9),
])
def test_microbatches_in_flight(schedule, v, m, first, last):
    g = Grid.from_layout(ParallelLayout(pp=8, schedule=schedule, virtual_stages=v))
    f, lst = in_flight(g, np.array(m))
    assert float(f) == pytest.approx(first) and float(lst) == pytest.approx(last)


def test_offload_moves_optimizer_to_host():
    cfg = ModelConfig(name="g", hidden=4096, layers=32, heads=32, vocab=51200, seq_len=2048)
    on = estimate(cfg, "dgx-a100-80g", ParallelLayout(dp=8, zero=1), global_batch=8, seq=2048)
    off = estimate(cfg, "dgx-a100-80g", ParallelLayout(dp=8, zero=1, offload="optimizer"), global_batch=8, seq=2048)
    assert off.memory_bytes["optimizer"] == 0 and off.host_bytes == pytest.approx(on.memory_bytes["optimizer"])
    assert off.time_breakdown_s["offload"] > 0
