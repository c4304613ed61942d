"""Per-GPU memory: model states (ZeRO), activations (Korthikanti Table 2), buffers, overhead.

Every function takes a ``Problem`` and a ``Grid`` of layouts and returns broadcast numpy arrays.
Equations, with their sources, are written out in docs/planner.md.
"""

from __future__ import annotations

import numpy as np

from luban.plan.grid import DUALPIPEV, FP32, FULL, GPIPE, NO_RECOMPUTE, SELECTIVE, ZERO_BUBBLE, Grid
from luban.plan.problem import Problem


def param_bytes(runtime: str, states: int, precision) -> tuple:
    """Bytes per parameter of (weights, gradients, optimizer state) before sharding.

    megatron: half precision keeps 2-byte weights and gradients and K = 4 + 4·states bytes of
    fp32 master weights and optimizer states (ZeRO Sec. 3.1: K = 12 for Adam); fp32 keeps
    4 + 4 + 4·states. luban keeps fp32 weights and gradients at every precision.
    """
    state_b = 4.0 * states
    half = (precision != FP32) & (runtime == "megatron")
    return np.where(half, 2.0, 4.0), np.where(half, 2.0, 4.0), np.where(half, 4.0 + state_b, state_b)


def model_state_bytes(params, weight_b, grad_b, optim_b, zero, shards, fsdp: bool = False) -> tuple:
    """Model states at rest. ZeRO Sec. 5: stage 1 shards optimizer states, 2 also gradients,
    3 also weights over ``shards``. ``fsdp`` (luban: every stage >= 1 is FSDP2) keeps weights and
    gradients sharded between steps from stage 1 on; the transient full copies are
    ``fsdp_transients``."""
    low = 1 if fsdp else 3
    return (params * weight_b / np.where(zero >= low, shards, 1),
            params * grad_b / np.where(zero >= min(low, 2), shards, 1),
            params * optim_b / np.where(zero >= 1, shards, 1))


def fsdp_transients(params, weight_b, grad_b, zero, shards):
    """luban ZeRO-1/2 (FSDP2, ``reshard_after_forward=False``): the gathered weights stay
    unsharded from forward to backward; ZeRO-1 also accumulates full gradients until the one
    reduce-scatter of the step (luban/parallel/data_parallel.py)."""
    rest = params * (1 - 1 / shards)
    return np.where((zero == 1) | (zero == 2), rest * weight_b, 0.0) + np.where(zero == 1, rest * grad_b, 0.0)


def v_shaped(g: Grid):
    """Schedules that place the first and the last model chunk on pipeline rank 0."""
    return (g.pp > 1) & ((g.schedule == DUALPIPEV) | ((g.schedule == ZERO_BUBBLE) & (g.virtual_stages % 2 == 0)))


def rank_layers(problem: Problem, g: Grid):
    """Transformer layers on the busiest pipeline rank: ceil(l / (p·v)) per model chunk, v chunks."""
    if g.max_stage_layers is not None:
        return g.max_stage_layers
    chunks = g.pp * g.virtual_stages
    return np.minimum(-(-problem.model.layers // chunks) * g.virtual_stages, problem.model.layers)


def rank_params(problem: Problem, g: Grid) -> tuple:
    """Parameters held by the first and by the last pipeline rank (tensor parallel splits the
    weight matrices and the vocabulary, not the norms and output biases)."""
    d = problem.derived
    layer = (d["layer_params"] - d["layer_replicated"]) / g.tp + d["layer_replicated"]
    layers = rank_layers(problem, g) * layer
    head = d["embedding"] / g.tp  # the untied LM head, or the copy of a tied one on the last stage
    embed = d["embedding"] / g.tp + d["positions"]
    tail = d["norm"] + np.where(problem.model.tie_embeddings, 0.0, head)
    single = (g.pp == 1) | v_shaped(g)
    first = layers + embed + np.where(single, tail, 0.0)
    last = np.where(single, first, layers + d["norm"] + head)
    return first, last


def activation_bytes(problem: Problem, g: Grid) -> dict:
    """Saved activations of one transformer layer for one micro-batch on one rank.

    Returns bytes ``per_token`` (multiply by the rank's tokens b·s/cp) and ``fixed`` bytes per
    micro-batch (autocast weight copies); ``none`` is the no-recompute amount (the working set of
    a layer being recomputed). megatron: Korthikanti et al. 2022, Table 2, generalised to
    grouped-query attention and the MLP width; luban: the tensors PyTorch saves for
    ``luban.model.transformer.Block`` (docs/planner.md lists them).
    """
    cfg = problem.model
    h, q, kv, f, a = cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.ffn_hidden, cfg.heads
    t = g.tp
    rep_div = np.where(g.sp, t, 1)  # sequence parallel splits the replicated part too
    s_keys = problem.seq / g.cp
    if problem.runtime == "megatron":
        e = np.where(g.precision == FP32, 4.0, 2.0)
        replicated = (4 * e + 2) * h  # 2 norm inputs, QKV and MLP inputs, 2 dropout masks (1 byte)
        mlp = (3 if cfg.activation == "swiglu" else 2) * e * f
        sharded = e * (2 * q + 2 * kv) + mlp  # Q and K, V, out-proj input; MLP
        scores = a * s_keys * (2 * e + 1)  # softmax output, dropout mask, dropout output
        none = replicated / rep_div + (sharded + scores) / t
        selective = replicated / rep_div + sharded / t
        full = e * h / rep_div
        fixed_none = np.zeros_like(e)
    else:
        big = 4.0  # residual stream, norms: fp32 (the weights are fp32)
        e = np.where(g.precision == FP32, 4.0, 2.0)
        norm_saved = big * h + 8 if cfg.norm == "layernorm" else 2 * big * h + 4
        consumers = 2 if cfg.activation == "swiglu" else 1
        norm_out = np.where(g.precision == FP32, big * h * 2, e * h * (3 + consumers))
        # luban's sequence parallel all-gathers the norm outputs before the linears, which save
        # them whole (Megatron instead re-gathers them in backward): only norm inputs shrink
        replicated = 2 * norm_saved / rep_div + norm_out
        mlp = (4 if cfg.activation == "swiglu" else 2) * e * f
        core_out = e * q
        core = np.where(g.cp > 1, ring_attention_bytes(problem, g), e * 3 * q + 4 * a)
        none = replicated + (core + core_out + mlp) / t
        selective = replicated + (e * (q + 2 * kv) + core_out + mlp) / t
        full = big * h / rep_div
        fixed_none = np.where(g.precision == FP32, 0.0, 2.0 * problem.derived["layer_matmul_weights"] / t)
    share = recomputed_share(problem, g)  # full:k keeps the other layers' activations
    fixed = (1 - share) * fixed_none
    full = share * full + (1 - share) * none
    per_token = np.where(g.recompute == NO_RECOMPUTE, none, np.where(g.recompute == SELECTIVE, selective, full))
    return {"per_token": per_token, "fixed": fixed, "none": none, "selective": selective, "fixed_none": fixed_none,
            "e": e}


def ring_attention_bytes(problem: Problem, g: Grid):
    """Bytes per token (before the tp split) that luban's ring attention saves in one layer
    (luban/parallel/context_parallel.py: fp32 math-path blocks, no flash kernel).

    Per ring step j of c: the received K/V block (2·4q; step 0 the stacked local one), the
    masked scores and their softmax (2·4·a·s/c), the block's log-sum-exp (4a) and output (4q);
    each merge after the first keeps two exp factors (8a), and from the third step on the
    running output and log-sum-exp (4q + 4a); plus the fp32 query (4q) and the causal mask
    of each step (c·(s/c)/b bytes per token).
    """
    cfg, c = problem.model, g.cp
    q, a = cfg.q_dim, cfg.heads
    keys = problem.seq / c
    per_step = 8 * q + 8 * a * keys + 4 * a + 4 * q
    merges = (c - 1) * 8 * a + np.maximum(c - 2, 0) * (4 * q + 4 * a)
    return 4 * q + c * per_step + merges + c * keys / g.micro_batch


def recomputed_share(problem: Problem, g: Grid):
    """Share of layers whose forward is repeated (``full:k`` recomputes every k-th layer)."""
    layers = problem.model.layers
    return np.where(g.recompute == FULL, -(-layers // g.recompute_every) / layers, 0.0)


def extra_activation_bytes(problem: Problem, g: Grid, e) -> tuple:
    """Per micro-batch bytes outside the layers on the first and the last rank, as (per-token,
    fixed) pairs: embedding output and token ids; final norm, LM-head input and fp32 logits."""
    cfg = problem.model
    h, t = cfg.hidden, g.tp
    rep_div = np.where(g.sp, t, 1)
    logits = 4.0 * cfg.vocab / t
    if problem.runtime == "megatron":
        first_tok, first_fix = h / rep_div, 0.0  # embedding dropout mask
        last_tok, last_fix = 2 * e * h / rep_div + logits, 0.0
    else:
        big = 4.0
        norm_saved = big * h + 8 if cfg.norm == "layernorm" else 2 * big * h + 4
        rope = 8.0 * problem.seq * cfg.head_dim if cfg.position == "rope" else 8.0 * problem.seq
        every_layer_recomputed = (g.recompute == FULL) & (g.recompute_every == 1) & (cfg.position == "rope")
        first_tok, first_fix = 8.0, np.where(every_layer_recomputed, 0.0, rope)
        last_tok = norm_saved / rep_div + np.where(g.precision == FP32, big, e) * h + logits + 8.0
        last_fix = np.where(g.precision == FP32, 0.0, 2.0 * cfg.vocab * h / t)
    return (first_tok, first_fix), (last_tok, last_fix)


def microbatches(problem: Problem, g: Grid):
    return problem.global_batch // (g.dp * g.micro_batch)


def in_flight(g: Grid, m) -> tuple:
    """Micro-batches whose activations the first and the last pipeline rank hold at the peak,
    in units of one micro-batch through the rank's whole share of layers.

    1F1B / interleaved (Narayanan et al. 2021; Megatron's warm-up count): rank r holds
    ((p−r−1)·2 + (v−1)·p + 1)/v for v > 1 and p − r for v = 1; on the first rank this is
    p·(1 + (p−1)/(p·v)), Korthikanti et al. 2022 Sec. 4.2.3. GPipe holds all m. Zero-bubble
    (ZB-V, Qi et al. 2023/2024) matches 1F1B's peak: p. DualPipeV (DeepSeek-V3, Table 2): p + 1.
    Capped at m.
    """
    p, v = g.pp, g.virtual_stages
    interleaved_first = ((p - 1) * 2 + (v - 1) * p + 1) / v
    interleaved_last = ((v - 1) * p + 1) / v
    first = np.where(v > 1, interleaved_first, p)
    last = np.where(v > 1, interleaved_last, 1)
    first = np.where(g.schedule == ZERO_BUBBLE, p, np.where(g.schedule == DUALPIPEV, p + 1, first))
    last = np.where(v_shaped(g), first, last)
    first = np.where(g.schedule == GPIPE, m, first)
    last = np.where(g.schedule == GPIPE, m, last)
    single = g.pp == 1
    return np.where(single, 1, np.minimum(first, m)), np.where(single, 1, np.minimum(last, m))


def head_grad_excess(problem: Problem, g: Grid, grad_b, shards):
    """luban, untied LM head under tensor parallel without data-parallel sharding: the head's
    gradient shard is a view of a full V×h buffer (measured: tests/plan/test_runtime_multirank.py),
    so the other (t−1)/t of it stays allocated."""
    cfg = problem.model
    return np.where((g.tp > 1) & (shards == 1), cfg.vocab * cfg.hidden * (1 - 1 / g.tp) * grad_b, 0.0)


def zero_shards(problem: Problem, g: Grid):
    """Ranks that share one copy of the model states: dp/dp_replicate; luban's context-parallel
    ranks join the sharding group (``dp_shard_cp``, luban/parallel/data_parallel.py)."""
    shards = g.dp // g.dp_replicate
    return shards * g.cp if problem.runtime == "luban" else shards


def memory(problem: Problem, g: Grid) -> dict:
    """Per-GPU bytes on the fuller of the first and the last pipeline rank."""
    system = problem.system
    m = microbatches(problem, g)
    tokens = g.micro_batch * problem.seq / g.cp
    fsdp = problem.runtime == "luban"
    shards = zero_shards(problem, g)
    wb, gb, ob = param_bytes(problem.runtime, problem.optimizer_states, g.precision)
    act = activation_bytes(problem, g)
    (f_tok, f_fix), (l_tok, l_fix) = extra_activation_bytes(problem, g, act["e"])
    layers = rank_layers(problem, g)
    layer_mb = layers * (act["per_token"] * tokens + act["fixed"])
    inflight_first, inflight_last = in_flight(g, m)
    single = (g.pp == 1) | v_shaped(g)
    per_mb_first = layer_mb + f_tok * tokens + f_fix + np.where(single, l_tok * tokens + l_fix, 0.0)
    per_mb_last = np.where(single, per_mb_first, layer_mb + l_tok * tokens + l_fix)
    # full recompute re-creates one layer's activations at a time during the backward pass
    working = np.where(g.recompute == FULL, act["none"] * tokens + act["fixed_none"], 0.0)
    offload_opt = g.offload == 1
    offload_params = g.offload == 2
    ranks = {}
    params_first, params_last = rank_params(problem, g)
    for name, params, per_mb, flight in (("first", params_first, per_mb_first, inflight_first),
                                         ("last", params_last, per_mb_last, inflight_last)):
        weights, grads, optim = model_state_bytes(params, wb, gb, ob, g.zero, shards, fsdp)
        if fsdp and not problem.model.tie_embeddings:
            holds_head = single if name == "first" else True
            grads = grads + np.where(holds_head, head_grad_excess(problem, g, gb, shards), 0.0)
        host = np.where(offload_opt | offload_params, optim, 0.0) + np.where(offload_params, weights, 0.0)
        if fsdp:  # luban's optimizer offload also keeps host copies of the weight and gradient shards
            host = host + np.where(offload_opt, weights + grads, 0.0)
        optim_gpu = np.where(offload_opt | offload_params, 0.0, optim)
        weights_gpu = np.where(offload_params, 0.0, weights)
        activations = flight * per_mb + working
        full_layer = (problem.derived["layer_params"] / g.tp) * wb
        prefetch = np.where(g.zero >= 3, 2 * full_layer, 0.0)  # gathered layer + the next one
        msg = tokens * problem.model.hidden * act["e"]
        buffers = prefetch + np.where(g.tp > 1, msg, 0.0) + np.where(g.pp > 1, 2 * msg / g.tp, 0.0)
        if fsdp:
            buffers = buffers + fsdp_transients(params, wb, gb, g.zero, shards)
        other = system.framework_overhead_bytes + buffers
        total = weights_gpu + grads + optim_gpu + activations + other
        ranks[name] = dict(params=params, weights=weights_gpu, gradients=grads, optimizer=optim_gpu,
                           activations=activations, activation_per_microbatch=per_mb, other=other,
                           buffers=buffers, total=total, host=host, in_flight=flight,
                           weights_total=weights, optimizer_total=optim)
    pick_first = ranks["first"]["total"] >= ranks["last"]["total"]
    total = np.where(pick_first, ranks["first"]["total"], ranks["last"]["total"])
    host = np.where(pick_first, ranks["first"]["host"], ranks["last"]["host"])
    fits_hbm = total <= system.hbm_bytes
    fits_host = host <= system.host_bytes / system.gpus_per_node
    # per-rank figures stay in "first"/"last"; ``at_rank`` picks the fuller rank of one layout
    return {"first": ranks["first"], "last": ranks["last"], "pick_first": pick_first, "total": total,
            "host": host, "params": np.maximum(params_first, params_last), "microbatches": m,
            "fits_hbm": fits_hbm, "fits_host": fits_host, "fits": fits_hbm & fits_host}


def at_rank(mem: dict, key: str, shape: tuple, index=()):
    """``key`` on the fuller pipeline rank of the layout at ``index`` of a grid of ``shape``."""
    first = bool(np.broadcast_to(mem["pick_first"], shape)[index])
    return np.broadcast_to(mem["first" if first else "last"][key], shape)[index].item()
