"""Per-GPU memory: model states (ZeRO), activations (Korthikanti Table 2), buffers, overhead.

Mixtures of experts: a rank holds 1/ep of every MoE layer's routed experts (1/(ep·tp) under
megatron, whose expert tensor parallel size defaults to tp; luban replicates experts over tp)
and shards their states over the expert-data-parallel group (the ZeRO group / ep); a token's
k routed copies are saved at the experts' input and intermediate width, plus the router's
fp32 scores and the top-k indices and weights (routing buffers); dispatch and combine hold
send and receive buffers of the routed copies while the all-to-all runs.

Every function takes a ``Problem`` and a ``Grid`` of layouts and returns broadcast numpy arrays.
Equations, with their sources, are written out in docs/planner.md.
"""

from __future__ import annotations

import numpy as np

from luban.model import flops
from luban.parallel import schedules
from luban.plan import runtimes
from luban.plan.grid import (ACTIVATIONS_OFFLOAD, BLOCKS_OFFLOAD, FULL, NO_RECOMPUTE, OPTIMIZER_OFFLOAD, PARAMS_OFFLOAD,
                             SELECTIVE, Grid)
from luban.plan.problem import Problem


def param_bytes(runtime: str, states: int, precision, problem=None) -> tuple:
    """Bytes per parameter of (weights, gradients, optimizer state) before sharding: the
    runtime model's accounting (``luban.plan.runtimes``; ``problem``: its per-problem switches)."""
    return runtimes.get(runtime).param_bytes(states, precision, problem)


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
    unsharded from forward to backward, in the dtype they were gathered in (``weight_b``: the
    runtime's ``gather_bytes``, bf16 under ``param_dtype=bf16``); ZeRO-1 also accumulates full
    gradients until the one reduce-scatter of the step (luban/parallel/data_parallel.py)."""
    rest = params * (1 - 1 / shards)
    return np.where((zero == 1) | (zero == 2), rest * weight_b, 0.0) + np.where(zero == 1, rest * grad_b, 0.0)


# How a runtime splits the layers over pipeline stages (``Runtime.pipeline_split``): luban's own split
# (``luban.parallel.schedules``), Megatron's (``even_rank_layers``), torchtitan's (``torchtitan_rank_layers``)
PIPELINE_SPLITS = ("luban", "megatron", "torchtitan")


def rank_layers(problem: Problem, g: Grid) -> tuple:
    """Transformer layers on (pipeline rank 0, the last stage's rank, the busiest rank): the explicit
    ``pp_split``, else the runtime's split (``Runtime.pipeline_split``): luban's split and placement
    (``luban.parallel.schedules``), Megatron's (``even_rank_layers``) or torchtitan's
    (``torchtitan_rank_layers``), each falling back to luban's where it cannot split so."""
    if g.stage_layers is not None:
        return g.stage_layers
    balanced = schedules.rank_layers(problem.model.layers, g.pp, g.virtual_stages, problem.derived["head_layers"],
                                     g.schedule)
    split = problem.runtime_model.pipeline_split
    if split == "luban":
        return balanced
    if split == "megatron":
        return even_rank_layers(problem.model.layers, g.pp, g.virtual_stages, g.schedule, balanced)
    if split == "torchtitan":
        return torchtitan_rank_layers(problem.model.layers, g.pp, g.virtual_stages, g.schedule, balanced)
    raise ValueError(f"pipeline_split {split!r}: one of {PIPELINE_SPLITS}")


# torchtitan's ``parallelism.pipeline_parallel_first_stage_less_layers`` and ``..._last_stage_less_layers``
# (torchtitan/config/job_config.py, both default 1): the embedding and the norm + output each count as a layer
TORCHTITAN_END_WEIGHT = 1


def torchtitan_rank_layers(layers: int, pp, v, code, otherwise: tuple) -> tuple:
    """(rank 0, last-stage rank, busiest rank) layers under torchtitan's split
    (``generate_llm_fqn_per_model_part``, torchtitan/distributed/pipeline_parallel.py @02ef790): the
    embedding and the output count as ``TORCHTITAN_END_WEIGHT`` layers each, the ``layers + 2`` effective
    layers go ``e // S`` to each of the S stages and one more to each of the first ``e % S``, and the first
    and the last stage hold their share less one; placed by ``pipeline_module_split`` (loop: rank r holds
    r, r + pp, ...; V: r and 2pp − 1 − r). ``otherwise`` (luban's split) where torchtitan refuses the
    layout (fewer than one effective layer per stage)."""
    pp = np.asarray(pp)
    vshape = schedules.is_v(code)
    v = np.where(vshape, 2, np.asarray(v))
    stages = pp * v
    effective = layers + 2 * TORCHTITAN_END_WEIGHT
    per, extra = effective // stages, effective % stages
    w = TORCHTITAN_END_WEIGHT
    # loop: rank r holds stages r + k·pp, k < v, of which those below ``extra`` hold one more
    def extras(r):
        return np.clip(-(-(extra - r) // pp), 0, v)
    loop_first = v * per + extras(0) - w
    loop_last = v * per + extras(pp - 1) - w
    loop_middle = np.where(pp > 2, v * per + extras(1), 0)  # rank 1 holds the most among the middle ranks
    # V: rank 0 holds stage 0 and the last stage (never among the first ``extra``: extra < stages)
    v_first = 2 * per + (extra > 0) - 2 * w
    both = np.maximum(1, 2 * pp - extra) <= np.minimum(pp - 1, extra - 1)
    v_other = np.where(pp > 1, 2 * per + np.where(both, 2, np.where(extra > 1, 1, 0)), 0)
    first = np.where(vshape, v_first, loop_first)
    last = np.where(vshape, v_first, loop_last)
    most = np.maximum(np.maximum(first, last), np.where(vshape, v_other, loop_middle))
    split = (per >= w) & (pp > 1)
    return tuple(np.where(split, x, other) for x, other in zip((first, last, most), otherwise))


def even_rank_layers(layers: int, pp, v, code, otherwise: tuple) -> tuple:
    """(rank 0, last-stage rank, busiest rank) layers under Megatron's split: layers / stages on every
    stage (Megatron-Core ``transformer_block.get_num_layers_to_build``, which requires the division), and
    where they do not divide but layers + 2 do, the embedding and the loss counted as one layer each: the
    first and the last stage one layer fewer (Megatron-Core ``account_for_embedding_in_pipeline_split`` and
    ``account_for_loss_in_pipeline_split``, which Megatron-Bridge's recipes set for such models; DeepSpeed's
    ``--pp-partition-method 'type:transformer|embedding'``, BLOOM's; Llama 3's "one fewer layer on the first
    and the last stage", Dubey et al. 2024 Sec. 3.3.2); ``otherwise`` (luban's split) where neither divides.
    Loop placement: the first and the last stage sit on ranks 0 and pp − 1; V: both on rank 0."""
    pp = np.asarray(pp)
    vshape = schedules.is_v(code)
    v = np.where(vshape, 2, np.asarray(v))
    stages = pp * v
    even = layers % stages == 0
    fewer = ~even & ((layers + 2) % stages == 0)  # the first and the last stage hold one layer fewer
    per_stage = np.where(even, layers // stages, (layers + 2) // stages)
    full = v * per_stage  # a rank holding neither end
    ends = np.where(vshape, full - 2 * fewer, full - fewer)  # rank 0 (and the last stage's rank)
    most = np.where(vshape | (pp > 2), np.maximum(full, ends), ends)
    single = pp == 1
    split = (even | fewer) & ~single
    return tuple(np.where(split, x, other) for x, other in zip((ends, ends, most), otherwise))


def expert_split(problem: Problem, g: Grid):
    """Ranks one MoE layer's routed experts are split over: ep (x tp where the runtime splits
    experts by tensor parallel, ``Runtime.expert_tp``)."""
    return g.ep * (g.tp if problem.runtime_model.expert_tp else 1)


def expert_work_split(problem: Problem, g: Grid):
    """Tensor-parallel ranks that share one MoE layer's expert work (GEMM FLOPs, saved activations)
    on top of ep: tp where the experts are split by width (``Runtime.expert_tp``) and where they are
    folded (``Runtime.ep_folding``: expert-TP 1, but each rank dispatches only its sequence-parallel
    1/tp of the tokens, so the tp ranks' tokens reach different experts); 1 where tensor parallel
    replicates the MoE (luban: every tp rank runs all its tokens through its experts)."""
    rt = problem.runtime_model
    return g.tp if rt.expert_tp or rt.ep_folding else np.ones_like(g.tp)


def expert_rows(problem: Problem, g: Grid):
    """(share, capped): the rows a MoE layer's routed experts compute on a rank per routed
    assignment (k per token), and where a capacity bounds them. Dropless: share 1, and the busiest
    expert-parallel rank paces the layer (``expert_imbalance``). Under a capacity C
    (``flops.expert_capacity`` of the T tokens a rank routes per micro-batch) every expert computes
    a fixed buffer of C rows, zero-padded, and sends them through expert parallel's all-to-all
    (``luban.model.moe.MoE.capped``; GShard's): E·C/(T·k) rows per assignment on every rank alike,
    so no rank is busier than another."""
    cfg = problem.model
    ones = np.ones_like(g.micro_batch, dtype=float)
    if not cfg.moe or not cfg.capacity_factor:
        return ones, ones < 0
    tokens = g.micro_batch * problem.seq / g.cp / np.where(problem.runtime_model.ep_folding, g.tp, 1)
    capacity = flops.expert_capacity(cfg.capacity_factor, tokens, cfg.experts_per_token, cfg.experts)
    capped = capacity > 0
    return np.where(capped, cfg.experts * capacity / (tokens * cfg.experts_per_token), 1.0), capped


def rank_experts(problem: Problem, g: Grid) -> tuple:
    """Routed-expert parameters held by the first and by the last pipeline rank."""
    first_layers, last_layers, _ = rank_layers(problem, g)
    per_layer = problem.derived["layer_experts"] / expert_split(problem, g)
    single = (g.pp == 1) | schedules.is_v(g.schedule)
    return first_layers * per_layer, np.where(single, first_layers, last_layers) * per_layer


def rank_params(problem: Problem, g: Grid) -> tuple:
    """Parameters held by the first and by the last pipeline rank (tensor parallel splits the
    weight matrices and the vocabulary, not the norms and output biases; the routed experts
    are ``rank_experts``)."""
    d = problem.derived
    layer = (d["layer_params"] - d["layer_replicated"]) / g.tp + d["layer_replicated"]
    layer = layer + d["layer_experts"] / expert_split(problem, g)
    first_layers, last_layers, _ = rank_layers(problem, g)
    head = d["embedding"] / g.tp  # the untied LM head, or the copy of a tied one on the last stage
    embed = d["embedding"] / g.tp + d["positions"]
    # one stage holding both ends shares a tied head; a V-shaped rank 0 builds the first and the
    # last stage as two modules, so its tied head is a second copy (luban.parallel.pipeline)
    tail = d["norm"] + np.where(problem.model.tie_embeddings & (g.pp == 1), 0.0, head)
    single = (g.pp == 1) | schedules.is_v(g.schedule)
    first = first_layers * layer + embed + np.where(single, tail, 0.0)
    last = np.where(single, first, last_layers * layer + d["norm"] + head)
    return first, last


def activation_bytes(problem: Problem, g: Grid) -> dict:
    """Saved activations of one transformer layer for one micro-batch on one rank.

    Returns bytes ``per_token`` (multiply by the rank's tokens b·s/cp) and ``fixed`` bytes per
    micro-batch (autocast weight copies); ``none`` is the no-recompute amount (the working set of
    a layer being recomputed). What one layer saves is the runtime model's
    (``Runtime.layer_activations``); this applies the recompute choice.
    """
    layer = problem.runtime_model.layer_activations(problem, g)
    none, selective = layer["none"], layer["selective"]
    share = recomputed_share(problem, g)  # full:k keeps the other layers' activations
    fixed = np.where(g.recompute == SELECTIVE, layer.get("fixed_selective", layer["fixed_none"]),
                     (1 - share) * layer["fixed_none"])
    full = share * layer["full"] + (1 - share) * none
    per_token = np.where(g.recompute == NO_RECOMPUTE, none, np.where(g.recompute == SELECTIVE, selective, full))
    # bytes per token of a layer's saved activations that stay on the device under activation
    # offload (selective recompute's cache in luban's runtime: ``selective_resident``)
    resident = np.where(g.recompute == SELECTIVE, layer.get("selective_resident", 0.0), 0.0)
    return {"per_token": per_token, "fixed": fixed, "none": none, "selective": selective,
            "fixed_none": layer["fixed_none"], "resident": resident, "e": layer["e"]}


def moe_activation_bytes(problem: Problem, g: Grid, e, per_width: int, token_copies: int):
    """Bytes per token (average layer) that a MoE feed-forward saves: for each of the k routed
    copies and each shared expert ``per_width`` tensors of the expert width (megatron 3 / luban
    4 for SwiGLU, as the dense MLP), ``token_copies`` hidden-size copies of each routed token
    (the experts' input; luban also the combine's weighted output), and the routing buffers:
    fp32 router logits and probabilities (8E) and the top-k indices and weights (8k + 4k).
    Split by tp where the experts' work is (``expert_work_split``: megatron by width, megatron-core
    folded by tokens; in both the router runs on the rank's sequence-parallel shard), not where it is
    replicated (luban)."""
    cfg = problem.model
    if not cfg.moe:
        return 0.0
    k, fe = cfg.experts_per_token, cfg.expert_ffn_hidden
    tp_split = expert_work_split(problem, g)
    # a capacity's zero-padded buffer rows are saved too: the experts' tensors and input (the first
    # token copy); the combine's (luban's second) is of the T·k rows gathered back
    rows = expert_rows(problem, g)[0]
    experts = ((k * rows + cfg.shared_experts) * per_width * e * fe
               + (rows + token_copies - 1) * k * e * cfg.hidden) / tp_split
    routing = (8.0 * cfg.experts + 12.0 * k) / tp_split  # the router sees the rank's sequence-parallel shard
    return problem.derived["moe_share"] * (experts + routing)


def all_to_all_bytes(problem: Problem, g: Grid, e):
    """Bytes per token of one MoE layer's dispatch (or combine): the k routed copies of the
    token's hidden state (0 without expert parallel: the tokens stay on the rank)."""
    cfg = problem.model
    return np.where(g.ep > 1, cfg.experts_per_token * cfg.hidden * e, 0.0) if cfg.moe else np.zeros_like(g.ep, float)


def recomputed_share(problem: Problem, g: Grid):
    """Share of layers whose forward is repeated (``full:k`` recomputes every k-th layer)."""
    return np.where(g.recompute == FULL, flops.recomputed_share(problem.model.layers, g.recompute_every), 0.0)


def extra_activation_bytes(problem: Problem, g: Grid, e) -> tuple:
    """Per micro-batch bytes outside the layers on the first and the last rank, as (per-token,
    fixed) pairs (``Runtime.edge_activations``)."""
    return problem.runtime_model.edge_activations(problem, g, e)


def in_flight(g: Grid, m) -> tuple:
    """Micro-batches whose activations the first and the last pipeline rank hold at the peak, in
    units of one micro-batch through the rank's whole share of layers: each schedule's formula
    (``luban.parallel.schedules``), capped at m; 1 without a pipeline."""
    first, last = schedules.per_schedule(g.schedule, lambda s: s.in_flight(g.pp, g.virtual_stages, m))
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
    return shards * g.cp if problem.runtime_model.cp_shards else shards


def expert_zero_shards(problem: Problem, g: Grid):
    """Ranks sharing one copy of the routed experts' states. megatron: the ZeRO group over ep
    (the distributed optimizer shards over expert data parallel); luban: with ep > 1 the
    experts stay out of DDP/FSDP2, replicated over expert data parallel
    (``luban.parallel.expert_parallel``), with ep = 1 they are sharded like the rest."""
    shards = zero_shards(problem, g)
    if problem.runtime_model.experts_replicated_with_ep:
        return np.where(g.ep > 1, 1, shards)
    return np.maximum(shards * folded_tp(problem, g) // g.ep, 1)


def folded_tp(problem: Problem, g: Grid):
    """Tensor-parallel ranks that join expert data parallel: under Megatron-Core's MoE parallel folding
    (``Runtime.ep_folding``, expert-TP 1) the experts are whole on each rank and the expert ranks are
    ordered tp-ep-dp-pp over the same GPUs (``parallel_state`` expert rank generator), so expert data
    parallel is tp·dp·cp/ep; otherwise 1."""
    return g.tp if problem.runtime_model.ep_folding else 1


def activations_in_tier(g: Grid):
    """Layouts whose saved activations live in the offload tier (offload = activations or blocks)."""
    return (g.offload == ACTIVATIONS_OFFLOAD) | (g.offload == BLOCKS_OFFLOAD)


def host_state_offload(g: Grid):
    """Layouts whose optimizer (and with params, weights) live on the host (luban's runtime's offloads)."""
    return (g.offload == OPTIMIZER_OFFLOAD) | (g.offload == PARAMS_OFFLOAD)


def memory(problem: Problem, g: Grid) -> dict:
    """Per-GPU bytes on the fuller of the first and the last pipeline rank."""
    system = problem.system
    m = schedules.microbatches(problem.global_batch, g.dp, g.micro_batch)
    tokens = g.micro_batch * problem.seq / g.cp
    fsdp = problem.runtime_model.fsdp
    shards = zero_shards(problem, g)
    wb, gb, ob = problem.runtime_model.param_bytes(problem.optimizer_states, g.precision, problem)
    act = activation_bytes(problem, g)
    (f_tok, f_fix), (l_tok, l_fix) = extra_activation_bytes(problem, g, act["e"])
    layers_first, layers_last, _ = rank_layers(problem, g)
    layer_mb = act["per_token"] * tokens + act["fixed"]
    inflight_first, inflight_last = in_flight(g, m)
    single = (g.pp == 1) | schedules.is_v(g.schedule)
    # per micro-batch: bytes per token and fixed bytes (weight copies, tables) of the rank's share
    tok_first = layers_first * act["per_token"] + f_tok + np.where(single, l_tok, 0.0)
    tok_last = np.where(single, tok_first, layers_last * act["per_token"] + l_tok)
    fix_first = layers_first * act["fixed"] + f_fix + np.where(single, l_fix, 0.0)
    fix_last = np.where(single, fix_first, layers_last * act["fixed"] + l_fix)
    # where a pipeline step makes the fixed bytes once (Runtime.pipeline_fixed_once), a micro-batch's
    # share is 1/m of them (what the runtime measures: a step's saved bytes over its micro-batches)
    fixed_once = problem.runtime_model.pipeline_fixed_once & (g.pp > 1)
    fix_share = np.where(fixed_once, 1.0 / np.maximum(m, 1), 1.0)
    per_mb_first = tok_first * tokens + fix_share * fix_first
    per_mb_last = tok_last * tokens + fix_share * fix_last
    # full recompute re-creates one layer's activations at a time during the backward pass
    working = np.where(g.recompute == FULL, act["none"] * tokens + act["fixed_none"], 0.0)
    offload_opt = g.offload == OPTIMIZER_OFFLOAD
    offload_params = g.offload == PARAMS_OFFLOAD
    tier_acts, tier_blocks = activations_in_tier(g), g.offload == BLOCKS_OFFLOAD
    ranks = {}
    params_first, params_last = rank_params(problem, g)
    experts_first, experts_last = rank_experts(problem, g)
    expert_shards = expert_zero_shards(problem, g)
    for name, params, per_mb, flight, tok, fix in (
            ("first", params_first, per_mb_first, inflight_first, tok_first, fix_first),
            ("last", params_last, per_mb_last, inflight_last, tok_last, fix_last)):
        held = flight * tok * tokens + np.where(fixed_once, fix, flight * fix)  # at the in-flight peak
        experts = experts_first if name == "first" else experts_last
        dense_states = model_state_bytes(params - experts, wb, gb, ob, g.zero, shards, fsdp)
        expert_states = model_state_bytes(experts, wb, gb, ob, g.zero, expert_shards, fsdp)
        weights, grads, optim = (a + b for a, b in zip(dense_states, expert_states))
        if problem.runtime_model.head_grad_view and not problem.model.tie_embeddings:
            holds_head = single if name == "first" else True
            grads = grads + np.where(holds_head, head_grad_excess(problem, g, gb, shards), 0.0)
        host = np.where(offload_opt | offload_params, optim, 0.0) + np.where(offload_params, weights, 0.0)
        if problem.runtime_model.offload_host_shards:  # the optimizer offload also keeps host copies of the weight and gradient shards
            host = host + np.where(offload_opt, weights + grads, 0.0)
        optim_gpu = np.where(offload_opt | offload_params, 0.0, optim)
        weights_gpu = np.where(offload_params, 0.0, weights)
        full_layer = (problem.derived["layer_params"] / g.tp) * wb
        # second memory tier (seed 003 §3, seed 002): every in-flight micro-batch's saved activations
        # (and with "blocks" all weights, gradients and optimizer state) live in the tier; the device
        # holds two blocks: the one computing and the one being fetched or written back
        layers = layers_first if name == "first" else layers_last
        resident_mb = layers * act["resident"] * tokens
        resident = flight * resident_mb  # in flight on the device all the same
        host = host + np.where(tier_acts, held - resident, 0.0) + np.where(tier_blocks, weights + grads + optim, 0.0)
        activations = np.where(tier_acts, 2 * layer_mb + resident, held) + working
        weights_gpu = np.where(tier_blocks, 2 * full_layer, weights_gpu)
        grads = np.where(tier_blocks, 2 * full_layer * gb / wb, grads)
        optim_gpu = np.where(tier_blocks, 0.0, optim_gpu)
        # the gathered copies are in the dtype the all-gather moves (``Runtime.gather_bytes``: FSDP's param_dtype)
        gathered_b = problem.runtime_model.gather_bytes(wb, g.precision, problem)
        prefetch = np.where((g.zero >= 3) & ~tier_blocks, 2 * full_layer * gathered_b / wb, 0.0)  # gathered layer + the next one
        msg = tokens * problem.model.hidden * act["e"]
        buffers = prefetch + np.where(g.tp > 1, msg, 0.0) + np.where(g.pp > 1, 2 * msg / g.tp, 0.0)
        buffers = buffers + problem.runtime_model.fp8_state_bytes(problem, g, layers)
        buffers = buffers + 2 * tokens * all_to_all_bytes(problem, g, act["e"])  # send + receive
        if fsdp:  # FSDP2's units: everything but expert-parallel experts
            buffers = buffers + fsdp_transients(params - np.where(g.ep > 1, experts, 0.0), gathered_b, gb, g.zero, shards)
        other = system.framework_overhead_bytes + buffers
        total = weights_gpu + grads + optim_gpu + activations + other
        ranks[name] = dict(params=params, weights=weights_gpu, gradients=grads, optimizer=optim_gpu,
                           activations=activations, activation_per_microbatch=per_mb, other=other,
                           activation_resident=np.where(tier_acts, resident_mb, 0.0),
                           layer_resident=np.where(tier_acts, act["resident"] * tokens, 0.0),
                           buffers=buffers, total=total, host=host, in_flight=flight, layer_activation=layer_mb,
                           weights_total=weights, optimizer_total=optim)
    pick_first = ranks["first"]["total"] >= ranks["last"]["total"]
    total = np.where(pick_first, ranks["first"]["total"], ranks["last"]["total"])
    host = np.where(pick_first, ranks["first"]["host"], ranks["last"]["host"])
    fits_hbm = total <= system.hbm_bytes
    fits_host = host <= system.offload_bytes
    # per-rank figures stay in "first"/"last"; ``at_rank`` picks the fuller rank of one layout
    return {"first": ranks["first"], "last": ranks["last"], "pick_first": pick_first, "total": total,
            "host": host, "params": np.maximum(params_first, params_last),
            "expert_params": np.maximum(experts_first, experts_last), "microbatches": m,
            "fits_hbm": fits_hbm, "fits_host": fits_host, "fits": fits_hbm & fits_host}


def at_rank(mem: dict, key: str, shape: tuple, index=()):
    """``key`` on the fuller pipeline rank of the layout at ``index`` of a grid of ``shape``."""
    first = bool(np.broadcast_to(mem["pick_first"], shape)[index])
    return np.broadcast_to(mem["first" if first else "last"][key], shape)[index].item()
