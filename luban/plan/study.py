"""``luban plan study seed003``: the seed-003 (Calculon) scaling study rerun with luban's search.

Seed 003 (``/work/shared/seeds/003_*.txt``: "万亿级别的大语言模型训练,基础设施如何支持", a write-up
of Isaev et al. 2023, *Scaling infrastructure to support multi-trillion parameter LLM
training*, which used Calculon) searches execution strategies for 1T…128T-parameter models on
H100 systems of 4,096–16,384 GPUs with a secondary "offload" memory per GPU. This module
reruns its experiments with ``luban.plan.search`` and puts each of its findings beside luban's
number (``findings``); nothing here is fitted to the seed's numbers.

Models (seed §2): sequence 8192, feed-forward 4h, heads = blocks, global batch 3072 (the seed's
maximum; we plan at it). The seed's Table III (the shapes) is an image the text does not carry,
so the shapes follow the rule the text states: the aspect ratio h/blocks grows linearly with the
block count, fitted to its Table II models (GPT-3, Turing-NLG, PaLM, Megatron-1T); blocks move
in steps of 16 (a power of two) and h = blocks × head_dim, so heads = blocks divide h
(``seed_model``). The 256- vs 254-block pair of §2 (~1.1T) share head_dim 76.

Systems: ``dgx-h100`` with ``--system-set`` overrides (``luban.plan.system.apply_overrides``):
HBM 80 or 120 GiB, offload tier 256 GiB–2 TiB at 50/100 GB/s or unlimited, NVLink domain 8
or 16. Precision: fp8 where the planner and the profile have it, else bf16 (the table says
which). Runtime model: ``megatron-core`` where the planner has it, else ``megatron``.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from luban.model.config import ModelConfig
from luban.parallel.layout import OFFLOADS, ParallelLayout
from luban.plan.explain import describe
from luban.plan.grid import NO_OFFLOAD, Grid
from luban.plan.memory import memory
from luban.plan.problem import Problem
from luban.plan.search import ALL_OFFLOADS, search
from luban.plan.system import load_system

SEQ = 8192  # seed §2: "所有模型的序列大小为8192"
BATCH = 3072  # seed §2: maximum batch 3072 for all experiments
VOCAB = 51200  # Megatron-LM's padded GPT-2 vocabulary (as the presets megatron-*)
SYSTEM = "dgx-h100"  # seed §1: DGX/HGX H100, 80 GiB HBM, 8 GPUs per NVLink domain
# seed §2, Table II: (blocks, hidden) of GPT-3 175B, Turing-NLG 530B, PaLM 540B, Megatron 1T
TABLE_II = ((96, 12288), (105, 20480), (118, 18432), (128, 25600))
BLOCK_STEP = 8
SIZES_T = (1, 2, 4, 8, 11, 16, 18, 32, 64, 128)  # seed §3/§5: 1T…128T; 11T and 18T are named in its text
HBM_GIB = (80, 120)  # seed §5
OFFLOAD_GIB = (256, 512, 1024, 2048)  # seed §3 (Fig. 5) and §5 (Fig. 8)
OFFLOAD_GBPS = (50, 100, math.inf)  # seed §3: per direction
SCALING_GPUS = (4096, 8192, 12288, 16384)  # seed §4
NVLINK = (8, 16)  # seed §4
SCALING_TIER = (512, 100)  # GiB, GB/s: the seed's Fig. 6 tier (Calculon sc23 scripts: mem2 512 GiB, 100 GB/s)
SEED_SCHEDULES = ("1f1b", "interleaved-1f1b")  # what Calculon models (Megatron-LM's 1F1B and interleaving)
BLOCKS_PAIR = (256, 254)  # seed §2, Fig. 2
PAIR_HEAD_DIM = 76  # 256 × 76 = 19456 (a multiple of 1024): ~1.16T parameters, the seed's "~1.1T"
# the seed's numbers, quoted from its text
SEED = {
    "mfu_1t_4096": 0.60, "no_offload_limit_t": 18, "inf_offload_max_t": 128, "hbm80_limit_t": 11,
    "mfu_128t_120g": 0.75, "scaling_stall_gpus": 12288, "mappings_256": 15_612_832, "mappings_254": 842_080,
    "mfu_256": 0.75, "mfu_254": 0.54,
}


def aspect_fit() -> tuple[float, float]:
    """Least-squares (slope, intercept) of h/blocks against blocks over ``TABLE_II``."""
    b = np.array([x for x, _ in TABLE_II], dtype=float)
    r = np.array([h / x for x, h in TABLE_II])
    slope, intercept = np.polyfit(b, r, 1)
    return float(slope), float(intercept)


def block_model(blocks: int, head_dim: int, name: str = "") -> ModelConfig:
    h = blocks * head_dim
    return ModelConfig(name=name or f"seed003-b{blocks}-h{h}", arch="gpt2", hidden=h, layers=blocks, heads=blocks,
                       ffn_hidden=4 * h, vocab=VOCAB, seq_len=SEQ)


def seed_model(target_t: float) -> ModelConfig:
    """The block count (a multiple of ``BLOCK_STEP``) whose fitted-aspect-ratio model has the
    parameter count nearest ``target_t`` trillion (in log scale)."""
    from luban.model.flops import param_count

    slope, intercept = aspect_fit()
    best = None
    for blocks in range(BLOCK_STEP, 512 + 1, BLOCK_STEP):
        head_dim = max(1, round(slope * blocks + intercept))
        cfg = block_model(blocks, head_dim, name=f"seed003-{target_t:g}T")
        err = abs(math.log(param_count(cfg) / (target_t * 1e12)))
        if best is None or err < best[0]:
            best = (err, cfg)
    return best[1]


def precision_and_runtime(system) -> tuple[str, str]:
    """fp8 where the profile has an fp8 peak, on the megatron-core runtime model."""
    return ("fp8" if "fp8" in system.peak_flops else "bf16"), "megatron-core"


def system_for(hbm_gib: float = 80, offload: tuple | None = None, nvlink: int = 8):
    sets = [f"hbm_gib={hbm_gib}", f"nvlink_domain={nvlink}"]
    if offload:
        sets += [f"offload_gib={offload[0]}", f"offload_gbps={offload[1]}"]
    return load_system(SYSTEM, sets)


@dataclass
class Point:
    """The best layout of one search (``mfu`` 0 when nothing fits)."""
    model: str
    params: float
    gpus: int
    mfu: float
    tokens_per_s: float
    valid: int
    evaluated: int
    layout: str
    parts: dict
    seconds: float

    @classmethod
    def of(cls, cfg: ModelConfig, gpus: int, system, offload: bool, seed_space: bool = False) -> "Point":
        """``seed_space``: only the axes the seed's Calculon searched — no context parallel, the
        Megatron schedules (1F1B, interleaved), pp dividing the blocks (no uneven split)."""
        from luban.model.flops import param_count

        precision, runtime = precision_and_runtime(system)
        problem = Problem(cfg, system, gpus, SEQ, BATCH, runtime)
        offloads = ALL_OFFLOADS if offload else (NO_OFFLOAD,)
        space = dict(cps=(1,), pps=[d for d in range(1, cfg.layers + 1) if cfg.layers % d == 0],
                     schedules=SEED_SCHEDULES) if seed_space else {}
        r = search(problem, top=1, precision=precision, offloads=offloads, **space)
        best = r.best[0] if r.best else None
        step = best.step_time_s if best else 1.0
        return cls(cfg.name, float(param_count(cfg)), gpus, best.mfu if best else 0.0,
                   best.tokens_per_s if best else 0.0, r.valid, r.evaluated, describe(best.layout) if best else "",
                   {k: v / step for k, v in best.time_breakdown_s.items()} if best else {}, r.seconds)


def run(out: Path, sizes=SIZES_T, scaling_gpus=SCALING_GPUS, log=print) -> dict:
    """All experiments; writes ``results.json``, the PNG charts and ``seed003.md`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    models = {t: seed_model(t) for t in sizes}
    base = system_for()
    precision, runtime = precision_and_runtime(base)
    res = {"precision": precision, "runtime": runtime, "models": {}, "a": [], "b": [], "c": []}
    for t, cfg in models.items():
        res["models"][f"{t:g}T"] = dict(blocks=cfg.layers, hidden=cfg.hidden, heads=cfg.heads)
    # (a) model size on 4,096 GPUs: without offload, and with every tier
    for hbm in HBM_GIB:
        for t, cfg in models.items():
            cases = [("none", None)] + [(f"{c}GiB@{g:g}", (c, g)) for c in OFFLOAD_GIB for g in OFFLOAD_GBPS]
            for label, tier in cases:
                p = Point.of(cfg, 4096, system_for(hbm, tier), offload=tier is not None)
                res["a"].append(dict(size_t=t, hbm=hbm, tier=label, **vars(p)))
            log(f"(a) {t:g}T HBM {hbm} GiB done ({time.perf_counter() - start:.0f} s)")
    # (b) strong scaling of the 1T model
    one_t = models.get(1, seed_model(1))
    for nvl in NVLINK:
        for gpus in scaling_gpus:
            for seed_space in (False, True):
                p = Point.of(one_t, gpus, system_for(80, SCALING_TIER, nvl), offload=True, seed_space=seed_space)
                res["b"].append(dict(nvlink=nvl, space="seed" if seed_space else "luban", **vars(p)))
    log(f"(b) done ({time.perf_counter() - start:.0f} s)")
    # (c) 256 vs 254 blocks on 4,096 GPUs
    for seed_space in (False, True):
        for blocks in BLOCKS_PAIR:
            cfg = block_model(blocks, PAIR_HEAD_DIM)
            p = Point.of(cfg, 4096, system_for(80, SCALING_TIER), offload=True, seed_space=seed_space)
            res["c"].append(dict(blocks=blocks, space="seed" if seed_space else "luban", **vars(p)))
    res["seconds"] = time.perf_counter() - start
    (out / "results.json").write_text(json.dumps(res, indent=1, default=float))
    charts(res, out)
    (out / "seed003.md").write_text(report(res))
    return res


def _a(res, hbm, tier):
    rows = sorted((r for r in res["a"] if r["hbm"] == hbm and r["tier"] == tier), key=lambda r: r["size_t"])
    return [r["size_t"] for r in rows], [r["mfu"] for r in rows]


def charts(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # (a) model size vs MFU: one panel per HBM size; colour = capacity, line style = bandwidth
    fig, axes = plt.subplots(1, len(HBM_GIB), figsize=(13, 4.8), sharey=True)
    colours = dict(zip(OFFLOAD_GIB, ("tab:red", "tab:orange", "tab:green", "tab:blue")))
    styles = {50: ":", 100: "--", math.inf: "-"}
    for ax, hbm in zip(axes, HBM_GIB):
        x, y = _a(res, hbm, "none")
        ax.plot(x, y, "k-o", label="no offload", linewidth=2)
        for c in OFFLOAD_GIB:
            for g in OFFLOAD_GBPS:
                x, y = _a(res, hbm, f"{c}GiB@{g:g}")
                ax.plot(x, y, linestyle=styles[g], color=colours[c], marker=".",
                        label=f"{c} GiB @ {'inf' if math.isinf(g) else int(g)} GB/s")
        ax.set_xscale("log", base=2)
        sizes = sorted({r["size_t"] for r in res["a"]})
        ax.set_xticks(sizes, [f"{t:g}T" for t in sizes])
        ax.tick_params(axis="x", labelrotation=60, labelsize=8)
        ax.set_xlabel("model size (nominal; parameters in seed003.md)")
        tiers = {tuple(_a(res, hbm, f"{c}GiB@{g:g}")[1]) for c in OFFLOAD_GIB for g in OFFLOAD_GBPS}
        note = " — all offload tiers coincide" if len(tiers) == 1 else ""
        ax.set_title(f"(a) 4,096 GPUs, HBM {hbm} GiB{note}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"best MFU ({res['precision']}, runtime {res['runtime']}; 0 = nothing fits)")
    axes[-1].legend(fontsize=6, ncol=2, loc="upper right")
    fig.tight_layout()
    fig.savefig(out / "a_model_size.png", dpi=110)
    plt.close(fig)

    # (b) strong scaling: MFU and speed-up over 4,096 GPUs, per NVLink domain
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (nvl, colour), space in itertools.product(zip(NVLINK, ("tab:blue", "tab:orange")), ("luban", "seed")):
        rows = _b(res, nvl, space)
        g = [r["gpus"] for r in rows]
        style = "-o" if space == "luban" else "--s"
        label = f"NVLink {nvl}, " + ("luban's search space" if space == "luban" else "seed's space (no cp, 1F1B/interleaved)")
        ax1.plot(g, [r["mfu"] for r in rows], style, color=colour, label=label)
        if rows and rows[0]["tokens_per_s"]:
            ax2.plot(g, [r["tokens_per_s"] / rows[0]["tokens_per_s"] for r in rows], style, color=colour, label=label)
    if res["b"]:
        g = sorted({r["gpus"] for r in res["b"]})
        ax2.plot(g, [x / g[0] for x in g], "k:", label="linear")
    ax1.set_title("(b) 1T model: best MFU")
    ax2.set_title("(b) 1T model: speed-up over the smallest system")
    for ax in (ax1, ax2):
        ax.set_xlabel("GPUs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "b_strong_scaling.png", dpi=110)
    plt.close(fig)

    # (c) 256 vs 254 blocks
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['blocks']} blocks\n{r['space']} space" for r in res["c"]]
    colours = ["tab:blue" if r["blocks"] == BLOCKS_PAIR[0] else "tab:orange" for r in res["c"]]
    bars = ax1.bar(labels, [max(r["valid"], 1) for r in res["c"]], color=colours)
    ax1.bar_label(bars, [f"{r['valid']:,}" for r in res["c"]], fontsize=8)
    ax1.set_yscale("log")
    ax1.set_ylim(bottom=1)
    ax1.set_title("(c) valid layouts that fit, 4,096 GPUs (log)")
    bars = ax2.bar(labels, [r["mfu"] for r in res["c"]], color=colours)
    ax2.bar_label(bars, [_pct(r["mfu"]) for r in res["c"]], fontsize=8)
    ax2.set_title("(c) best MFU, 4,096 GPUs")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(out / "c_blocks.png", dpi=110)
    plt.close(fig)


def _b(res, nvl, space) -> list:
    return sorted((r for r in res["b"] if r["nvlink"] == nvl and r.get("space", "luban") == space),
                  key=lambda r: r["gpus"])


def _c(res, space) -> list:
    return [r for r in res["c"] if r.get("space", "luban") == space]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _worst_drop(res, slow, fast) -> str:
    """The size where the slower tier loses most MFU against the faster one (80 GiB)."""
    pairs = [(r["size_t"], _mfu(res, r["size_t"], 80, slow), r["mfu"]) for r in res["a"]
             if r["hbm"] == 80 and r["tier"] == fast and r["mfu"]]
    if not pairs:
        return "no size fits"
    size, low, high = min(pairs, key=lambda p: p[1] / p[2])
    return f"largest loss at {size:g}T: {_pct(low)} vs {_pct(high)}"


def _fitting(res, hbm, tier) -> list[str]:
    return [f"{r['size_t']:g}T" for r in sorted(res["a"], key=lambda r: r["size_t"])
            if r["hbm"] == hbm and r["tier"] == tier and r["mfu"] > 0]


def _largest(res, hbm, tier) -> float:
    fits = [r["size_t"] for r in res["a"] if r["hbm"] == hbm and r["tier"] == tier and r["mfu"] > 0]
    return max(fits, default=0)


def _mfu(res, size, hbm, tier) -> float:
    return next((r["mfu"] for r in res["a"] if r["size_t"] == size and r["hbm"] == hbm and r["tier"] == tier), 0.0)


def _row(res, size, hbm, tier) -> dict:
    return next((r for r in res["a"] if r["size_t"] == size and r["hbm"] == hbm and r["tier"] == tier), {})


def _top_costs(row: dict, k: int = 3) -> str:
    parts = sorted(((v, n) for n, v in row.get("parts", {}).items() if n not in ("forward", "backward")), reverse=True)
    return ", ".join(f"{n} {_pct(v)}" for v, n in parts[:k] if v > 0.005) or "compute only"


def _ratio_mean(res, tier_a, tier_b, hbm=80) -> float:
    ratios = [_mfu(res, t, hbm, tier_a) / _mfu(res, t, hbm, tier_b) for t in {r["size_t"] for r in res["a"]}
              if _mfu(res, t, hbm, tier_b) > 0]
    return float(np.mean(ratios)) if ratios else float("nan")


def max_tp(blocks: int) -> int:
    """Largest tensor-parallel size for heads = ``blocks`` on a power-of-two GPU count."""
    return blocks & -blocks


def block_floor_gib(res: dict, name: str) -> float:
    """GiB the device keeps with everything else in the tier (offload = blocks, seed 003 §3): two
    layers' weights and gradients at the largest tp the heads allow (capped by the GPUs' power
    of two), plus two layers' activations of one micro-batch (sp, no recompute)."""
    m = res["models"][name]
    head_dim = m["hidden"] // m["blocks"]
    cfg = block_model(m["blocks"], head_dim)
    tp = max_tp(m["blocks"])
    system = system_for(80)
    precision, runtime = precision_and_runtime(system)
    problem = Problem(cfg, system, 4096, SEQ, BATCH, runtime)
    g = Grid.from_layout(ParallelLayout(tp=tp, sp=tp > 1, dp=4096 // tp, precision=precision, offload="blocks"))
    mem = memory(problem, g)
    return float((mem["first"]["weights"] + mem["first"]["gradients"] + mem["first"]["activations"]).item()) / 2**30


def findings(res: dict) -> list[dict]:
    """Each seed finding with luban's number and whether they agree (rules stated per row)."""
    rows = []

    def add(finding, seed, luban, agree, why):
        """``agree``: a bool, or {space: bool} when both search spaces were run."""
        if isinstance(agree, dict):
            agree = "; ".join(f"{space} space: {'yes' if ok else 'no'}" for space, ok in agree.items())
        else:
            agree = "yes" if agree else "no"
        rows.append(dict(finding=finding, seed=seed, luban=luban, agree=agree, why=why))

    one = _row(res, 1, 80, "none")
    m1 = one.get("mfu", 0.0)
    add("1T on 4,096 GPUs without offload (80 GiB) reaches ~60% MFU (Fig. 4a)", "60%", _pct(m1),
        abs(m1 - SEED["mfu_1t_4096"]) <= 0.1,
        f"best layout {one.get('layout', '-')}; beyond compute the step spends {_top_costs(one)}")
    lim = _largest(res, 80, "none")
    fit = _fitting(res, 80, "none")
    tps = ", ".join(f"{name} {max_tp(m['blocks'])}" for name, m in res["models"].items())
    add("without offload the largest trainable model is below 18T (Fig. 4a)", "< 18T (16T runs)",
        f"{lim:g}T (fit: {', '.join(fit)})", lim < SEED["no_offload_limit_t"] and lim >= 8,
        "model states (weights, gradients, Adam states) and activations must fit HBM; which sizes fit is not "
        "monotone because tp must divide heads = blocks and the 4,096 GPUs, so the largest tp is the power of two "
        f"in the block count ({tps})")
    big = _largest(res, 80, "1024GiB@inf")
    add("with 1 TiB offload at unlimited bandwidth at least 128T trains (Fig. 4b)", ">= 128T", f"{big:g}T "
        f"(MFU {_pct(_mfu(res, big, 80, '1024GiB@inf'))})" if big else "none", big >= SEED["inf_offload_max_t"],
        "with offload=blocks the tier holds every weight, gradient, optimizer state and in-flight activation, but "
        "the device keeps two blocks (computing + prefetched): two layers' weights and fp32 main gradients at the "
        "largest tp the heads allow, plus two layers' activations. That floor is "
        + ", ".join(f"{name} {block_floor_gib(res, name):.0f} GiB (tp {max_tp(m['blocks'])})"
                    for name, m in res["models"].items() if name in ("32T", "64T", "128T"))
        + ": with heads = blocks, 64T and 128T (296, 344 blocks) allow tp <= 8, so no HBM size in the study holds "
        "two of their blocks; the seed's shapes must split a block further")
    r100 = _ratio_mean(res, "1024GiB@100", "1024GiB@inf")
    r50 = _ratio_mean(res, "1024GiB@50", "1024GiB@inf")
    add("100 GB/s offload nearly matches unlimited bandwidth; 50 GB/s loses markedly as models grow (Fig. 5)",
        "100: ~1.0; 50: clearly < 1", f"MFU ratio vs unlimited, mean over sizes: 100 GB/s {r100:.3f}, 50 GB/s {r50:.3f}",
        r100 >= 0.95 and r50 < r100 - 0.03,
        "luban streams each layer's weights and activations (offload=blocks/activations) while the neighbouring "
        "layer computes; at 50 GB/s the transfer outlasts the compute for the mid sizes ("
        + _worst_drop(res, "1024GiB@50", "1024GiB@inf")
        + "), but the small models, where compute hides it, weigh the mean; the seed's 50 GB/s loss grows "
        "with size, luban's peaks in the middle and the largest sizes do not fit at all")
    l80, l120 = _largest(res, 80, "2048GiB@100"), _largest(res, 120, "2048GiB@100")
    add("with offload, 80 GiB HBM scales to ~11T; beyond that HBM must grow to 120 GiB (Fig. 8)",
        "80 GiB: ~11T; 120 GiB: 128T", f"80 GiB: {l80:g}T (fit: {', '.join(_fitting(res, 80, '2048GiB@100'))}); "
        f"120 GiB: {l120:g}T (fit: {', '.join(_fitting(res, 120, '2048GiB@100'))}), 2 TiB @ 100 GB/s",
        l80 < l120 and 8 <= l80 <= 16,
        "the two-block floor decides (see the 128T row): a size fits when two of its blocks fit beside the "
        "buffers, which depends on the largest tp its heads allow more than on its size (largest tp per size: "
        "see the no-offload row); two-block floors: "
        + ", ".join(f"{name} {block_floor_gib(res, name):.0f} GiB" for name in res["models"]))
    top_t = max((r["size_t"] for r in res["a"]), default=0)
    r_top = _row(res, top_t, 120, "2048GiB@100")
    m_top = r_top.get("mfu", 0.0)
    add(f"120 GiB HBM + 2 TiB offload keep MFU above 75% up to 128T (Fig. 8; largest size run: {top_t:g}T)",
        "> 75%", _pct(m_top) if m_top else "does not fit", m_top > SEED["mfu_128t_120g"],
        f"best layout {r_top['layout']}; beyond compute: {_top_costs(r_top)}" if m_top else
        f"no layout fits 120 GiB: even with every state and activation in the tier (offload=blocks) the device "
        f"keeps two blocks, {block_floor_gib(res, f'{top_t:g}T'):.0f} GiB at tp {max_tp(res['models'][f'{top_t:g}T']['blocks'])}")
    r12 = _ratio_mean(res, "1024GiB@100", "2048GiB@100")
    add("1 TiB offload capacity performs about like 2 TiB (Fig. 6)", "~1.0", f"{r12:.3f}", r12 >= 0.95,
        "mean MFU ratio 1 TiB / 2 TiB at 100 GB/s over the sizes where 2 TiB trains")
    def scaling(nvl, space):
        rows_ = {r["gpus"]: r for r in _b(res, nvl, space)}
        if not rows_ or not rows_[min(rows_)]["tokens_per_s"]:
            return rows_, {}
        g0 = min(rows_)
        return rows_, {g: (r["tokens_per_s"] / rows_[g0]["tokens_per_s"]) / (g / g0) for g, r in rows_.items()}

    b8, eff = scaling(8, "luban")
    s8, seff = scaling(8, "seed")
    if eff:
        g0, top = min(b8), max(b8)
        fmt = lambda e: ", ".join(f"{g}: {_pct(x)}" for g, x in sorted(e.items()))  # noqa: E731
        def stalls(e):
            return e.get(12288, 0) >= 0.8 and e.get(top, 1) < e.get(12288, 0) - 0.05

        add("1T strong scaling holds to ~12,288 GPUs and stalls at 16,384 (Fig. 7)",
            "good to 12,288, poor at 16,384", f"scaling efficiency vs {g0} GPUs (NVLink 8): {fmt(eff)}; "
            f"in the seed's space: {fmt(seff)}", {"luban": stalls(eff), "seed": stalls(seff)},
            f"at {top} GPUs luban's best layout is {b8[top]['layout']} (beyond compute: {_top_costs(b8[top])}); "
            f"in the seed's space (no cp, 1F1B/interleaved, pp dividing the blocks) {s8.get(top, {}).get('layout', '-')} "
            f"(beyond compute: {_top_costs(s8.get(top, {}))}). dp must divide both the batch and the GPU count: "
            + ", ".join(f"{g} GPUs: dp <= {math.gcd(BATCH, g)}" for g in sorted(b8))
            + f", so at {top} GPUs tp·pp·cp >= {top // math.gcd(BATCH, top)}; without cp and with pp dividing the "
            "blocks that forces tp beyond the NVLink domain or a deeper pipeline. A tensor-parallel group beyond the "
            "domain crosses the network through the NICs of its 8 ranks in each node (8 x 50 GB/s against NVLink's "
            "450 GB/s on DGX H100: luban.plan.time.collective), so tp 16 over two nodes costs little more than inside "
            "one domain; luban models no SM cost of overlapped TP communication (the seed's reason 4)")
        gains = []
        for space in ("luban", "seed"):
            n8 = {r["gpus"]: r for r in _b(res, 8, space)}
            n16 = {r["gpus"]: r for r in _b(res, 16, space)}
            gains.append({g: n16[g]["mfu"] / n8[g]["mfu"] for g in n8 if g in n16 and n8[g]["mfu"] > 0})
        fmt = lambda d: ", ".join(f"{g}: {v:.3f}" for g, v in sorted(d.items()))  # noqa: E731
        def needs16(gain):
            return gain.get(12288, 1) < 1.1 and gain.get(top, 1) > gain.get(12288, 1) + 0.1

        add("NVLink 8 suffices at 12,288 GPUs; 16,384 needs NVLink 16 (Fig. 7)", "gain at 12,288 ~1.0, at 16,384 > 1",
            f"MFU NVLink16/NVLink8: {fmt(gains[0])}; in the seed's space: {fmt(gains[1])}",
            {"luban": needs16(gains[0]), "seed": needs16(gains[1])},
            "luban's time model gives any tp·cp (or tp·cp·dp) group that fits the domain NVLink bandwidth, and a "
            "group beyond it the NICs of its ranks in each node (8 x 50 GB/s on DGX H100, against NVLink's 450 GB/s), "
            f"so a 16-GPU domain gains at most {max(list(gains[0].values()) + list(gains[1].values()) + [1.0]):.3f}x "
            "here: tp 16 across two nodes runs near NVLink speed, where the seed finds that 16,384 GPUs need a "
            "16-GPU domain")
    for space in ("luban", "seed"):
        pair = _c(res, space)
        if len(pair) != 2:
            continue
        a, b = pair
        where = "" if space == "luban" else " [seed's space: no cp, 1F1B/interleaved, pp dividing the blocks]"
        ratio = a["valid"] / max(b["valid"], 1)
        ratio_text = f"{ratio:.1f}x" if b["valid"] else "none for 254"
        add(f"256 blocks give 18.5x more mappings than 254 on 4,096 GPUs (Fig. 2){where}",
            f"{SEED['mappings_256']:,} vs {SEED['mappings_254']:,} (18.5x)",
            f"{a['valid']:,} vs {b['valid']:,} valid layouts that fit ({ratio_text}; of {a['evaluated']:,} and "
            f"{b['evaluated']:,} evaluated)", ratio > 5,
            "luban counts layouts over its own axes (dp/tp/pp/cp, schedules, zero, sp, micro-batch, recompute, "
            "offload) that pass check_layout and fit; Calculon's axes differ, so only the ratio compares")
        speed = a["mfu"] / b["mfu"] if b["mfu"] else float("inf")
        add(f"the 256-block model is 36% faster: MFU 75% vs 54% (Fig. 2){where}", "75% vs 54% (1.36x)",
            f"{_pct(a['mfu'])} vs {_pct(b['mfu'])}" + (f" ({speed:.2f}x)" if b["mfu"] else " (254 blocks: nothing fits)"),
            speed > 1.15,
            "tp must divide heads = 254 = 2·127, so tp ∈ {1, 2} in practice; "
            + ("luban splits blocks unevenly over stages (any pp up to the block count) and adds context "
               "parallelism, so the 254-block model still finds fitting layouts: "
               if space == "luban" else "with pp dividing the blocks too (pp ∈ {1, 2, 127, 254}) no 254-block layout "
               "fits 80 GiB (the seed, with 842,080 mappings, evidently allowed more): ")
            + f"best 254-block {b['layout'] or 'none'}, best 256-block {a['layout']}")
    return rows


def report(res: dict) -> str:
    from luban.model.flops import param_count

    slope, intercept = aspect_fit()
    lines = ["# Seed 003 (Calculon scaling study) rerun with luban's planner", "",
             "Generated by `luban plan study seed003` (luban/plan/study.py); charts beside this file.", "",
             f"Precision **{res['precision']}**" + ("" if res["precision"] == "fp8" else
                                                     " (the seed uses FP8; this planner build has no fp8 peak or "
                                                     "byte accounting, so the study runs in bf16)")
             + f", runtime model **{res['runtime']}**, system `{SYSTEM}` with `--system-set` overrides, sequence "
             f"{SEQ}, global batch {BATCH}. Search time for everything: {res['seconds']:.0f} s.", "",
             "Offload kinds searched: " + ", ".join(OFFLOADS) + ".", "",
             f"Model shapes (seed §2 rule: h/blocks linear in blocks, fitted to its Table II: h/blocks = "
             f"{slope:.3f}·blocks + {intercept:.1f}; blocks in steps of {BLOCK_STEP}; heads = blocks; ffn 4h):", "",
             "| nominal | blocks = heads | hidden | parameters | largest tp on 2^k GPUs |", "|---|---|---|---|---|"]
    for name, m in res["models"].items():
        cfg = block_model(m["blocks"], m["hidden"] // m["blocks"])
        lines.append(f"| {name} | {m['blocks']} | {m['hidden']} | {param_count(cfg) / 1e12:.2f}T | {max_tp(m['blocks'])} |")
    lines += ["", "## Findings", "", "| seed finding | seed | luban | agree | why / where luban differs |",
              "|---|---|---|---|---|"]
    for f in findings(res):
        lines.append(f"| {f['finding']} | {f['seed']} | {f['luban']} | {f['agree']} | {f['why']} |")
    lines += ["", "## (a) best MFU by model size on 4,096 GPUs", "",
              "| size | HBM | no offload | " + " | ".join(f"{c} GiB @ {g:g}" for c in OFFLOAD_GIB for g in OFFLOAD_GBPS)
              + " |", "|---|---|" + "---|" * (1 + len(OFFLOAD_GIB) * len(OFFLOAD_GBPS))]
    for hbm in HBM_GIB:
        for t in sorted({r["size_t"] for r in res["a"]}):
            cells = [_mfu(res, t, hbm, "none")] + [_mfu(res, t, hbm, f"{c}GiB@{g:g}") for c in OFFLOAD_GIB
                                                   for g in OFFLOAD_GBPS]
            lines.append(f"| {t:g}T | {hbm} | " + " | ".join(_pct(c) if c else "-" for c in cells) + " |")
    lines += ["", f"## (b) strong scaling of the 1T model (offload tier {SCALING_TIER[0]} GiB @ {SCALING_TIER[1]} GB/s)",
              "", "Space: luban = luban's whole search; seed = no context parallel, 1F1B/interleaved only, pp "
              "dividing the blocks (what Calculon searched).", "",
              "| GPUs | NVLink | space | MFU | tokens/s | best layout |", "|---|---|---|---|---|---|"]
    for r in sorted(res["b"], key=lambda r: (r.get("space", "luban"), r["nvlink"], r["gpus"])):
        lines.append(f"| {r['gpus']} | {r['nvlink']} | {r.get('space', 'luban')} | {_pct(r['mfu'])} | "
                     f"{r['tokens_per_s']:,.0f} | {r['layout']} |")
    lines += ["", "## (c) 256 vs 254 blocks on 4,096 GPUs", "",
              "| blocks | space | evaluated | valid + fit | best MFU | best layout |", "|---|---|---|---|---|---|"]
    for r in res["c"]:
        lines.append(f"| {r['blocks']} | {r.get('space', 'luban')} | {r['evaluated']:,} | {r['valid']:,} | "
                     f"{_pct(r['mfu'])} | {r['layout']} |")
    return "\n".join(lines) + "\n"


STUDIES = {"seed003": run}
