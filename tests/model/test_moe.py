"""MoE layer: router math, DeepSeek-V3 bias balancing, dropless = per-token reference, capacity
drops, the aux-loss gradient, parameter/FLOP counts and config checks."""

import math

import pytest
import torch
import torch.nn.functional as F

from luban.errors import LubanError
from luban.model import ModelConfig, flops, get_preset
from luban.model.moe import MoE, collect_stats, moe_layers, reset_stats, update_router_bias
from luban.model.transformer import build_model
from luban.parallel.recompute import apply_recompute

CFG = ModelConfig(arch="llama", norm="rmsnorm", activation="swiglu", position="rope", bias=False, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=48, vocab=64, seq_len=16,
                  experts=6, experts_per_token=2, expert_ffn_hidden=24, shared_experts=1, dense_layers=1)


def _layer(cfg=CFG, seed=0) -> MoE:
    model = build_model(cfg, seed=seed)
    return model.layers["1"].mlp


def _expert(layer: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    w = layer.experts
    if not w.swiglu:
        return F.gelu(x @ w.w_up[e].t(), approximate="tanh") @ w.w_down[e].t()
    return (F.silu(x @ w.w_gate[e].t()) * (x @ w.w_up[e].t())) @ w.w_down[e].t()


def _reference(layer: MoE, x: torch.Tensor, drop: set = frozenset()) -> torch.Tensor:
    """Token by token: its k experts weighted by the renormalised gates, plus the shared expert."""
    logits = x @ layer.router.weight.t()
    out = []
    for t in range(x.shape[0]):
        if layer.router.kind == "softmax":
            p = logits[t].softmax(-1)
            w, ids = p.topk(layer.k)
        else:
            s = logits[t].sigmoid()
            ids = (s + layer.router.expert_bias).topk(layer.k).indices
            w = s[ids]
        w = w / w.sum()
        y = sum(w[j] * _expert(layer, int(e), x[t]) for j, e in enumerate(ids) if (t, int(e)) not in drop)
        out.append(y + layer.shared(x[t]))
    return torch.stack(out)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_dropless_equals_per_token_reference(router):
    layer = _layer(CFG.replace(router=router))
    if router == "sigmoid":
        layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, CFG.experts))  # the bias must steer selection
    x = torch.randn(40, CFG.hidden, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(layer(x), _reference(layer, x), atol=1e-6)


def test_router_math():
    layer = _layer(CFG.replace(router="sigmoid"))
    x = torch.randn(10, CFG.hidden)
    bias = torch.zeros(CFG.experts)
    bias[5] = 100.0  # expert 5 always chosen, but its gate weight ignores the bias
    layer.router.expert_bias.copy_(bias)
    weights, ids, probs = layer.router(x)
    scores = (x @ layer.router.weight.t()).sigmoid()
    assert (ids == 5).any(-1).all()
    chosen = scores.gather(1, ids)
    assert torch.allclose(weights, chosen / chosen.sum(-1, keepdim=True))
    assert torch.allclose(probs.sum(-1), torch.ones(10))
    soft = _layer(CFG)
    weights, ids, probs = soft.router(x)
    p = (x @ soft.router.weight.t()).softmax(-1)
    top = p.topk(2)
    assert torch.equal(ids, top.indices) and torch.allclose(weights, top.values / top.values.sum(-1, keepdim=True))


def test_capacity_drops_later_tokens():
    cfg = CFG.replace(capacity_factor=1.0)
    layer = _layer(cfg)
    x = torch.randn(12, CFG.hidden, generator=torch.Generator().manual_seed(2))
    capacity = math.ceil(1.0 * 12 * 2 / 6)
    _, ids, _ = layer.router(x)
    seen, drop = {}, set()
    for t in range(12):  # GShard: an expert keeps the first `capacity` tokens in micro-batch order
        for e in ids[t].tolist():
            seen[e] = seen.get(e, 0) + 1
            if seen[e] > capacity:
                drop.add((t, e))
    assert drop, "the test needs an overloaded expert"
    layer.train()
    with torch.no_grad():
        assert torch.allclose(layer(x), _reference(layer, x, drop), atol=1e-6)
    assert collect_stats([build_wrapper(layer)])["moe_dropped_tokens"] == {"1": len(drop)}


def build_wrapper(layer):
    """A model part holding one MoE layer under the name the metrics use (layers.1.mlp)."""
    part = torch.nn.Module()
    part.layers = torch.nn.ModuleDict({"1": torch.nn.Module()})
    part.layers["1"].mlp = layer
    return part


def test_aux_loss_gradient_is_coef_times_switch_loss_gradient():
    cfg = CFG.replace(aux_loss_coef=0.3, shared_experts=0)
    layer = _layer(cfg).train()
    x = torch.randn(16, CFG.hidden, generator=torch.Generator().manual_seed(3))
    layer(x).pow(2).sum().backward()
    ours = layer.router.weight.grad.clone()
    layer.zero_grad()
    layer.aux_coef = 0.0
    y = layer(x)
    logits = x @ layer.router.weight.t()
    probs = logits.softmax(-1)
    ids = probs.topk(2).indices
    f = torch.bincount(ids.flatten(), minlength=6).float() / ids.numel()
    aux = 6 * (f * probs.mean(0)).sum()
    (y.pow(2).sum() + 0.3 * aux).backward()
    assert torch.allclose(ours, layer.router.weight.grad, atol=1e-6)


def test_bias_update_as_in_deepseek_v3():
    """b_i += gamma * sign(mean load - load_i) from the load of the whole step (Liu et al. 2024, Eq. 16)."""
    cfg = CFG.replace(router="sigmoid", router_bias_rate=0.01, aux_loss_coef=0.0)
    model = build_model(cfg, seed=0).train()
    layer = model.layers["1"].mlp
    x = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(4))
    captured = []
    layer.register_forward_hook(lambda mod, inp, out: captured.append(inp[0].reshape(-1, cfg.hidden)))
    model(x[:2])
    model(x[2:])  # two micro-batches: loads add up
    expected = torch.zeros(cfg.experts)
    for h in captured:
        ids = ((h @ layer.router.weight.t()).sigmoid() + layer.router.expert_bias).topk(2).indices
        expected += torch.bincount(ids.flatten(), minlength=cfg.experts)
    metrics = collect_stats([model])
    assert metrics["moe_tokens_per_expert"]["1"] == expected.long().tolist()
    assert metrics["moe_kept_tokens_per_expert"]["1"] == expected.long().tolist()  # dropless: all kept
    assert metrics["moe_load_max_over_mean"]["1"] == pytest.approx(float(expected.max() / expected.mean()))
    update_router_bias([model])
    assert torch.equal(layer.router.expert_bias, 0.01 * torch.sign(expected.mean() - expected))
    reset_stats([model])
    assert collect_stats([model])["moe_tokens_per_expert"]["1"] == [0] * cfg.experts
    softmax = build_model(CFG, seed=0)  # the softmax router has no balancing bias
    update_router_bias([softmax])
    assert not softmax.layers["1"].mlp.router.expert_bias.any()
    assert "layers.1.mlp.router.expert_bias" not in softmax.state_dict()


def test_capacity_reports_routed_and_kept_load_and_the_bias_follows_routing():
    """Under a capacity limit the metrics give the routing's load (top-k decisions) and the kept
    load (after the cut) apart; the DeepSeek-V3 bias moves by the routed load: kept counts are
    clamped per micro-batch and here call an expert routed above the mean underloaded."""
    cfg = CFG.replace(router="sigmoid", router_bias_rate=0.01, aux_loss_coef=0.0, capacity_factor=1.0)
    model = build_model(cfg, seed=0).train()
    layer = model.layers["1"].mlp
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    captured = []
    layer.register_forward_hook(lambda mod, inp, out: captured.append(inp[0].reshape(-1, cfg.hidden)))
    model(x[:2])
    model(x[2:])
    routed, kept = torch.zeros(cfg.experts), torch.zeros(cfg.experts)
    for h in captured:  # capacity per micro-batch of T = 32 tokens: ceil(1.0 * 32 * 2 / 6) = 11
        ids = ((h @ layer.router.weight.t()).sigmoid() + layer.router.expert_bias).topk(2).indices
        counts = torch.bincount(ids.flatten(), minlength=cfg.experts).float()
        routed += counts
        kept += counts.clamp(max=math.ceil(32 * 2 / 6))
    assert torch.sign(routed.mean() - routed).ne(torch.sign(kept.mean() - kept)).any(), "the case must tell them apart"
    metrics = collect_stats([model])
    assert metrics["moe_tokens_per_expert"]["1"] == routed.long().tolist()
    assert metrics["moe_kept_tokens_per_expert"]["1"] == kept.long().tolist()
    assert metrics["moe_load_max_over_mean"]["1"] == pytest.approx(float(routed.max() / routed.mean()))
    assert metrics["moe_kept_load_max_over_mean"]["1"] == pytest.approx(float(kept.max() / kept.mean()))
    assert metrics["moe_load_max_over_mean"]["1"] > metrics["moe_kept_load_max_over_mean"]["1"]
    assert metrics["moe_dropped_tokens"]["1"] == int(routed.sum() - kept.sum()) > 0
    update_router_bias([model])
    assert torch.equal(layer.router.expert_bias, 0.01 * torch.sign(routed.mean() - routed))


def test_recompute_and_eval_do_not_count():
    model = build_model(CFG, seed=0).train()
    apply_recompute(model, "full")
    x = torch.randint(0, 64, (2, 16))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()  # recompute reruns forward in backward
    assert sum(collect_stats([model])["moe_tokens_per_expert"]["1"]) == 2 * 16 * 2
    reset_stats([model])
    model.eval()
    with torch.no_grad():
        model(x)
    assert sum(collect_stats([model])["moe_tokens_per_expert"]["1"]) == 0


@pytest.mark.parametrize("cfg", [CFG, CFG.replace(qk_norm=True, activation="gelu", router="sigmoid"),
                                 get_preset("tiny-moe")])
def test_parameter_counts(cfg):
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == flops.param_count(cfg)
    per_expert = sum(p[0].numel() for p in moe_layers([model])[0][1].experts.parameters())
    routed_idle = (cfg.experts - cfg.experts_per_token) * per_expert * cfg.moe_layers
    assert flops.active_param_count(cfg) == flops.param_count(cfg) - routed_idle


def test_published_sizes():
    """Mixtral 8x7B: 46.7B total, 12.9B active (Jiang et al. 2024); Qwen3-30B-A3B: 30.5B, 3.3B (model card)."""
    for name, total, active in (("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9)):
        cfg = get_preset(name)
        assert flops.param_count(cfg) == pytest.approx(total, rel=0.005), name
        assert flops.active_param_count(cfg) == pytest.approx(active, rel=0.02), name


def test_flops_count_active_experts():
    cfg = CFG.replace(shared_experts=0)
    dense_equiv = cfg.replace(experts=0, dense_layers=0, ffn_hidden=cfg.experts_per_token * cfg.expert_ffn_hidden)
    router = 2 * cfg.experts * cfg.hidden
    extra = cfg.moe_layers * 3 * router  # the router's matmul, forward and backward
    assert flops.flops_per_token(cfg) == flops.flops_per_token(dense_equiv) - 3 * 2 * 3 * cfg.hidden * (
        dense_equiv.ffn_hidden - cfg.ffn_hidden) * cfg.dense_layers + extra


@pytest.mark.parametrize("raw, message", [
    ({"experts": 4, "experts_per_token": 5}, "model.experts_per_token = 5: at most experts = 4"),
    ({"experts": 4, "dense_layers": 2}, "model.dense_layers = 2: must be < layers = 2"),
    ({"experts": -1}, "model.experts = -1"),
    ({"experts": 4, "router": "topk"}, "model.router = 'topk': one of softmax, sigmoid"),
    ({"experts": 4, "capacity_factor": float("nan")}, "model.capacity_factor = nan"),
    ({"experts": 4, "aux_loss_coef": -0.1}, "model.aux_loss_coef = -0.1"),
    ({"experts": 4, "experts_per_token": 4, "capacity_factor": 0.1}, "model.capacity_factor = 0.1"),
    ({"experts": 4, "expert_ffn_hidden": 0.5}, "model.expert_ffn_hidden = 0.5: must be of type int"),
    ({"experts": True}, "model.experts = True: must be of type int"),
    ({"shared_experts": 1}, "model.shared_experts = 1: needs experts > 0"),  # was silently ignored
    ({"dense_layers": 1}, "model.dense_layers = 1: needs experts > 0"),
    ({"preset": "tiny-moe", "experts": 0, "dense_layers": 1}, "model.dense_layers = 1: needs experts > 0"),
])
def test_bad_moe_keys_are_one_line_errors(raw, message):
    with pytest.raises(LubanError) as err:
        ModelConfig.from_dict({"preset": "tiny-llama", "layers": 2, **raw})
    assert str(err.value).startswith(message), str(err.value)


def test_moe_preset_made_dense_drops_its_moe_keys():
    """experts = 0 over a MoE preset is a dense model: the preset's shared experts and dense layers go too."""
    cfg = ModelConfig.from_dict({"preset": "tiny-moe", "experts": 0})
    assert (cfg.experts, cfg.shared_experts, cfg.dense_layers) == (0, 0, 0)
    assert get_preset("tiny-moe").shared_experts and get_preset("tiny-moe").dense_layers  # the case is real
