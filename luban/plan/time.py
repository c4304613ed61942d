"""Step time: compute at size-dependent efficiency, collectives, pipeline bubble, DP, optimizer.

All functions take a ``Problem``, a ``Grid`` and the ``memory`` dict and return broadcast numpy
arrays of seconds. Ranks are laid out pp,dp,cp,tp (tensor parallel innermost): a group of n
ranks at stride k stays inside an NVLink domain when n·k <= the domain size.
Equations and sources: docs/planner.md.

Mixtures of experts: the routed experts' GEMMs run at the size one expert sees (its share of
the tokens of the ep ranks it serves), paced by the busiest expert rank
(``problem.expert_imbalance``), or under a capacity factor on fixed buffers of C rows per expert,
zero-padded, on every rank alike (``memory.expert_rows``); each MoE layer adds a dispatch and a combine all-to-all forward
and again backward over the EP group, on NVLink when the group's ranks (ep at stride tp, inside
dp·cp) fit one NVLink domain, else over the network, not overlapped. The experts' gradients are
reduced over the expert-data-parallel group (dp·cp / ep under luban, dp / ep under megatron).
"""

from __future__ import annotations

import numpy as np

from luban.parallel.layout import PRECISIONS
from luban.parallel import schedules
from luban.plan import DEDUPLICATING
from luban.plan.grid import BLOCKS_OFFLOAD, FP32, FULL, PARAMS_OFFLOAD, SELECTIVE, Grid
from luban.plan.memory import (activation_bytes, activations_in_tier, all_to_all_bytes, expert_rows, expert_work_split, expert_zero_shards,
                               folded_tp, host_state_offload, rank_layers, recomputed_share, zero_shards)
from luban.plan.problem import Problem

ALL_REDUCE, GATHER, P2P = "all-reduce", "all-gather", "p2p"


def collective(problem: Problem, nbytes, n, intra, kind: str, local=1):
    """Seconds for a ring collective over ``n`` ranks of a ``nbytes`` buffer.

    Ring all-reduce moves 2(n−1)/n·M per rank in 2(n−1) steps; all-gather and reduce-scatter
    (n−1)/n·M in n−1 steps; a point-to-point send M in 1 step (Thakur et al. 2005; NCCL docs).

    A group that spans nodes with ``local`` of its ranks in each node (a data-parallel group at
    stride tp·cp: nvlink_domain/(tp·cp) of them) does not push its ring through one NIC: NCCL runs
    one ring per channel, each leaving the node once, through the NIC next to the GPU it leaves
    from, so the node's ``local`` NICs share the traffic and the ring's bus bandwidth is ``local``
    × the per-GPU network rate (capped by NVLink, which carries the rest of the ring). Measured:
    NVIDIA's NCCL team, DGX A100 with 8×200 Gb/s HDR, multi-node ring all-reduce 192 GB/s bus
    bandwidth (NVIDIA/nccl#812, 2023-03-31), i.e. 7.7× one 25 GB/s NIC; DGX-2 nodes with 1, 2 and 4
    GPUs (and NICs) per node all-reducing 1.6 GB in 363, 173 and 132 ms (NVIDIA/nccl#569); H100 with
    8×400 Gb/s, reduce-scatter 360 GB/s bus bandwidth on 4 nodes (NVIDIA/nccl#1229). ``local`` = 1 (one
    rank per node, or point-to-point) is one NIC per rank, as before.
    """
    s = problem.system
    factor, steps = {ALL_REDUCE: (2 * (n - 1) / n, 2 * (n - 1)), GATHER: ((n - 1) / n, n - 1),
                     P2P: (np.ones_like(n, dtype=float), np.ones_like(n))}[kind]
    network = np.minimum(s.internode_bandwidth * np.maximum(local, 1), s.nvlink_bandwidth)
    bandwidth = np.where(intra, s.nvlink_bandwidth, network)
    latency = np.where(intra, s.nvlink_latency, s.internode_latency) + cpu_stall(problem)
    seconds = steps * latency + factor * nbytes / (bandwidth * s.collective_efficiency(nbytes))
    return np.where(n > 1, seconds, 0.0)


# DeepEP's normal (training) kernels' measured link use, deepseek-ai/DeepEP docs/legacy.md "Performance"
# @dd758ca (H800, DeepSeek-V3 shapes): intranode dispatch 153 GB/s of ~160 GB/s NVLink; internode 43 GB/s
# of a ~50 GB/s CX7 400 Gb/s NIC at EP 16 (its EP 32/64 rows print 58 and 51 GB/s, more than the NIC
# carries: logical bytes, so the EP 16 figure is taken)
DEEPEP_NVLINK_EFFICIENCY = 153 / 160
DEEPEP_NETWORK_EFFICIENCY = 43 / 50


def all_to_all(problem: Problem, nbytes, n, stride, dispatcher: str = "alltoall"):
    """Seconds for an all-to-all of ``nbytes`` per rank over ``n`` ranks at ``stride``: each rank
    sends M/n to every peer in n−1 pairwise steps; the peers inside its NVLink domain
    (domain/stride of them) over NVLink, the others over the network, both at once (NCCL
    runs the pairs concurrently), so the slower of the two paces it, each link at the profile's
    collective efficiency. A MoE ``dispatcher`` that deduplicates (``DEDUPLICATING``: DeepEP,
    HybridEP) sends each token once per destination node (``deepep_network_share``); DeepEP's
    kernels use the links at their measured ``DEEPEP_NVLINK_EFFICIENCY`` and
    ``DEEPEP_NETWORK_EFFICIENCY``; both pay the link latency once per all-to-all, not per peer."""
    s = problem.system
    local = np.clip(s.nvlink_domain // stride, 1, n)
    stall = cpu_stall(problem)
    curve = s.collective_efficiency(nbytes)
    near_eff, far_eff = (DEEPEP_NVLINK_EFFICIENCY, DEEPEP_NETWORK_EFFICIENCY) if dispatcher == "deepep" else (curve, curve)
    # DeepEP's normal dispatch and combine are one kernel each whose warps serve every peer at once (RDMA
    # senders, NVLink forwarders and receivers: deepseek-ai/DeepEP csrc/kernels/internode.cu); HybridEP's
    # likewise (DeepEP docs/README_Hybrid-EP.md: warp-level pipelines in one kernel, no CPU-GPU
    # synchronisation), so the latency is paid once per link kind, not once per peer as in NCCL's pairwise steps
    dedup = dispatcher in DEDUPLICATING
    steps_near, steps_far = (np.minimum(local - 1, 1), np.minimum(n - local, 1)) if dedup else (local - 1, n - local)
    near = steps_near * (s.nvlink_latency + stall) + (local - 1) / n * nbytes / (s.nvlink_bandwidth * near_eff)
    network = (n - local) / n * nbytes * (deepep_network_share(problem, n, local) if dedup else 1.0)
    far = steps_far * (s.internode_latency + stall) + network / (s.internode_bandwidth * far_eff)
    return np.where(n > 1, np.maximum(near, far), 0.0)


def deepep_network_share(problem: Problem, n, local):
    """Network bytes of a node-deduplicating MoE dispatch (DeepEP's internode kernels: a token goes
    once to each other node holding one of its experts, then over NVLink to those GPUs; DeepSeek-V3
    report Sec. 3.2.2) over a per-expert all-to-all's. E experts evenly over n/local nodes, k of
    them per token, uniformly (forced balance): a token reaches each other node with probability
    1 − C(E − E/nodes, k)/C(E, k), against k·(n − local)/n copies per expert."""
    cfg = problem.model
    e, k = cfg.experts, cfg.experts_per_token
    nodes = np.maximum(n // np.maximum(local, 1), 1)
    per_node = e // nodes
    miss = np.ones_like(np.asarray(nodes, dtype=float))
    for i in range(k):  # C(E − E/nodes, k)/C(E, k) as a product (nodes = 1: nothing leaves the node)
        miss = miss * np.maximum(e - per_node - i, 0) / (e - i)
    dedup = (nodes - 1) * (1 - miss)
    per_expert = k * (n - local) / np.maximum(n, 1)
    return np.where(per_expert > 0, dedup / np.maximum(per_expert, 1e-12), 1.0)


def compute_seconds(problem: Problem, flops, size, precision_peak):
    return flops / (precision_peak * problem.system.matmul_efficiency(size))


def expert_gemm_seconds(problem: Problem, g: Grid, tokens, gemm_peak):
    """Seconds of the routed-expert GEMMs of one (average) layer on a rank, forward, for ``tokens``
    tokens: after dispatch each local expert sees tokens·k·ep/E rows, so its GEMMs run at
    ``matmul_efficiency`` of that size (more ep: fewer, larger GEMMs per rank); tensor parallel
    inside an expert divides both (megatron: tp), as does folding, where each rank dispatches only its
    sequence-parallel 1/tp of the tokens (``expert_work_split``; luban replicates the MoE over tp: none);
    the busiest EP rank paces the layer (``expert_imbalance``). bench/gpu_check.py section (f) times
    the same GEMMs."""
    d, cfg = problem.derived, problem.model
    etp = expert_work_split(problem, g)
    rows, capped = expert_rows(problem, g)  # a capacity: fixed buffers of C rows per expert, on every rank
    flops_ = rows * tokens * d["expert_flops"] / etp
    size = 2 * rows * tokens * g.ep * d["expert_share"] * cfg.hidden * cfg.expert_ffn_hidden / etp
    pace = np.where(capped, 1.0, problem.expert_imbalance)
    return pace * compute_seconds(problem, flops_, np.maximum(size, 1.0), gemm_peak)


def attention_share(problem: Problem) -> float:
    """Share of the GEMM curve the fused attention kernel reaches: the profile's FA2-class figure,
    times its FA3 speedup where the problem's kernel is FA3-class (1 on profiles without one)."""
    eff = problem.system.efficiency
    return eff["attention_matmul"] * (eff["attention_fa3_speedup"] if problem.attention_kernel == "fa3" else 1.0)


# elements a 16-bit GEMM's dimensions must be a multiple of for the aligned tensor-core kernels:
# 16 bytes (Hopper's TMA needs 16-byte-aligned strides, CUDA driver API cuTensorMapEncodeTiled;
# Inductor pads 16-bit GEMMs to 8 elements for the same reason, torch/_inductor/fx_passes/pad_mm.py)
GEMM_ALIGN_16BIT = 8


def unaligned_head_seconds(problem: Problem, g: Grid, tokens, peak):
    """Extra seconds per micro-batch when the LM head's vocabulary width is not a multiple of
    ``GEMM_ALIGN_16BIT`` (per tensor-parallel rank) and nothing pads it: neither the runtime
    (``Runtime.pads_vocab``) nor Inductor (the head compiled with the model, ``compiled is True``:
    ``shape_padding``). One of the head's three GEMMs a micro-batch then runs on a generic kernel
    at the profile's ``unaligned_gemm`` share of the peak instead of the GEMM curve (issue #22's
    H100 profile of GPT-2's 50,257-wide head: one GEMM a step on ``cutlass_75…s1688gemm``, the
    other two on aligned kernels). Profiles without ``unaligned_gemm`` (not measured) add nothing."""
    share = problem.system.efficiency.get("unaligned_gemm")
    rt = problem.runtime_model
    if not share or problem.system.cpu or rt.compiled(problem) is True:
        return 0.0
    unaligned = ((np.mod(problem.model.vocab, GEMM_ALIGN_16BIT * g.tp) != 0) & (g.precision != FP32)
                 & ~rt.pads_vocab(problem, g))
    one = tokens * problem.derived["head_flops"] / g.tp
    return np.where(unaligned, np.maximum(0.0, one / (peak * share) - compute_seconds(problem, one, one, peak)), 0.0)


def peak_flops(problem: Problem, g: Grid, gemm: bool = False):
    """Dense FLOP/s per GPU of each layout's precision. fp8 runs only the linear layers' GEMMs at
    the fp8 peak (``gemm=True``); attention and the MFU denominator use bf16 (TransformerEngine's
    fp8 dot-product attention is off by default; Llama 3 and Megatron-Bridge report MFU against
    the bf16 peak). A precision the profile lacks is a one-line error."""
    table = np.zeros(len(PRECISIONS))
    for i in np.unique(g.precision):
        name = PRECISIONS[int(i)]
        table[int(i)] = problem.system.peak("bf16" if name == "fp8" and not gemm else name)
        if name == "fp8" and gemm:  # what fp8 GEMMs reach of the size curve (profile, fitted on Hopper)
            table[int(i)] *= problem.system.efficiency["fp8_matmul"]
    return table[g.precision]


def _rank_threads(problem: Problem) -> int:
    """t = rank_threads(cores, N): the torch threads ``luban train --nproc N`` gives each rank."""
    from luban.parallel.launch import rank_threads

    return rank_threads(int(problem.system.cpu["cores"]), problem.gpus)


def oversubscription(problem: Problem) -> float:
    """N·t/cores for the N ranks of a CPU run of luban (1 without a ``[cpu]`` table or for
    a runtime model without CPU overheads)."""
    cpu = problem.system.cpu
    if not cpu or not problem.runtime_model.cpu_overheads:
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
    GPU profiles and runtime models other than luban: slow 1, no overheads.
    """
    cpu = problem.system.cpu
    if not cpu or not problem.runtime_model.cpu_overheads:
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
    s, d, cfg, rt = problem.system, problem.derived, problem.model, problem.runtime_model
    t, c, p, v, dp = g.tp, g.cp, g.pp, g.virtual_stages, g.dp
    m = mem["microbatches"]
    tokens = g.micro_batch * problem.seq / c
    peak, gemm_peak = peak_flops(problem, g), peak_flops(problem, g, gemm=True)
    hbm = s.hbm_bandwidth * s.efficiency["hbm_efficiency"]
    traffic = s.efficiency["elementwise_traffic"] * rt.traffic_scale(problem)
    act = activation_bytes(problem, g)
    _, last_n, most_n = rank_layers(problem, g)  # layers on the last stage's rank and on the busiest rank
    cpu = cpu_terms(problem)
    slow, contend = cpu["slow"], cpu["contend"]
    kernels = slow / rt.compute_speed  # the compute terms below: the rank's share of the cores, the runtime's speed

    # one layer, one micro-batch, forward (backward = 2x: input and weight gradients); on a CPU
    # the rank's share of the cores slows everything, and a third of the fwd+bwd framework
    # overhead is counted here (the backward's 2x carries the rest)
    mm_flops = tokens * d["layer_matmul_flops"] / t
    mm = kernels * compute_seconds(problem, mm_flops, mm_flops / 4, gemm_peak)
    if rt.skips_causal(problem):  # a fused kernel skips the masked half, at its own share of the GEMM curve;
        # handed an explicit mask tensor (``Runtime.masks_attention``) it computes every block
        attn_flops = tokens * d["attention_flops" if rt.masks_attention(problem) else "causal_attention_flops"] / t
        attn = kernels * compute_seconds(problem, attn_flops, attn_flops / 2, peak * attention_share(problem))
    else:
        attn_flops = tokens * d["attention_flops"] / t
        attn = kernels * compute_seconds(problem, attn_flops, attn_flops / 2, peak)
    elementwise = kernels * (traffic * act["none"] + rt.fp8_cast_bytes(problem, g) + rt.activation_extra_bytes(problem, g, act["e"])
                          ) * tokens / hbm
    # folded (Megatron-Core ``ep_folding``), each rank routes only its sequence-parallel shard of the tokens
    folded = rt.ep_folding
    ep_tokens = tokens / t if folded else tokens
    experts = kernels * (expert_gemm_seconds(problem, g, tokens, gemm_peak)
                      + moe_permutation_bytes(problem, act["e"]) * ep_tokens / hbm)
    layer_fwd = mm + experts + attn + elementwise + contend * np.where(t > 1, cpu["tp_layer"], cpu["layer"]) / 3
    head_flops = tokens * d["head_flops"] / t
    head_traffic = s.efficiency["elementwise_traffic"] * rt.traffic_scale(problem, head=True)
    head_fwd = (kernels * (compute_seconds(problem, head_flops, head_flops, peak) + head_traffic * 4.0 * cfg.vocab / t * tokens / hbm)
                + contend * np.where(t > 1, cpu["tp_rest"], cpu["rest"]) / 3)

    # tensor (+ sequence) parallel: 2 all-reduces (or all-gather + reduce-scatter pairs) each way
    msg = tokens * cfg.hidden * act["e"]
    tp_one = 2 * collective(problem, msg, t, t <= s.nvlink_domain, ALL_REDUCE, np.minimum(t, s.nvlink_domain))
    # exposed per layer, forward and backward (whose GEMMs take twice the forward's)
    overlap = rt.tp_overlap(problem)
    tp_fwd = rt.tp_exposed(g, tp_one, mm, overlap)
    tp_bwd = rt.tp_exposed(g, tp_one, 2 * mm, overlap and rt.tp_overlap_backward)
    # context parallel: ring exchange of K and V chunks, hidden behind the attention core
    kv_msg = 2 * tokens * cfg.kv_dim * act["e"] / t
    cp_intra = t * c <= s.nvlink_domain
    cp_ring_fwd = (c - 1) * collective(problem, kv_msg, c, cp_intra, P2P)
    cp_ring_bwd = (c - 1) * collective(problem, 2 * kv_msg, c, cp_intra, P2P)
    cp_fwd = np.maximum(0.0, cp_ring_fwd - attn)
    cp_bwd = np.maximum(0.0, cp_ring_bwd - 2 * attn)

    # expert parallel: dispatch + combine all-to-all per MoE layer (average layer: x moe_share);
    # the EP group's ranks sit at stride tp inside dp·cp, or (``Runtime.ep_folding``) on
    # consecutive ranks, each sending its sequence-parallel shard of the tokens
    rows, capped = expert_rows(problem, g)  # a capacity's buffers go through the all-to-all whole, zero rows too
    ep_one = (np.where(capped, 1.0, problem.expert_imbalance) * d["moe_share"] * 2
              * all_to_all(problem, rows * ep_tokens * all_to_all_bytes(problem, g, act["e"]), g.ep, 1 if folded else t,
                           dispatcher=problem.dispatcher))
    ep_all = ep_one  # before any overlap
    if problem.ep_overlap:  # Megatron-Core --overlap-moe-expert-parallel-comm: in the 1F1B steady state one
        # micro-batch's forward runs beside another's backward, and each side's dispatch and combine
        # hide behind the other's compute (3 layer forwards per pair, half of it per direction); an
        # upper bound on what the overlap hides (not fitted)
        ep_one = np.maximum(0.0, ep_one - 1.5 * layer_fwd)

    # a MoE layer whose forward waits on the device for its token counts (``moe_host_stall``) runs no
    # faster than its host issues it
    stall = moe_host_stall(problem, layer_fwd + tp_fwd + cp_fwd + ep_one)

    share = recomputed_share(problem, g)
    selective_redo = rt.selective_redo(problem, g, mm, attn, elementwise,
                                       attn + traffic * (act["none"] - act["selective"]) * tokens / hbm)
    recompute = np.where(g.recompute == FULL, share * layer_fwd, np.where(g.recompute == SELECTIVE, selective_redo, 0.0))
    comm_redo = np.where(g.recompute == FULL, share * (tp_fwd + cp_fwd + ep_one), 0.0)
    stall_redo = np.where(g.recompute == FULL, share * stall, 0.0)  # a recomputed forward waits again

    # the rank that paces the pipeline: the LM head (and its loss) runs only on the rank holding the
    # last stage (``luban.parallel.pipeline``: the last stage keeps the final norm and the head; a V-shaped
    # schedule puts it on rank 0, whose layers ``rank_layers`` reports as the last stage's), so the
    # busiest stage is the costlier of that rank (its layers + the head) and the rank with the most
    # layers (without it); one micro-batch, forward + backward (at pp = 1 both are the one rank)
    head_bwd = 2 * head_fwd + unaligned_head_seconds(problem, g, tokens, peak)
    layer_fb = (3 * layer_fwd + recompute + tp_fwd + tp_bwd + cp_fwd + cp_bwd + 2 * ep_one + comm_redo
                + stall + stall_redo)  # one layer's share of F + B below
    holds_head = last_n * layer_fb + head_fwd + head_bwd >= most_n * layer_fb
    n = np.where(holds_head, last_n, most_n)
    head = np.where(holds_head, 1.0, 0.0)  # 1 where the pacing rank holds the head

    fwd = n * layer_fwd + head * head_fwd
    bwd = 2 * n * layer_fwd + head * head_bwd
    rc = n * recompute
    tp_mb = n * (tp_fwd + tp_bwd + np.where(g.recompute == FULL, share * tp_fwd, 0.0))
    cp_mb = n * (cp_fwd + cp_bwd + np.where(g.recompute == FULL, share * cp_fwd, 0.0))
    ep_mb = n * (2 * ep_one + np.where(g.recompute == FULL, share * ep_one, 0.0))
    F = fwd + n * (tp_fwd + cp_fwd + ep_one + stall)
    B = bwd + rc + n * (tp_bwd + cp_bwd + ep_one + comm_redo + stall_redo)
    W = n * mm + head * head_fwd  # weight-gradient GEMMs, deferrable by zero-bubble schedules

    bubble = pipeline_bubble(g, F, B, W)
    pp_msg = msg / t
    pp_intra = t * c * dp * p <= s.nvlink_domain
    transfer = collective(problem, pp_msg, 2 * np.ones_like(p), pp_intra, P2P)
    pp_comm = np.where(p > 1, rt.pp_exposed(g, transfer, 2 * (m * v + p - 1), fwd / v), 0.0)

    # data parallel (ZeRO Sec. 7: stages 0-2 move 2Ψ per step, stage 3 3Ψ per micro-batch pass)
    wb, gb, ob = rt.param_bytes(problem.optimizer_states, g.precision, problem)
    params = mem["params"]
    gathers, reductions, groups = dp_collective_counts(problem, g, m, n)

    def data_parallel_sync(nbytes_params, ranks, stride, replicate=1):
        """(weight all-gathers, gradient reductions) of ``nbytes_params`` parameters over ``ranks``
        at ``stride``. ``replicate`` > 1 (hybrid sharding, ``dp_replicate``; ZeRO >= 2): the states shard
        over ranks/replicate consecutive ranks (FSDP2's HSDP mesh, torchtitan's ``dp_shard`` inner), which
        gather and reduce-scatter among themselves; each rank's reduced shard is then all-reduced over the
        ``replicate`` copies, at the stride of one shard group (FSDP2's post-backward: reduce-scatter, then
        all-reduce over the replicate dim)."""
        shard_ranks = ranks // replicate
        intra = stride * shard_ranks <= s.nvlink_domain
        local = np.clip(s.nvlink_domain // stride, 1, shard_ranks)  # the group's ranks (and NICs) per node
        grads = nbytes_params * gb
        gather = np.where(g.zero == 0, 0.0, gathers * collective(problem, nbytes_params * rt.gather_bytes(wb, g.precision, problem) / groups,
                                                                   shard_ranks, intra, GATHER, local))
        reduce = np.where(g.zero == 0, collective(problem, grads, ranks, intra, ALL_REDUCE, local),
                          reductions * collective(problem, grads / groups, shard_ranks, intra, GATHER, local))
        across = stride * shard_ranks  # the replicas' stride
        copies = reductions * collective(problem, grads / groups / shard_ranks, replicate, across * replicate <= s.nvlink_domain,
                                         ALL_REDUCE, np.clip(s.nvlink_domain // across, 1, replicate))
        return gather, reduce + np.where((g.zero > 0) & (replicate > 1), copies, 0.0)

    # the routed experts reduce over the expert-data-parallel group (dp / ep ranks; folded: tp·dp·cp / ep)
    # FSDP2 on a CPU: over dp > 1, and for offload = params on any dp (``data_parallel.uses_fsdp``: one process too)
    fsdp = (g.zero > 0) & ((dp > 1) | (g.offload == PARAMS_OFFLOAD))
    hooks = np.where(fsdp, cpu["contend"] * m * groups * cpu["fsdp_group"], 0.0)
    gather, reduce = data_parallel_sync(params - mem["expert_params"], dp, t * c, g.dp_replicate)
    if cfg.moe:  # expert data parallel: every ep-th data-parallel rank (folded: Megatron-Core's expert ranks
        # are ordered tp-ep-dp-pp with expert-TP 1, parallel_state.py, so the ep ranks are consecutive)
        expert_stride = g.ep if folded else t * c * g.ep
        expert_ranks = np.maximum(dp * folded_tp(problem, g) * (c if folded else 1) // g.ep, 1)
        expert_gather, expert_reduce = data_parallel_sync(mem["expert_params"], expert_ranks, expert_stride)
        gather, reduce = gather + expert_gather, reduce + expert_reduce
    dp_total = gather + reduce + hooks
    busy = m * (F + B)
    # what a runtime hides behind one micro-batch's forward or backward (``dp_hidden``) shares that compute
    # with what the tensor-, context- and expert-parallel overlaps above already hid behind it: their windows
    # are the pacing rank's compute less those (the gradient reduce had been hidden behind the whole
    # backward, exposed communication included, beside the TP traffic hidden behind its GEMMs)
    hid_f = n * ((tp_one - tp_fwd) + (cp_ring_fwd - cp_fwd) + (ep_all - ep_one) / 2)
    hid_b = n * ((tp_one - tp_bwd) + (cp_ring_bwd - cp_bwd) + (ep_all - ep_one) / 2)
    F_free = np.maximum(0.0, fwd - hid_f)
    B_free = np.maximum(0.0, bwd + rc - hid_b)
    hidden = rt.dp_hidden(problem, g, gather, reduce, F_free, B_free, busy)
    if rt.scalar_allreduces:  # per step: e.g. loss, gradient-norm and suspend-flag all-reduces of a scalar
        world = np.asarray(problem.gpus)
        dp_total = dp_total + rt.scalar_allreduces * collective(problem, 8.0, world, world <= s.nvlink_domain, ALL_REDUCE)

    # optimizer step: memory-bound over the local shard (on the host when offloaded)
    shards = zero_shards(problem, g)
    shard = ((params - mem["expert_params"]) / np.where(g.zero >= 1, shards, 1)
             + mem["expert_params"] / np.where(g.zero >= 1, expert_zero_shards(problem, g), 1))
    offloaded = host_state_offload(g)  # the host runs the optimizer
    host_bw = s.host_bandwidth / s.gpus_per_node
    tensors = n * cpu["layer_tensors"] + cpu["rest_tensors"]
    optimizer = (slow * np.where(offloaded, 2 * shard * (ob + gb) / host_bw, 2 * shard * (wb + gb + ob) / hbm)
                 + contend * tensors * np.where((t > 1) | ((dp * c > 1) & (g.zero >= 1)) | fsdp, cpu["dtensor"], cpu["tensor"]))
    link = s.offload_bandwidth
    fetch = np.where(g.offload == PARAMS_OFFLOAD, m * 2 * params / shards * wb / link, 0.0)
    # the weights' fetch from the host prefetches behind the same compute as the data-parallel collectives
    # (``dp_hidden``): one budget, the profile's ``zero3_overlap`` share of the step's compute, of which the
    # fetch gets what those collectives left (each was hidden up to the whole share: twice the compute)
    fetch_hidden = np.minimum(fetch, np.maximum(0.0, s.efficiency["zero3_overlap"] * busy - hidden))
    offload = np.where(offloaded, shard * (gb + wb) / link, 0.0) + fetch - fetch_hidden
    offload = offload + tier_exposed(problem, g, mem, m, n, layer_fwd, shard, (wb, gb, ob))

    host = host_bound(problem, n, F + B)
    parts = {"forward": m * fwd, "backward": m * bwd, "host": m * (host + n * (stall + stall_redo)), "recompute": m * rc, "tp_comm": m * tp_mb, "cp_comm": m * cp_mb, "ep_comm": m * ep_mb,
             "pp_p2p": pp_comm, "pipeline_bubble": bubble, "dp_comm": dp_total - hidden, "optimizer": optimizer,
             "offload": offload}
    step = sum(parts.values())
    # hidden_other: the tensor-, context- and expert-parallel communication hidden per step; compute: the
    # pacing rank's forward, backward and recompute per step (what every overlap hides behind)
    return {"parts": parts, "step": step, "dp_hidden": hidden, "F": F, "B": B, "W": W,
            "hidden_other": m * (hid_f + hid_b), "compute": m * (fwd + bwd + rc)}


PERMUTE_PASSES = 4  # permute (gather into expert order) + unpermute (weighted scatter back): each reads and writes the k copies


# the router past its h x E GEMM (whose FLOPs the layer's GEMMs count), per token and expert: the
# logits read in the GEMM's output dtype (2 bytes), fp32 probabilities written (4) and the boolean
# routing map (1) -- Megatron-Core's TopKRouter returns both as [tokens, experts] tensors (softmax and
# top-k fused with --moe-router-fusion)
ROUTER_BYTES_PER_EXPERT = 2 + 4 + 1


def moe_permutation_bytes(problem: Problem, e):
    """HBM bytes per token (average layer, forward) of routing a MoE layer's tokens to its experts
    and back: the router's scores over the E experts (``ROUTER_BYTES_PER_EXPERT``), then the
    dropless token dispatcher (Megatron-Core ``moe_utils.permute``/``unpermute``) copies each
    token's k routed copies into expert order and scatters the weighted outputs back, each a read
    and a write of k·h elements (``PERMUTE_PASSES``). Backward: 2x, with the layer's other terms."""
    cfg = problem.model
    if not cfg.moe:
        return 0.0
    router = ROUTER_BYTES_PER_EXPERT * cfg.experts
    return problem.derived["moe_share"] * (PERMUTE_PASSES * cfg.experts_per_token * cfg.hidden * e + router)


def moe_host_stall(problem: Problem, device_fwd):
    """Seconds per (average) layer and micro-batch that a MoE forward's host synchronisation adds:
    the dropless dispatcher needs the token counts on the host (Megatron-Core
    ``MoEAlltoAllTokenDispatcher``: "A synchronization is needed before expert parallel AlltoAll
    communication to get the `input_splits` and `output_splits` CPU values", ``d2h_event.synchronize()``;
    the allgather dispatcher's ``.cpu()`` of the counts; DeepEP's and HybridEP's dispatch, ``fused_a2a.py``),
    so the host waits for the device once per MoE layer forward and the device then has only what the
    host issues after it: the layer takes max(device, host) instead of hiding the host behind earlier
    layers. ``device_fwd``: the layer's forward on the device; host: ``Runtime.moe_layer_host_s``
    (0: nothing added). Backward keeps the splits (no wait)."""
    host = problem.runtime_model.moe_layer_host_s
    if not host or not problem.model.moe or problem.system.cpu:
        return 0.0
    return problem.derived["moe_share"] * np.maximum(0.0, host - device_fwd)


def host_bound(problem: Problem, n, busy):
    """Seconds per micro-batch an eager runtime's host adds beyond the GPU's ``busy`` (its forward
    + backward): the host dispatches every kernel in order, so a micro-batch takes at least
    kernels x ``kernel_launch_s`` (a probed GPU profile's; 0 elsewhere: nothing added). Kernels:
    the ATen operations of one forward + backward of luban's implementation of the model
    (``luban.plan.overhead``; n layers + the rest), the count an eager runtime dispatches; compiled
    layers (Inductor's fused kernels) are not counted, an eager head and loss are."""
    launch = problem.system.efficiency.get("kernel_launch_s", 0.0)
    rt = problem.runtime_model
    if not launch or problem.system.cpu or not rt.eager_kernels:
        return 0.0
    from luban.plan.overhead import model_overhead_counts

    counts = model_overhead_counts(problem.model)
    compiled = rt.compiled(problem)
    layer_ops = 0.0 if compiled in (True, "blocks") else counts["layer_ops"]
    rest_ops = 0.0 if compiled is True else counts["rest_ops"]
    return np.maximum(0.0, (n * layer_ops + rest_ops) * launch - busy)


def tier_exposed(problem: Problem, g: Grid, mem: dict, m, n, layer_fwd, shard, param_bytes):
    """Seconds per step the offload tier's traffic is not hidden (seed 003 §3; Calculon's tensor
    offload). Per layer and micro-batch the link moves, each way at ``offload_bandwidth``:
    forward, the layer's saved activations out (and with "blocks" its weights in); backward,
    the activations and weights in and the weight gradients out. Each transfer is prefetched
    (written back) during the neighbouring layer's compute, so only what exceeds the layer's
    forward (backward: 2x) time is exposed. With "blocks" the optimizer step streams this
    rank's states through the GPU once (in: weights, gradients, optimizer state; out: weights
    and optimizer state), exposed: nothing else runs then."""
    link = problem.system.offload_bandwidth
    wb, gb, ob = param_bytes
    # what moves: a layer's saved activations but those kept on the device (luban's selective cache)
    acts = np.where(activations_in_tier(g), at_pick(mem, "layer_activation") - at_pick(mem, "layer_resident"), 0.0)
    blocks = g.offload == BLOCKS_OFFLOAD
    layer = problem.derived["layer_params"] / g.tp
    w_in, g_out = np.where(blocks, layer * wb, 0.0), np.where(blocks, layer * gb, 0.0)
    fwd = np.maximum(0.0, np.maximum(w_in, acts) / link - layer_fwd)
    bwd = np.maximum(0.0, np.maximum(w_in + acts, g_out) / link - 2 * layer_fwd)
    optimizer = np.where(blocks, shard * (wb + gb + ob) / link, 0.0)
    return m * n * (fwd + bwd) + optimizer


def at_pick(mem: dict, key: str):
    """``key`` of the fuller pipeline rank of each layout (the one ``memory`` reports)."""
    return np.where(mem["pick_first"], mem["first"][key], mem["last"][key])


def dp_collective_counts(problem: Problem, g: Grid, m, n):
    """(all-gathers of weights, reduce-scatters of gradients per step, groups each is split into)
    for ZeRO stages >= 1 on the busiest rank: the runtime model's (``Runtime.dp_collective_counts``)."""
    return problem.runtime_model.dp_collective_counts(problem, g, m, n)


def pipeline_bubble(g: Grid, F, B, W):
    """Idle time of the slowest rank per step (F, B, W: one micro-batch on one rank): each
    schedule's formula, with its source, in ``luban.parallel.schedules``; 0 without a pipeline."""
    bubble = schedules.per_schedule(g.schedule, lambda s: s.bubble(g.pp, g.virtual_stages, F, B, W))
    return np.where(g.pp > 1, bubble, 0.0)
