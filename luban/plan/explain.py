"""Human-readable explanations: where every byte and second goes, why a layout does not fit,
and the nearest layouts that do."""

from __future__ import annotations

import math

import numpy as np

from luban.parallel.layout import ParallelLayout
from luban.plan.estimate import Estimate
from luban.plan.grid import Grid
from luban.plan.memory import (activation_bytes, expert_split, expert_zero_shards, moe_activation_bytes, param_bytes,
                               rank_experts, rank_layers, zero_shards)
from luban.plan.problem import Problem
from luban.plan.search import TooManyLayouts, search

GIB = 2**30
KNOBS = ("dp", "zero", "tp", "sp", "pp", "schedule", "virtual_stages", "cp", "micro_batch", "recompute", "offload", "ep")


def capacity(nbytes: float, digits: int = 1) -> str:
    """A GPU's memory in GiB, or ``unlimited HBM`` (``--system-set hbm_gib=inf``: no ``inf GiB`` printed)."""
    return f"{nbytes / GIB:.{digits}f} GiB" if math.isfinite(nbytes) else "unlimited HBM"


def over_peak(est: Estimate) -> str | None:
    """Why an MFU or HFU above 100% is not a planner error (None when both are <= 100%): they count the full
    (non-causal) s x s attention product, as Megatron-LM's Eq. 3 and PaLM (App. B) do and the published
    tables the planner is validated on report it, while a fused kernel that skips the masked half
    executes about half of it; at long sequences that half outweighs the rest."""
    if est.mfu <= 1 and est.hfu <= 1:
        return None
    which = "MFU and HFU" if est.mfu > 1 else "HFU"
    return (f"{which} above 100%: {'both count' if est.mfu > 1 else 'it counts'} the full (non-causal) s x s attention, "
            "as Megatron-LM and PaLM report them; the attention kernel skips the masked half, executing about "
            "half of those FLOPs")


def describe(layout: ParallelLayout) -> str:
    """A short one-line name: ``dp8 z1 tp4+sp pp2 1f1b cp1 mb1 rc=selective`` (``dp8 r2 z3 ...``: hybrid
    sharding, two replicas of shards over 4 ranks each)."""
    sched = f" {layout.schedule}" + (f"x{layout.virtual_stages}" if layout.virtual_stages > 1 else "") if layout.pp > 1 else ""
    off = f" off={layout.offload}" if layout.offload != "none" else ""
    return (f"dp{layout.dp}{f' r{layout.dp_replicate}' if layout.dp_replicate > 1 else ''} z{layout.zero} tp{layout.tp}{'+sp' if layout.sp else ''} pp{layout.pp}{sched} "
            f"cp{layout.cp}{f' ep{layout.ep}' if layout.ep > 1 else ''} mb{layout.micro_batch} rc={layout.recompute}{off}")


def why_not(est: Estimate) -> list[str]:
    """Reasons in numbers why ``est`` does not fit (empty when it fits)."""
    lines = []
    mem, lay = est.memory_bytes, est.layout
    hbm = est.hbm_bytes / GIB
    states = mem["weights"] + mem["gradients"] + mem["optimizer"]
    if not est.extra["fits_hbm"]:
        lines.append(f"needs {mem['total'] / GIB:.1f} GiB per GPU but the GPU has {hbm:.1f} GiB (pipeline rank {est.rank})")
        if states > est.hbm_bytes:
            lines.append(f"weights + gradients + optimizer need {states / GIB:.1f} GiB per GPU at zero={lay.zero}, "
                         f"tp={lay.tp}, pp={lay.pp}: shard more (zero, tp, pp) or offload")
        lines.append(f"activations need {mem['activations'] / GIB:.1f} GiB: {est.in_flight:g} micro-batch(es) in flight "
                     f"x {est.activation_bytes_per_microbatch / GIB:.2f} GiB (micro_batch={lay.micro_batch}, "
                     f"recompute={lay.recompute}, sp={lay.sp}, cp={lay.cp})")
    if not est.extra["fits_host"]:
        lines.append(f"offloaded state needs {est.host_bytes / GIB:.1f} GiB of host memory per GPU")
    return lines


# a score's step per knob changed: above the span of log(tokens/s) over every positive float (-745 to 710),
# so fewer changes always win and the speed still orders layouts with as many (-changed x 1e30 + tokens/s
# rounded every speed away: a float's step at 1e30 is ~1e14)
CHANGE_WEIGHT = 2048.0


def nearest_feasible(problem: Problem, layout: ParallelLayout, k: int = 3, progress=None) -> list[Estimate] | None:
    """Valid layouts that fit, fewest knobs changed from ``layout`` first, then fastest (``progress``: as
    ``search``'s; the whole space is searched, on 2**24 GPUs a minute); None where that space is too large
    to search (``TooManyLayouts``)."""
    target = Grid.from_layout(layout)

    def closeness(g: Grid, results: dict):
        changed = sum((getattr(g, name) != getattr(target, name)).astype(float) for name in KNOBS
                      if name != "dp")
        with np.errstate(divide="ignore", invalid="ignore"):  # an invalid layout's speed may be <= 0: never chosen
            return -changed * CHANGE_WEIGHT + np.log(results["tokens_per_s"])

    try:
        return search(problem, top=k, score=closeness, precision=layout.precision, progress=progress).best
    except TooManyLayouts:  # the estimate stands without them (their search would take half an hour)
        return None


def moe_lines(est: Estimate, problem: Problem, g: Grid) -> list[str]:
    """The mixture-of-experts share of the memory terms above (none for a dense model)."""
    cfg = problem.model
    if not cfg.moe:
        return []
    experts = float(rank_experts(problem, g)[0 if est.rank == 0 else 1])
    split, shards = int(expert_split(problem, g)), int(expert_zero_shards(problem, g))
    act = float(moe_activation_bytes(problem, g, activation_bytes(problem, g)["e"], 0, 0))
    return [f"  MoE: of the parameters, {experts:,.0f} are routed experts ({cfg.moe_layers} MoE layers x "
            f"{cfg.experts} experts / {split} ranks (ep{' x tp' if split != g.ep else ''})); their states shard over "
            f"{shards} expert-data-parallel rank(s) instead of {int(zero_shards(problem, g))}; the activations "
            f"include the routed copies and {act:,.0f} B/token of routing buffers per layer; buffers include "
            f"the all-to-all send/receive copies"]


def explain(est: Estimate, problem: Problem) -> str:
    """Every term of the memory and time estimate with the numbers that produce it."""
    lay = est.layout
    g = Grid.from_layout(lay)
    cfg = problem.model
    wb, gb, ob = (float(x) for x in param_bytes(problem.runtime, problem.optimizer_states, g.precision, problem))
    shards = int(zero_shards(problem, g))
    fsdp = problem.runtime_model.fsdp  # ZeRO >= 1 as FSDP2: weights and gradients sharded at rest
    act = activation_bytes(problem, g)
    tokens = lay.micro_batch * problem.seq / lay.cp
    layers = int(rank_layers(problem, g)[0 if est.rank == 0 else 1])
    params = est.extra["first_params"] if est.rank == 0 else est.extra["last_params"]
    m = est.memory_bytes

    def sharded(stage):
        return f" / {shards} (zero >= {stage})" if lay.zero >= stage else ""

    out = [f"memory per GPU (pipeline rank {est.rank}, {problem.runtime} runtime):",
           f"  parameters on this rank   {params:,.0f} ({layers} layers of {cfg.layers}, tp={lay.tp})",
           f"  weights       {m['weights'] / GIB:9.3f} GiB = params x {wb:g} B" + sharded(1 if fsdp else 3)
           + (" (offloaded: 0 on GPU)" if lay.offload == "params" else "")
           + (" (offload tier; on GPU: 2 layers, computing + prefetched)" if lay.offload == "blocks" else ""),
           f"  gradients     {m['gradients'] / GIB:9.3f} GiB = params x {gb:g} B" + sharded(1 if fsdp else 2),
           f"  optimizer     {m['optimizer'] / GIB:9.3f} GiB = params x {ob:g} B ({problem.optimizer})"
           + sharded(1) + (" (offloaded: 0 on GPU)" if lay.offload in ("optimizer", "params", "blocks") else ""),
           (f"  activations   {m['activations'] / GIB:9.3f} GiB = 2 layers of one micro-batch (computing + in "
            f"transfer); {est.in_flight:g} in flight x {est.activation_bytes_per_microbatch / GIB:.3f} GiB per "
            "micro-batch in the offload tier" if lay.offload in ("activations", "blocks") else
            f"  activations   {m['activations'] / GIB:9.3f} GiB = {est.in_flight:g} in flight x "
            f"{est.activation_bytes_per_microbatch / GIB:.3f} GiB per micro-batch"),
           f"                per micro-batch: {layers} layers x {float(act['per_token']):,.1f} B/token x {tokens:,.0f} tokens"
           f" (+ {float(act['fixed']):,.0f} B autocast weight copies per layer) + embedding/head",
           f"  other         {m['other'] / GIB:9.3f} GiB = framework overhead {problem.system.framework_overhead_bytes / GIB:.2f}"
           f" GiB + buffers {est.extra['buffers'] / GIB:.3f} GiB (ZeRO-3 prefetch, TP/PP buffers"
           + (", FSDP2 gathered weights / full gradients" if fsdp else "") + ")",
           *moe_lines(est, problem, g),
           f"  total         {m['total'] / GIB:9.3f} GiB of {capacity(est.hbm_bytes)} -> {'fits' if est.fits else 'DOES NOT FIT'}",
           f"  host (offload) {est.host_bytes / GIB:8.3f} GiB",
           f"step time {est.step_time_s * 1e3:,.1f} ms ({est.microbatches} micro-batches per pipeline):"]
    for name, seconds in est.time_breakdown_s.items():
        share = seconds / est.step_time_s if est.step_time_s else 0.0
        out.append(f"  {name:16s} {seconds * 1e3:12.2f} ms  {share:6.1%}")
    out.append(f"  (data-parallel traffic hidden behind compute: {est.dp_hidden_s * 1e3:.2f} ms)")
    out.append(f"throughput {est.tokens_per_s:,.0f} tokens/s, MFU {est.mfu:.1%}, HFU {est.hfu:.1%}, "
               f"{est.tflops_per_gpu:.1f} TFLOP/s per GPU")
    out += [f"  ({note})" for note in [over_peak(est)] if note]
    return "\n".join(out)

