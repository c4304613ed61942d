"""Step time: compute at size-dependent efficiency, collectives, pipeline bubble, DP, optimizer.

All functions take a ``Problem``, a ``Grid`` and the ``memory`` dict and return broadcast numpy
arrays of seconds. Ranks are laid out pp,dp,cp,tp (tensor parallel innermost): a group of n
ranks at stride k stays inside an NVLink domain when n·k <= the domain size.
Equations and sources: docs/planner.md.
"""

from __future__ import annotations

import numpy as np

from luban.parallel.layout import PRECISIONS
from luban.plan.grid import DUALPIPEV, FULL, GPIPE, INTERLEAVED, ONE_F_ONE_B, SELECTIVE, ZERO_BUBBLE, Grid
from luban.plan.memory import activation_bytes, param_bytes, rank_layers, recomputed_share, zero_shards
from luban.plan.problem import Problem

ALL_REDUCE, GATHER, P2P = "all-reduce", "all-gather", "p2p"


def collective(problem: Problem, nbytes, n, intra, kind: str):
    """Seconds for a ring collective over ``n`` ranks of a ``nbytes`` buffer.

    Ring all-reduce moves 2(n−1)/n·M per rank in 2(n−1) steps; all-gather and reduce-scatter
    (n−1)/n·M in n−1 steps; a point-to-point send M in 1 step (Thakur et al. 2005; NCCL docs).
    """
    s = problem.system
    factor, steps = {ALL_REDUCE: (2 * (n - 1) / n, 2 * (n - 1)), GATHER: ((n - 1) / n, n - 1),
                     P2P: (np.ones_like(n, dtype=float), np.ones_like(n))}[kind]
    bandwidth = np.where(intra, s.nvlink_bandwidth, s.internode_bandwidth)
    latency = np.where(intra, s.nvlink_latency, s.internode_latency) + cpu_stall(problem)
    seconds = steps * latency + factor * nbytes / (bandwidth * s.collective_efficiency(nbytes))
    return np.where(n > 1, seconds, 0.0)


def compute_seconds(problem: Problem, flops, size, precision_peak):
    return flops / (precision_peak * problem.system.matmul_efficiency(size))


def peak_flops(problem: Problem, g: Grid):
    """Dense FLOP/s per GPU of each layout's precision."""
    peaks = np.array([problem.system.peak(p) for p in PRECISIONS])
    return peaks[g.precision]


def _rank_threads(problem: Problem) -> int:
    """t = rank_threads(cores, N): the torch threads ``luban train --nproc N`` gives each rank."""
    from luban.parallel.launch import rank_threads

    return rank_threads(int(problem.system.cpu["cores"]), problem.gpus)


def oversubscription(problem: Problem) -> float:
    """N·t/cores for the N ranks of a CPU run of luban (1 without a ``[cpu]`` table or for
    ``runtime="megatron"``)."""
    cpu = problem.system.cpu
    if not cpu or problem.runtime != "luban":
        return 1.0
    return problem.gpus * _rank_threads(problem) / cpu["cores"]


def cpu_stall(problem: Problem) -> float:
    """Seconds each ring step of a collective waits for peers the oversubscribed cores are not
    running: ``oversubscribed_stall_s`` × (N·t/cores − 1), 0 when the ranks fit the cores."""
    over = oversubscription(problem)
    return problem.system.cpu["oversubscribed_stall_s"] * (over - 1) if over > 1 else 0.0


def cpu_terms(problem: Problem) -> dict:
    """What a CPU run of luban costs beyond FLOPs and bytes (profile ``[cpu]``; docs/planner.md).

    Every rank of ``luban train --nproc N`` runs on this host with ``t = rank_threads(cores, N)``
    torch threads (``luban.parallel.launch``). ``contend``: how much slower its framework
    overheads run than in the probe's single process, max(1, N·t/cores)^γ (γ,
    ``oversubscription_exponent``, measured by the probe); ``slow``: the same for its kernels,
    which also run on fewer threads than the probe's T: Amdahl's law fitted to the reference
    micro-batch on T threads and on one, time(t) = serial + parallel/t; ``layer``/``rest``:
    framework seconds of one forward + backward per layer and for the rest of the model per
    micro-batch (ATen ops × seconds per op,
    ``luban.plan.overhead``), ``tp_layer``/``tp_rest`` the same under tensor parallelism (DTensor
    dispatch); ``tensor``/``dtensor``: seconds per parameter tensor of the optimizer step, plain
    or DTensor (FSDP2 or tp parameters); ``fsdp_group``:
    seconds of FSDP2's hooks per group and micro-batch.
    GPU profiles and ``runtime="megatron"``: slow 1, no overheads.
    """
    cpu = problem.system.cpu
    if not cpu or problem.runtime != "luban":
        return {"slow": 1.0, "contend": 1.0, "layer": 0.0, "rest": 0.0, "tp_layer": 0.0, "tp_rest": 0.0,
                "layer_tensors": 0.0, "rest_tensors": 0.0, "tensor": 0.0, "dtensor": 0.0, "fsdp_group": 0.0}
    from luban.plan.overhead import model_overhead_counts

    counts = model_overhead_counts(problem.model)
    op = cpu["op_overhead_s"]
    contend = max(1.0, oversubscription(problem)) ** cpu["oversubscription_exponent"]
    return {"slow": contend * thread_slowdown(cpu, _rank_threads(problem)), "contend": contend,
            "layer": counts["layer_ops"] * op, "rest": counts["rest_ops"] * op,
            "tp_layer": counts["layer_ops"] * cpu["tp_op_overhead_s"], "tp_rest": counts["rest_ops"] * cpu["tp_op_overhead_s"],
            "layer_tensors": counts["layer_tensors"], "rest_tensors": counts["rest_tensors"],
            "tensor": cpu["tensor_overhead_s"], "dtensor": cpu["dtensor_tensor_overhead_s"],
            "fsdp_group": cpu["fsdp_group_overhead_s"]}


def thread_slowdown(cpu: dict, threads: int) -> float:
    """time(threads) / time(T) of the probe's reference micro-batch under Amdahl's law, from its
    times on T = ``cpu["threads"]`` threads and on one (1 when T = 1)."""
    many, one, big = cpu["reference_s"], cpu["reference_one_thread_s"], cpu["threads"]
    if big <= 1 or threads >= big:
        return 1.0
    parallel = (one - many) / (1 - 1 / big)
    return (one - parallel + parallel / threads) / many


def step_time(problem: Problem, g: Grid, mem: dict) -> dict:
    s, d, cfg = problem.system, problem.derived, problem.model
    t, c, p, v, dp = g.tp, g.cp, g.pp, g.virtual_stages, g.dp
    m = mem["microbatches"]
    tokens = g.micro_batch * problem.seq / c
    peak = peak_flops(problem, g)
    hbm = s.hbm_bandwidth * s.efficiency["hbm_efficiency"]
    traffic = s.efficiency["elementwise_traffic"]
    act = activation_bytes(problem, g)
    n = rank_layers(problem, g)
    cpu = cpu_terms(problem)
    slow, contend = cpu["slow"], cpu["contend"]

    # one layer, one micro-batch, forward (backward = 2x: input and weight gradients); on a CPU
    # the rank's share of the cores slows everything, and a third of the fwd+bwd framework
    # overhead is counted here (the backward's 2x carries the rest)
    mm_flops = tokens * d["layer_matmul_flops"] / t
    mm = slow * compute_seconds(problem, mm_flops, mm_flops / 4, peak)
    attn_flops = tokens * d["attention_flops"] / t
    attn = slow * compute_seconds(problem, attn_flops, attn_flops / 2, peak)
    elementwise = slow * traffic * act["none"] * tokens / hbm
    layer_fwd = mm + attn + elementwise + contend * np.where(t > 1, cpu["tp_layer"], cpu["layer"]) / 3
    head_flops = tokens * d["head_flops"] / t
    head_fwd = (slow * (compute_seconds(problem, head_flops, head_flops, peak) + traffic * 4.0 * cfg.vocab / t * tokens / hbm)
                + contend * np.where(t > 1, cpu["tp_rest"], cpu["rest"]) / 3)

    # tensor (+ sequence) parallel: 2 all-reduces (or all-gather + reduce-scatter pairs) each way
    msg = tokens * cfg.hidden * act["e"]
    tp_one = 2 * collective(problem, msg, t, t <= s.nvlink_domain, ALL_REDUCE)
    # context parallel: ring exchange of K and V chunks, hidden behind the attention core
    kv_msg = 2 * tokens * cfg.kv_dim * act["e"] / t
    cp_intra = t * c <= s.nvlink_domain
    cp_fwd = np.maximum(0.0, (c - 1) * collective(problem, kv_msg, c, cp_intra, P2P) - attn)
    cp_bwd = np.maximum(0.0, (c - 1) * collective(problem, 2 * kv_msg, c, cp_intra, P2P) - 2 * attn)

    share = recomputed_share(problem, g)
    selective_redo = attn + traffic * (act["none"] - act["selective"]) * tokens / hbm
    recompute = np.where(g.recompute == FULL, share * layer_fwd, np.where(g.recompute == SELECTIVE, selective_redo, 0.0))
    comm_redo = np.where(g.recompute == FULL, share * (tp_one + cp_fwd), 0.0)

    fwd = n * layer_fwd + head_fwd
    bwd = 2 * fwd
    rc = n * recompute
    tp_mb = n * (2 * tp_one + np.where(g.recompute == FULL, share * tp_one, 0.0))
    cp_mb = n * (cp_fwd + cp_bwd + np.where(g.recompute == FULL, share * cp_fwd, 0.0))
    F = fwd + n * (tp_one + cp_fwd)
    B = bwd + rc + n * (tp_one + cp_bwd + comm_redo)
    W = n * mm + head_fwd  # weight-gradient GEMMs, deferrable by zero-bubble schedules

    bubble = pipeline_bubble(g, F, B, W)
    pp_msg = msg / t
    pp_intra = t * c * dp * p <= s.nvlink_domain
    pp_comm = np.where(p > 1, 2 * (m * v + p - 1) * collective(problem, pp_msg, 2 * np.ones_like(p), pp_intra, P2P),
                       0.0) * (1 - s.efficiency["pp_overlap"])

    # data parallel (ZeRO Sec. 7: stages 0-2 move 2Ψ per step, stage 3 3Ψ per micro-batch pass)
    wb, gb, ob = param_bytes(problem.runtime, problem.optimizer_states, g.precision)
    params = mem["params"]
    dp_intra = t * c * dp <= s.nvlink_domain
    grads = params * gb
    gathers, reductions, groups = dp_collective_counts(problem, g, m, n)
    sharded = (gathers * collective(problem, params * wb / groups, dp, dp_intra, GATHER)
               + reductions * collective(problem, grads / groups, dp, dp_intra, GATHER))
    hooks = np.where(dp > 1, cpu["contend"] * m * groups * cpu["fsdp_group"], 0.0)  # FSDP2 on a CPU
    dp_total = np.where(g.zero == 0, collective(problem, grads, dp, dp_intra, ALL_REDUCE), sharded + hooks)
    busy = m * (F + B)
    hidden = np.where(g.zero >= 3, np.minimum(dp_total, s.efficiency["zero3_overlap"] * busy),
                      np.minimum(dp_total, s.efficiency["dp_overlap"] * B))
    if problem.runtime == "luban":  # per step: loss, gradient-norm and suspend-flag all-reduces of a scalar
        world = np.asarray(problem.gpus)
        dp_total = dp_total + 3 * collective(problem, 8.0, world, world <= s.nvlink_domain, ALL_REDUCE)

    # optimizer step: memory-bound over the local shard (on the host when offloaded)
    shards = zero_shards(problem, g)
    shard = params / np.where(g.zero >= 1, shards, 1)
    offloaded = g.offload >= 1
    host_bw = s.host_bandwidth / s.gpus_per_node
    tensors = n * cpu["layer_tensors"] + cpu["rest_tensors"]
    optimizer = (slow * np.where(offloaded, 2 * shard * (ob + gb) / host_bw, 2 * shard * (wb + gb + ob) / hbm)
                 + contend * tensors * np.where((t > 1) | ((dp * c > 1) & (g.zero >= 1)), cpu["dtensor"], cpu["tensor"]))
    link = s.host_link_bandwidth
    fetch = np.where(g.offload == 2, m * 2 * params / shards * wb / link, 0.0)
    offload = np.where(offloaded, shard * (gb + wb) / link, 0.0) + np.maximum(0.0, fetch - s.efficiency["zero3_overlap"] * busy)

    parts = {"forward": m * fwd, "backward": m * bwd, "recompute": m * rc, "tp_comm": m * tp_mb, "cp_comm": m * cp_mb,
             "pp_p2p": pp_comm, "pipeline_bubble": bubble, "dp_comm": dp_total - hidden, "optimizer": optimizer,
             "offload": offload}
    step = sum(parts.values())
    return {"parts": parts, "step": step, "dp_hidden": hidden, "F": F, "B": B, "W": W}


def dp_collective_counts(problem: Problem, g: Grid, m, n):
    """(all-gathers of weights, reduce-scatters of gradients per step, groups each is split into)
    for ZeRO stages >= 1 on the busiest rank.

    megatron (ZeRO Sec. 7): stages 1-2 one reduce-scatter and one all-gather per step, stage 3
    two all-gathers and one reduce-scatter per micro-batch, each over the whole model. luban
    (``luban.parallel.data_parallel``): FSDP2 groups, one per block and one for the rest of the
    stage, each issuing its own collectives; every micro-batch's forward gathers each group
    (backward again at stage 3), and the gradients are reduce-scattered per micro-batch at stages
    2-3, once per step at stage 1.
    """
    if problem.runtime == "luban":
        groups = n + 1
        return m * groups * np.where(g.zero >= 3, 2, 1), groups * np.where(g.zero >= 2, m, 1), groups
    return np.where(g.zero >= 3, 2 * m, 1), np.where(g.zero >= 3, m, 1), 1


def pipeline_bubble(g: Grid, F, B, W):
    """Idle time of the slowest rank per step; F, B, W are one micro-batch on one rank.

    GPipe and 1F1B: (p−1)(F+B), the fraction (p−1)/m of Narayanan et al. 2021 Sec. 2.2;
    interleaved: (p−1)(F+B)/v; zero-bubble (Qi et al. 2023, ZB-H2 per chunk of a V schedule):
    (p−1)·max(0, F + B_in − 2W)/v with B_in = B − W; DualPipeV (DeepSeek-V3 report, Table 2):
    (p/2−1)·(F&B + B_in − 3W) per chunk of half a rank's layers, F&B = F + B_in + W.
    """
    p, v = g.pp, g.virtual_stages
    b_in = B - W
    flush = (p - 1) * (F + B)
    bubble = np.where((g.schedule == GPIPE) | (g.schedule == ONE_F_ONE_B), flush, 0.0)
    bubble = np.where(g.schedule == INTERLEAVED, flush / v, bubble)
    bubble = np.where(g.schedule == ZERO_BUBBLE, (p - 1) * np.maximum(0.0, F + b_in - 2 * W) / v, bubble)
    dual = np.maximum(0.0, p / 2 - 1) * np.maximum(0.0, (F + b_in + W) / 2 + b_in / 2 - 3 * W / 2)
    bubble = np.where(g.schedule == DUALPIPEV, dual, bubble)
    return np.where(p > 1, bubble, 0.0)
