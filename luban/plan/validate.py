"""Reproduce the published tables with one system profile and no per-row adjustment.

* Korthikanti et al. 2022, Table 5: iteration time of 4 models, full recompute (tensor parallel
  all-reduce) and sequence parallel + selective recompute, at the published layouts.
* Narayanan et al. 2021, Table 1: TFLOP/s per GPU (their Eq. 3, i.e. our ``tflops_per_gpu``)
  at the published tp, pp, dp, with full recompute and the 1F1B schedule; the micro-batch size
  is not published, so each row takes the size (<= 8) the planner predicts fastest, as the
  authors tuned it.
* ZeRO Table 1: model-state GB per device for mixed-precision Adam (K = 12), printed rounded.
* Megatron-Bridge H100 MoE rows (``megatron_bridge_h100_moe_shared.csv``): tokens/s per GPU of
  Qwen3-30B-A3B and GPT-OSS-120B at the published tp/pp/vp/ep, ``runtime="megatron-core"``,
  dropless with forced balanced routing (expert imbalance 1), distributed optimizer (zero 1),
  no recompute (the recipes' recompute settings are not in the table), each row's token dispatcher
  and all-to-all overlap from its release's recipe (``BRIDGE_MOE_RECIPES``); the FP8 rows at
  ``precision="fp8"`` (FP8 GEMM peak for dense and expert GEMMs). Not modelled: GPT-OSS's
  sliding-window layers and attention sinks (full causal attention is charged); skipped: the
  hybrid Mamba Nemotron 3 Nano rows and the 25.09 token-drop row.

* H100 tables (reference README): Megatron-Bridge dense pre-training rows (fp8, runtime
  ``megatron-core``), NeMo's Llama 2 7B context-parallel rows (fp8, 4K-1M tokens) and Llama 3
  Table 4 (bf16, ``fsdp2`` at zero 2), on ``dgx-h100``; ``h100-fitted`` and ``h100-held-out``
  summarise the rows ``bench/plan_calibrate_hopper.py`` fitted the profile to and the others.

The papers ran Megatron-LM (fp16, plain data parallel), so these use ``runtime="megatron"``
and are not subject to luban's own layout rules (``check_layout``).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np

from luban.errors import LubanError, bad_value
from luban.model.config import ModelConfig
from luban.parallel.layout import ParallelLayout
from luban.plan.estimate import Estimate, evaluate
from luban.plan.grid import FP16, Grid
from luban.plan.memory import model_state_bytes, param_bytes
from luban.plan.problem import Problem
from luban.plan.system import System, load_system

PACKAGED = Path(__file__).with_name("reference")


def reference_dir() -> Path:
    """``$LUBAN_REFERENCE_DIR`` if set, else the copies shipped in ``luban/plan/reference``."""
    return Path(os.environ.get("LUBAN_REFERENCE_DIR") or PACKAGED)


def read_table(name: str) -> list[dict]:
    """The rows of reference table ``name``; a copy named by ``$LUBAN_REFERENCE_DIR`` that lacks it or
    cannot be read is a one-line error."""
    read_table.last = name  # named by the error of a copy whose cells do not parse (``validate_all``)
    try:
        with open(reference_dir() / name, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise _bad_copy(name, err) from None


read_table.last = ""


def _bad_copy(name: str, err: Exception) -> LubanError:
    """The error of a reference table that cannot be read or parsed: names ``$LUBAN_REFERENCE_DIR`` where
    it is set (the user's copy), else the packaged folder."""
    what = getattr(err, "strerror", None) or f"{type(err).__name__}: {err}"
    key = "LUBAN_REFERENCE_DIR" if os.environ.get("LUBAN_REFERENCE_DIR") else "reference folder"
    return bad_value(key, str(reference_dir()), f"a folder of the reference tables luban/plan/reference ships, "
                                                f"readable and parsing ({name}: {what})".replace("\n", " "))


def _megatron_gpt(hidden: int, layers: int, heads: int, name: str) -> ModelConfig:
    return ModelConfig(name=name, arch="gpt2", hidden=hidden, layers=layers, heads=heads, vocab=51200, seq_len=2048)


def _estimate(model, system, layout: ParallelLayout, gpus: int, global_batch: int) -> Estimate:
    problem = Problem(model, system, gpus, 2048, global_batch, runtime="megatron")
    g = Grid.from_layout(layout)
    return Estimate.from_results(problem, g, evaluate(problem, g))


# The machine of the A100 tables (Korthikanti et al. 2022 Sec. 5 and Narayanan et al. 2021 Sec. 5: NVIDIA's
# Selene, DGX A100 80GB nodes): the profile they are planned on by default, and the GPU any other must describe
A100_TABLES_SYSTEM = "dgx-a100-80g"


def a100_system(system=A100_TABLES_SYSTEM, key: str = "--system") -> System:
    """The profile the A100 tables are planned on: ``system`` (a built-in name, a profile file or a
    ``System``) where it describes their GPU -- a GPU profile (no probed ``[cpu]`` table) whose dense fp16
    peak is ``A100_TABLES_SYSTEM``'s datasheet figure (an A100 profile of another node or calibration) --
    else a one-line error: a table measured on an A100 planned on another chip scores the chip, not
    the planner."""
    typed = system.name if isinstance(system, System) else str(system)  # as the user named it (a path)
    system = system if isinstance(system, System) else load_system(system)
    reference = load_system(A100_TABLES_SYSTEM)
    peak = system.peak_flops.get("fp16")
    if system.cpu or peak != reference.peak_flops["fp16"]:
        what = "a probed CPU" if system.cpu else (f"fp16 peak {peak / 1e12:g} TFLOP/s" if peak else "no fp16 peak")
        raise bad_value(key, typed, f"the A100 tables (Korthikanti 2022, Narayanan 2021) were measured on DGX A100 "
                                    f"(Selene): an A100 profile, fp16 peak {reference.peak_flops['fp16'] / 1e12:g} "
                                    f"TFLOP/s, e.g. {A100_TABLES_SYSTEM} (this profile: {what})")
    return system


def korthikanti_table5(system=A100_TABLES_SYSTEM) -> list[dict]:
    system = a100_system(system)
    rows = []
    for r in read_table("korthikanti2022_table5_iteration_time_mfu.csv"):
        model = _megatron_gpt(int(r["hidden"]), int(r["layers"]), int(r["attention_heads"]), r["model"])
        tp, pp, gpus = int(r["TP"]), int(r["PP"]), int(r["num_GPUs"])
        v = 3 if r["model"] in ("gpt3-175B", "turing-530B") else 1  # "3 model chunks per stage"
        for mode, column, sp, recompute in (("full recompute", "iter_time_full_recompute_s", False, "full"),
                                            ("sp + selective", "iter_time_seqpar_plus_selective_s", True, "selective")):
            layout = ParallelLayout(dp=gpus // (tp * pp), tp=tp, pp=pp, sp=sp, recompute=recompute, precision="fp16",
                                    schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v,
                                    micro_batch=int(r["micro_batch_seqs"]))
            est = _estimate(model, system, layout, gpus, int(r["global_batch_seqs"]))
            ref = float(r[column])
            rows.append(dict(table="korthikanti2022-t5", row=f"{r['model']} {mode}", reference=ref,
                             predicted=est.step_time_s, error=est.step_time_s / ref - 1, unit="s", estimate=est))
    return rows


NARAYANAN_MICRO_BATCHES = (1, 2, 4, 8)  # the paper does not publish the micro-batch; its Fig. 16 sweeps 1-8


def narayanan_table1(system=A100_TABLES_SYSTEM, micro_batch: int | None = None) -> list[dict]:
    """TFLOP/s per GPU of Table 1 (Eq. 3 FLOPs, fp16, full recompute, runtime ``megatron``). The
    paper does not publish the micro-batch: by default each row takes the fastest that fits out
    of 1, 2, 4, 8 (the paper tunes it per model, Sec. 3.5); ``micro_batch=1`` forces it, the
    reading #11 sets its goal on (table ``narayanan2021-t1-mb1``)."""
    system = a100_system(system)
    rows = []
    for r in read_table("narayanan2021_table1_weak_scaling.csv"):
        model = _megatron_gpt(int(r["hidden_size"]), int(r["num_layers"]), int(r["attention_heads"]),
                              f"gpt-{r['params_billion']}b")
        tp, pp, gpus, batch = (int(r[k]) for k in ("TP", "PP", "num_GPUs", "global_batch_seqs"))
        dp = gpus // (tp * pp)
        sizes = [b for b in ((micro_batch,) if micro_batch else NARAYANAN_MICRO_BATCHES)
                 if batch % (dp * b) == 0 and batch // (dp * b) >= pp]
        problem = Problem(model, system, gpus, int(r["seq_len"]), batch, runtime="megatron")
        g = Grid.from_layout(ParallelLayout(dp=dp, tp=tp, pp=pp, recompute="full", precision="fp16"))
        g.micro_batch = np.array(sizes)
        results = evaluate(problem, g)
        speed = np.where(results["memory"]["fits"], results["tokens_per_s"], 0.0)
        est = Estimate.from_results(problem, g, results, (int(np.argmax(speed)),))
        ref = float(r["achieved_TFLOPs_per_GPU"])
        rows.append(dict(table="narayanan2021-t1" + (f"-mb{micro_batch}" if micro_batch else ""), row=f"{r['params_billion']}B tp{tp} pp{pp} dp{dp} mb{est.layout.micro_batch}",
                         reference=ref, predicted=est.tflops_per_gpu, error=est.tflops_per_gpu / ref - 1,
                         unit="TFLOP/s", estimate=est))
    return rows


def zero_table1() -> list[dict]:
    """Model states per device, Ψ·(2 + 2 + K) sharded by stage (ZeRO Sec. 5), in GB (1e9)."""
    weight_b, grad_b, optim_b = (float(x) for x in param_bytes("megatron", 2, np.array(FP16)))
    rows = []
    for r in read_table("zero2019_table1_model_state_memory_GB.csv"):
        nd = int(r["DP_degree_Nd"])
        for key, text in r.items():
            if key == "DP_degree_Nd":
                continue
            size, stage = key.split("_")[:2]
            psi = float(size.rstrip("BT")) * (1e9 if size.endswith("B") else 1e12)
            zero = {"Pos": 1, "Pos+g": 2, "Pos+g+p": 3}[stage]
            predicted = sum(model_state_bytes(psi, weight_b, grad_b, optim_b, np.array(zero), nd)) / 1e9
            ref = float(text)
            unit = 10.0 ** -(len(text.split(".")[1]) if "." in text else 0)  # the table's printed precision
            rows.append(dict(table="zero2019-t1", row=f"{size} ZeRO-{zero} Nd={nd}", reference=ref,
                             predicted=float(predicted), error=float(predicted) / ref - 1, unit="GB",
                             exact=abs(float(predicted) - ref) <= unit))
    return rows


MOE_TABLE = "megatron_bridge_h100_moe_shared.csv"
RUNTIME_MOE = "megatron-core"  # Megatron-Bridge trains with Megatron-Core (distributed optimizer, flash attention)


def _moe_model(r: dict) -> ModelConfig:
    """The row's shape (the table's columns) as a Llama-style MoE ``ModelConfig``."""
    expert = int(r["expert_ffn_hidden"])
    return ModelConfig(name=r["model_as_published"], arch="llama", hidden=int(r["hidden"]), layers=int(r["layers"]),
                       heads=int(r["heads"]), kv_heads=int(r["kv_heads"]), head_dim=int(r["head_dim"]),
                       vocab=int(r["vocab"]), seq_len=int(r["seq_len_tokens"]),
                       ffn_hidden=int(r["dense_ffn_hidden"] or expert), experts=int(r["num_experts"]),
                       experts_per_token=int(r["top_k"]), expert_ffn_hidden=expert,
                       shared_experts=int(r["num_shared_experts"] or 0), dense_layers=int(r["num_dense_layers"] or 0))


# The token dispatcher and all-to-all overlap each Megatron-Bridge MoE row ran with (not in the published
# table): the H100 performance recipe of that release, NVIDIA-NeMo/Megatron-Bridge scripts/performance/
# configs at the release's tag (25.11 = v0.2.0, 26.02 = v0.3.0, 26.04 = v0.4.0, 26.04.01 = v0.4.1;
# 26.06 = v0.5.0), where the published layout agrees with it.
# - Qwen3-30B-A3B: 25.11 alltoall with --moe-a2a-overlap (qwen3/workload_base_configs.py @v0.2.0);
#   26.02 and 26.02.01: pp2 vp12 ep8 (the published layout) with DeepEP + overlap (qwen/
#   qwen3_workload_base_configs.py @v0.3.0), except that the 26.02 container had no DeepEP
#   (docs/releases/known-issues.md, 26.02: "DeepEP is not supported in the current NeMo framework 26.02
#   container ... reduced DSv3 performance ... on H100"): 26.02 ran the alltoall dispatcher (its 5,113
#   tokens/s/GPU against 26.02.01's 9,058 on the same layout); 26.02.01 prints v0.3.0's layout, not
#   v0.3.1's (ep16 HybridEP), so it ran v0.3.0's configs; 26.04-26.06 HybridEP (per-node deduplicated
#   dispatch: --dispatcher hybridep) without overlap, ep16 pp1 (@v0.4.0-v0.5.0).
# - Qwen3-235B-A22B (tp2 pp8 vp4 ep32, every release): --moe-a2a-overlap and no flex backend, i.e. the
#   alltoall dispatcher: BASE_QWEN3_235B_A22B_CONFIG has none @v0.2.0, @v0.3.0 and from @v0.4.0, where
#   commit e1088f62 (2026-04-02) sets moe_token_dispatcher_type = "alltoall" when no backend is given;
#   26.02.01 ran v0.3.0's configs (above; v0.3.1's base asks DeepEP).
#   Its H100 config also turns TransformerEngine's TP overlap off (``CommOverlapConfig(tp_comm_overlap=False)``
#   in qwen3_llm_pretrain.py's H100 function @v0.2.0-v0.4.1): planned with ``tp_overlap=False``
#   (``BRIDGE_TP_OVERLAP_OFF``).
# - GPT-OSS-120B: alltoall, no overlap in every release (gpt_oss recipes).
_QWEN3, _QWEN3_235B = "Qwen3_30B_a3B", "Qwen3_235B_a22B"
BRIDGE_MOE_RECIPES = {(_QWEN3, "25.11"): ("alltoall", True), (_QWEN3, "26.02"): ("alltoall", True),
                      (_QWEN3, "26.02.01"): ("deepep", True), (_QWEN3, "26.04"): ("hybridep", False),
                      (_QWEN3, "26.04.01"): ("hybridep", False), (_QWEN3, "26.06"): ("hybridep", False),
                      **{(_QWEN3_235B, c): ("alltoall", True) for c in ("25.11", "26.02", "26.02.01", "26.04", "26.04.01")}}
BRIDGE_TP_OVERLAP_OFF = {_QWEN3_235B}  # models whose H100 recipe sets tp_comm_overlap=False (the others run tp 1)
MOE_235B_TABLE = "megatron_bridge_h100_moe_qwen3_235b.csv"  # the same source's Qwen3-235B-A22B rows


# Megatron-Bridge's H100 performance recipes keep and reduce the main gradients in bf16 since its
# v0.2.0 tag (the 25.11 container): scripts/performance/configs/{llama3,qwen3,gpt_oss}/*_llm_pretrain.py
# @v0.2.0 (and llama/, qwen/ at v0.3.0-v0.4.x) set ``cfg.mixed_precision.grad_reduce_in_fp32 = False`` and
# ``cfg.ddp.grad_reduce_in_fp32 = False``; the 25.09 rows have no such recipe in the repository (default kept)
BRIDGE_BF16_GRADS_SINCE = "25.11"


def bridge_grad_reduce_fp32(container: str) -> bool | None:
    """``Problem.grad_reduce_fp32`` of a Megatron-Bridge row: False from ``BRIDGE_BF16_GRADS_SINCE`` on."""
    def release(name):  # "26.02.01" -> (26, 2, 1): compared as numbers, not as text
        return tuple(int(part) for part in name.split("."))

    return False if release(container) >= release(BRIDGE_BF16_GRADS_SINCE) else None


def _bridge_moe_row(container: str, model_name: str, model: ModelConfig, system, precision: str, gpus: int, tp: int,
                    pp: int, cp: int, vp: int, ep: int, micro_batch: int, seq: int, batch: int, tokens: float) -> dict:
    """One Megatron-Bridge MoE row planned at its layout (zero 1, sequence parallel with tp > 1) with
    its release's dispatcher and overlap (``BRIDGE_MOE_RECIPES``, ``BRIDGE_TP_OVERLAP_OFF``)."""
    fp8 = precision.startswith("FP8")
    layout = ParallelLayout(dp=gpus // (tp * pp * cp), tp=tp, sp=tp > 1, pp=pp, cp=cp, ep=ep, zero=1,
                            precision="fp8" if fp8 else "bf16", schedule="interleaved-1f1b" if vp > 1 else "1f1b",
                            virtual_stages=vp, micro_batch=micro_batch)
    dispatcher, overlap = BRIDGE_MOE_RECIPES.get((model_name, container), ("alltoall", False))
    name = (f"{container} {model_name} {precision} tp{tp} pp{pp} vp{vp} ep{ep}"
            + (f" {dispatcher}" if dispatcher != "alltoall" else "") + (" a2a-overlap" if overlap else ""))
    return _tokens_row("megatron-bridge-h100-moe", name, model, system, layout, gpus, seq, batch, RUNTIME_MOE, tokens,
                       attention_kernel=BRIDGE_ATTENTION, dispatcher=dispatcher, ep_overlap=overlap,
                       tp_overlap=False if model_name in BRIDGE_TP_OVERLAP_OFF else None,
                       grad_reduce_fp32=bridge_grad_reduce_fp32(container), fp8=fp8)


def megatron_bridge_moe(system="dgx-h100") -> list[dict]:
    """Tokens/s per GPU of the Megatron-Bridge MoE rows (module docstring: what is not modelled): the
    shared selection (GPT-OSS-120B, Qwen3-30B-A3B) and every Qwen3-235B-A22B H100 row."""
    system = load_system(system)
    rows = []
    for r in read_table(MOE_TABLE):
        if r["model_as_published"].startswith("Nemotron") or "tokendrop" in r["moe_token_policy"]:
            continue
        rows.append(_bridge_moe_row(r["container"], r["model_as_published"], _moe_model(r), system,
                                    r["precision_as_published"], *(int(r[k]) for k in ("num_gpus", "tp", "pp", "cp")),
                                    int(r["vp"] or 1), int(r["ep"]), int(r["micro_batch_size_seqs"]),
                                    int(r["seq_len_tokens"]), int(r["global_batch_size_seqs"]),
                                    float(r["tokens_per_s_per_gpu"])))
    for r in read_source_table(MOE_235B_TABLE):
        seq = int(r["seq"])
        rows.append(_bridge_moe_row(r["container"], r["model"], QWEN3_235B.replace(seq_len=seq), system, r["precision"],
                                    *(int(r[k]) for k in ("gpus", "tp", "pp", "cp", "vp", "ep", "micro_batch")), seq,
                                    int(r["global_batch"]), float(r["tokens_per_s_per_gpu"])))
    return rows


MODELZOO_TABLE = "megatron_moe_modelzoo_qwen3_h100.csv"
# Qwen3-235B-A22B (the CSV's citation lines: Qwen3 report Table 2, Hugging Face config.json)
QWEN3_235B = ModelConfig(name="qwen3-235b-a22b", arch="llama", hidden=4096, layers=94, heads=64, kv_heads=4, head_dim=128,
                         vocab=151936, seq_len=4096, ffn_hidden=1536, experts=128,
                         experts_per_token=8, expert_ffn_hidden=1536, qk_norm=True)


def megatron_moe_modelzoo(system="dgx-h100") -> list[dict]:
    """Step time of the Megatron-Core MoE team's Qwen3-235B-A22B rows on 256 H100 (a second MoE
    source: another team than the Megatron-Bridge performance pages), ``runtime="megatron-core"``
    at the published tp/ep/pp/vpp (sequence parallel with tp > 1, distributed optimizer: zero 1;
    Megatron-FSDP: zero 3), forced-balanced routing as the page's benchmarks (imbalance 1), the
    rows' dispatcher (DeepEP: one copy per destination node) and, in the second row, the 1F1B
    all-to-all overlap (``Problem.ep_overlap``, an upper bound; docs/planner.md, MoE)."""
    system = load_system(system)
    rows = []
    for r in read_source_table(MODELZOO_TABLE):
        gpus, tp, pp, cp, ep, vp = (int(r[k]) for k in ("gpus", "tp", "pp", "cp", "ep", "vpp"))
        layout = ParallelLayout(dp=gpus // (tp * pp * cp), tp=tp, sp=tp > 1, pp=pp, cp=cp, ep=ep,
                                zero=3 if r["fsdp"] == "On" else 1, precision="bf16", recompute=r["recompute"],
                                schedule="interleaved-1f1b" if vp > 1 else "1f1b", virtual_stages=vp,
                                micro_batch=int(r["micro_batch"]))
        seq, batch = int(r["seq"]), int(r["global_batch"])
        problem = Problem(QWEN3_235B.replace(seq_len=seq), system, gpus, seq, batch, runtime=RUNTIME_MOE,
                          attention_kernel=BRIDGE_ATTENTION, dispatcher="deepep" if r["dispatcher"] == "DeepEP" else "alltoall",
                          ep_overlap="1f1b overlap" in r["notes"])
        g = Grid.from_layout(layout)
        est = Estimate.from_results(problem, g, evaluate(problem, g))
        ref = float(r["step_time_s"])
        label = (f"{r['model']} {r['dispatcher']} tp{tp} ep{ep} pp{pp} vp{vp} dp{layout.dp} mb{r['micro_batch']} "
                 f"rc={r['recompute_as_published'] or 'none'}" + (" fsdp" if r["fsdp"] == "On" else "")
                 + (" 1f1b-overlap" if "overlap" in r["notes"] else ""))
        rows.append(dict(table="megatron-moe-modelzoo-h100", row=label, reference=ref, predicted=est.step_time_s,
                         error=est.step_time_s / ref - 1, unit="s", estimate=est, seq=seq))
    return rows


DENSE_TABLE, LLAMA3_TABLE, CP_TABLE = ("megatron_bridge_h100_dense.csv", "llama3_2024_table4_h100.csv",
                                      "nemo_long_sequence_cp_h100.csv")


def _llama(r: dict, seq: int, vocab_key: str = "vocab", head_dim_key: str = "head_dim") -> ModelConfig:
    """A Llama-shaped ``ModelConfig`` from a row's shape columns (SwiGLU, RMSNorm, RoPE, untied)."""
    return ModelConfig(name=r.get("model_as_published") or r.get("model", "llama"), arch="llama", hidden=int(r["hidden"]),
                       layers=int(r["layers"]), heads=int(r["heads"]), kv_heads=int(r["kv_heads"]),
                       head_dim=int(r[head_dim_key]), ffn_hidden=int(r["ffn_hidden"]), vocab=int(r[vocab_key]),
                       seq_len=seq)


def _tokens_row(table: str, name: str, model: ModelConfig, system, layout: ParallelLayout, gpus: int, seq: int,
                batch: int, runtime: str, ref_tokens: float, attention_kernel: str = "fa3", compiled=None,
                dispatcher: str = "alltoall", ep_overlap: bool = False, tp_overlap: bool | None = None,
                grad_reduce_fp32: bool | None = None, **extra) -> dict:
    problem = Problem(model, system, gpus, seq, batch, runtime=runtime, attention_kernel=attention_kernel,
                      compiled=compiled, dispatcher=dispatcher, ep_overlap=ep_overlap, tp_overlap=tp_overlap,
                      grad_reduce_fp32=grad_reduce_fp32)
    g = Grid.from_layout(layout)
    est = Estimate.from_results(problem, g, evaluate(problem, g))
    predicted = est.tokens_per_s / gpus
    return dict(table=table, row=name, reference=ref_tokens, predicted=predicted, error=predicted / ref_tokens - 1,
                unit="tokens/s/GPU", estimate=est, seq=seq, **extra)


def megatron_bridge_dense(system="dgx-h100") -> list[dict]:
    """Tokens/s per GPU of the Megatron-Bridge H100 dense pre-training rows (SFT/LoRA skipped),
    runtime ``megatron-core``: distributed optimizer (zero 1; zero 3 where the row lists
    Megatron-FSDP), sequence parallel with tp > 1, interleaved pipeline at the published vp, no
    recompute (not in the table), fp8 (25.09 rows have no precision column; that release ran
    these models in FP8, the reference README)."""
    system = load_system(system)
    rows = []
    for r in read_table(DENSE_TABLE):
        if r["task"] != "Pre-Training":
            continue
        gpus, tp, pp, cp = (int(r[k]) for k in ("num_gpus", "tp", "pp", "cp"))
        vp, seq = int(r["vp"] or 1), int(r["seq_len_tokens"])
        fsdp = int(r["fsdp_as_published"] or 0) > 1
        layout = ParallelLayout(dp=gpus // (tp * pp * cp), tp=tp, pp=pp, cp=cp, sp=tp > 1, zero=3 if fsdp else 1,
                                precision="fp8", schedule="interleaved-1f1b" if vp > 1 else "1f1b",
                                virtual_stages=vp, micro_batch=int(r["micro_batch_size_seqs"]))
        rows.append(_tokens_row("megatron-bridge-h100-dense", f"{r['container']} {r['model_as_published']} "
                                f"{r['precision_as_published'] or 'FP8?'} tp{tp} pp{pp} cp{cp} vp{vp}", _llama(r, seq),
                                system, layout, gpus, seq, int(r["global_batch_size_seqs"]), "megatron-core",
                                float(r["tokens_per_s_per_gpu"]), attention_kernel=BRIDGE_ATTENTION,
                                grad_reduce_fp32=bridge_grad_reduce_fp32(r["container"])))
    return rows


# the fused attention generation each table's software ran (``Problem.attention_kernel``)
NEMO_CP_ATTENTION = "fa2"  # NeMo 24.03 (March 2024): before FlashAttention-3 (July 2024) and cuDNN's Hopper kernels in TE
LLAMA3_ATTENTION = "fa2"  # Llama 3 was trained before FlashAttention-3 was published (July 2024)
LLAMA3_FUSED = True  # Meta's production stack, not torchtitan's eager model: fused elementwise kernels (planned as compiled)
BRIDGE_ATTENTION = "fa3"  # Megatron-Bridge 25.09-26.06 containers: TE's cuDNN fused attention on Hopper


def nemo_long_sequence(system="dgx-h100") -> list[dict]:
    """Llama 2 7B with context parallel, 4K to 1M tokens (NeMo 24.03.01, FP8, megatron-core): the
    published TFLOP/s per GPU turned into tokens/s with the non-causal FLOPs formula NeMo used
    (the reference README; the table's ``..._if_noncausal_derived`` column)."""
    system = load_system(system)
    rows = []
    for r in read_table(CP_TABLE):
        gpus, seq = int(r["num_gpus"]), int(r["seq_len_tokens_derived"])
        tp, pp, dp, cp = (int(r[k]) for k in ("tp_with_cp", "pp_with_cp", "dp_with_cp", "cp_with_cp"))
        layout = ParallelLayout(dp=dp, tp=tp, pp=pp, cp=cp, sp=tp > 1, zero=1, precision="fp8", micro_batch=1)
        rows.append(_tokens_row("nemo-h100-long-sequence-cp", f"Llama2-7B seq {r['seq_len_K_as_published']}K "
                                f"tp{tp} pp{pp} dp{dp} cp{cp}", _llama(r, seq), system, layout, gpus, seq,
                                int(r["global_batch_size_seqs"]), "megatron-core",
                                float(r["tokens_per_s_per_gpu_with_cp_if_noncausal_derived"]),
                                attention_kernel=NEMO_CP_ATTENTION))
    return rows


def llama3_table4(system="dgx-h100") -> list[dict]:
    """Llama 3 405B on 8K/16K H100s (Table 4): BF16 MFU at the published tp, cp, pp and the
    derived dp (the 131K row's printed DP = 4 contradicts its 16M-token batch), runtime ``fsdp2``
    at zero 2 (FSDP that keeps parameters unsharded after forward, Sec. 3.3.2). The interleave
    depth is not published: each row takes the fastest of v in 1, 2, 4 (as Narayanan's
    micro-batch)."""
    system = load_system(system)
    rows = []
    for r in read_table(LLAMA3_TABLE):
        gpus, seq = int(r["num_gpus"]), int(r["seq_len_tokens"])
        tp, cp, pp, dp = (int(r[k]) for k in ("tp", "cp", "pp", "dp_derived"))
        model = _llama(r, seq, vocab_key="vocab_config", head_dim_key="head_dim_derived")
        batch = int(r["tokens_per_batch_derived"]) // seq
        best = None
        for v in (1, 2, 4):
            layout = ParallelLayout(dp=dp, tp=tp, pp=pp, cp=cp, sp=True, zero=2, precision="bf16", micro_batch=1,
                                    schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v)
            row = _tokens_row("llama3-2024-t4-h100", f"405B {gpus} GPUs seq {seq} tp{tp} cp{cp} pp{pp} dp{dp} v{v}",
                              model, system, layout, gpus, seq, batch, "fsdp2", 1.0, attention_kernel=LLAMA3_ATTENTION,
                              compiled=LLAMA3_FUSED)
            if best is None or row["estimate"].mfu > best["estimate"].mfu:
                best = row
        ref = float(r["bf16_mfu_pct"]) / 100
        best.update(reference=ref, predicted=best["estimate"].mfu, error=best["estimate"].mfu / ref - 1, unit="MFU")
        rows.append(best)
    return rows


def is_fitted(row: dict) -> bool:
    """Whether bench/plan_calibrate_hopper.py fitted the H100 profile to this row: the
    Megatron-Bridge dense rows of the 26.x containers, Llama 3 Table 4 at seq 8K and the NeMo
    context-parallel rows up to 128K tokens. Every other H100 row (25.x containers, NeMo at
    256K-1M tokens, Llama 3 at 131K) is held out."""
    if row["table"] == "megatron-bridge-h100-dense":
        return row["row"].startswith("26.")
    if row["table"] == "nemo-h100-long-sequence-cp":
        return row["seq"] <= LONGEST_FITTED_SEQ
    return row["table"] == "llama3-2024-t4-h100" and row["seq"] == 8192


LONGEST_FITTED_SEQ = 131072  # NeMo rows up to 128K tokens fit attention_matmul; 256K-1M are held out


HOPPER_TABLES = {"megatron-bridge-h100-dense": megatron_bridge_dense, "nemo-h100-long-sequence-cp": nemo_long_sequence,
                 "llama3-2024-t4-h100": llama3_table4}


def summary(rows: list[dict]) -> dict:
    errors = np.abs([r["error"] for r in rows])
    return {"rows": len(rows), "mean_abs_error": float(errors.mean()), "max_abs_error": float(errors.max())}


def validate_all(system=A100_TABLES_SYSTEM) -> dict:
    """Every table; ``system``: the (A100) profile of the A100 tables (``a100_system``); the H100
    tables and the independent sources are planned on their own machines' profiles."""
    system = a100_system(system)  # refused before minutes of work, not after
    if not os.environ.get("LUBAN_REFERENCE_DIR"):
        return _validate_all(system)
    try:  # the user's copy of the tables: a cell that does not parse is theirs to fix, in one line
        return _validate_all(system)
    except (ValueError, KeyError, IndexError, TypeError, ZeroDivisionError) as err:
        raise _bad_copy(read_table.last, err) from None


def _validate_all(system: System) -> dict:
    tables = {"korthikanti2022-t5": korthikanti_table5(system), "narayanan2021-t1": narayanan_table1(system),
              "narayanan2021-t1-mb1": narayanan_table1(system, micro_batch=1),
              "zero2019-t1": zero_table1()}
    hopper = []
    for name, table in HOPPER_TABLES.items():
        tables[name] = table()
        hopper += tables[name]
    tables["h100-fitted"] = [r for r in hopper if is_fitted(r)]
    tables["h100-held-out"] = [r for r in hopper if not is_fitted(r)]
    for name, fn in SOURCE_TABLES.items():  # independent sources (docs/planner.md "Validation by source")
        tables[name] = fn()
    moe = megatron_bridge_moe()
    tables["megatron-bridge-h100-moe-bf16"] = [r for r in moe if not r["fp8"]]
    tables["megatron-bridge-h100-moe-fp8"] = [r for r in moe if r["fp8"]]
    tables["megatron-moe-modelzoo-h100"] = megatron_moe_modelzoo()
    return {name: {"summary": summary(rows), "rows": rows} for name, rows in tables.items()}


# --- independent sources: one CSV format (luban/plan/reference/README.md) ------------------------

# Machines of the new sources that no built-in profile describes: a built-in profile with the
# published differences, each cited here (the efficiency curves stay the base's calibration).
DERIVED_SYSTEMS = {
    # torchtitan benchmarks/llama3_h100_202412_torchtitan.md "Hardware": 96 GB HBM2e at 2.4 TB/s, 500 W
    # power limit, 400 Gb/s RDMA per GPU. Peak FLOP/s: the page says it lies between H100 SXM and NVL
    # and is unknown; the SXM datasheet peak is kept (as the page's own MFU figure does).
    "grand-teton-h100": ("dgx-h100", {"hbm_bytes": 96 * 2**30, "hbm_bandwidth": 2.4e12,
                                      "description": "Grand Teton: 8x H100 96GB HBM2e 500 W per host, 400 Gb/s RDMA per GPU"}),
    # bigscience train/tr11-176B-ml/README.md "Hardware": 8 A100 80GB per node, NVLink, 4x 100 Gb/s
    # Omni-Path per node (= 50 GB/s per node, 6.25 GB/s per GPU)
    "jean-zay-a100-80g": ("dgx-a100-80g", {"internode_bandwidth": 6.25e9,
                                           "description": "Jean Zay: 8x A100 80GB per node, 4x 100 Gb/s Omni-Path per node"}),
}


def source_system(name: str, systems: dict | None = None):
    """The profile of a source's ``system`` cell; ``systems`` maps built-in names to (candidate)
    profiles, so a refit's candidate reaches the derived machines too."""
    systems = systems or {}
    if name in DERIVED_SYSTEMS:
        base, changes = DERIVED_SYSTEMS[name]
        raw = {**load_system(systems.get(base, base)).to_dict(), **changes, "name": name}
        return System.from_dict(raw, source=name)
    return load_system(systems.get(name, name))


def read_source_table(name: str) -> list[dict]:
    """A source CSV: ``#`` lines are its citation, then a header and one row per measurement."""
    with open(reference_dir() / name, newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def _source_model(r: dict) -> ModelConfig:
    """The row's shape: ``llama`` (SwiGLU, RMSNorm, RoPE; untied unless ``tie_embeddings`` = yes), ``mpt`` (GELU, LayerNorm, no
    biases, tied; ALiBi charged as a learned position table: ``seq·h`` parameters, no FLOPs) or
    ``bloom`` (Megatron GPT: GELU, LayerNorm, biases, tied; ALiBi likewise)."""
    arch = r["arch"]
    common = dict(name=r["model"], hidden=int(r["hidden"]), layers=int(r["layers"]), heads=int(r["heads"]),
                  kv_heads=int(r["kv_heads"]), ffn_hidden=int(r["ffn_hidden"]), vocab=int(r["vocab"]),
                  seq_len=int(r["seq"]), dropout=float(r.get("dropout") or 0.0))
    if arch == "llama":
        return ModelConfig(arch="llama", tie_embeddings=r.get("tie_embeddings") == "yes", **common)
    return ModelConfig(arch="gpt2", bias=arch == "bloom", **common)


def source_rows(name: str, table: str, systems: dict | None = None) -> list[dict]:
    """Every row of a source CSV, planned at its published layout; the reference is tokens/s per
    GPU or seconds per step (``metric``). ``tokens_per_s_per_gpu_relative``: a source whose
    machine's peak is not known (torchtitan's 500 W H100s) is scored on its rows' ratios to its
    first such row (the anchor, not scored itself): what the runtime model decides (compiled or
    eager, scaling out, tensor parallel, model size), not the unknown clock."""
    rows, anchor = [], None
    for r in read_source_table(name):
        gpus, tp, pp, cp, vp = (int(r[k]) for k in ("gpus", "tp", "pp", "cp", "vp"))
        precision = r["precision"]
        layout = ParallelLayout(dp=gpus // (tp * pp * cp), tp=tp, pp=pp, cp=cp, sp=r.get("sp") == "yes", zero=int(r["zero"]),
                                precision=precision, recompute=r["recompute"],
                                schedule="interleaved-1f1b" if vp > 1 else "1f1b", virtual_stages=vp,
                                micro_batch=int(r["micro_batch"]))
        compiled = {"yes": True, "no": False, "blocks": "blocks"}.get(r.get("compile", ""), None)
        seq, batch = int(r["seq"]), int(r["global_batch"])
        tp_overlap = {"on": True, "off": False}.get(r.get("tp_overlap") or "", None)  # empty: the runtime's default
        problem = Problem(_source_model(r), source_system(r["system"], systems), gpus, seq, batch,
                          runtime=r["runtime"], attention_kernel="fa2", compiled=compiled, tp_overlap=tp_overlap)
        g = Grid.from_layout(layout)
        est = Estimate.from_results(problem, g, evaluate(problem, g))
        ref = float(r["value"])
        if r["metric"] == "step_time_s":
            predicted, unit = est.step_time_s, "s"
        else:
            predicted, unit = est.tokens_per_s / gpus, "tokens/s/GPU"
        if r["metric"] == "tokens_per_s_per_gpu_relative" and anchor is None:
            anchor = predicted / ref  # the file's first relative row: the others are scored against it
            continue
        if r["metric"] == "tokens_per_s_per_gpu_relative":
            predicted = predicted / anchor  # (pred_i / pred_0) / (ref_i / ref_0) - 1, in ref_i's units
        label = (f"{r['model']} {r['system']} {gpus} GPUs tp{tp}{' sp' if layout.sp else ''} pp{pp} cp{cp} zero{r['zero']} "
                 f"mb{r['micro_batch']} {r['recompute']}" + (" async-tp" if tp_overlap else ""))
        rows.append(dict(table=table, row=label + (f" compile={r['compile']}" if r.get("compile") else ""),
                         reference=ref, predicted=predicted, error=predicted / ref - 1, unit=unit, estimate=est,
                         seq=seq, source=r["source"], citation=r["citation"]))
    return rows


SINGLE_GPU_TABLE = "h100_single_gpu_measured.csv"
# runner of the single-GPU file -> (runtime, Problem.compiled): luban's Engine at 3457f4b compiled
# the model parts with the loss outside (issue 22's profile: an fp32 logits copy and an eager
# log-softmax), i.e. "blocks"; Hugging Face (``transformers``: its own activation and attention mask)
# and the reference loop are plain single-process loops (their losses sit inside the compiled forward: True)
SINGLE_GPU_RUNNERS = {("luban Engine", "no"): ("luban", False), ("luban train (metrics.jsonl time_step_s)", "no"): ("luban", False),
                      ("luban Engine", "yes"): ("luban", "blocks"), ("luban Engine (rope mended)", "no"): ("luban", False),
                      ("luban Engine (rope mended)", "yes"): ("luban", "blocks"),
                      ("HF GPT2LMHeadModel (sdpa)", "no"): ("transformers", False),
                      ("HF GPT2LMHeadModel (sdpa)", "yes"): ("transformers", True),
                      ("HF LlamaForCausalLM (sdpa)", "yes"): ("transformers", True),
                      ("HF LlamaForCausalLM (sdpa) second machine", "yes"): ("transformers", True),
                      ("reference", "yes"): ("pytorch", True)}


def h100_single_gpu(systems: dict | None = None) -> list[dict]:
    """The project's own single-H100 measurements (../shared/reference/h100_single_gpu_measured.csv,
    2026-11-25): step time of GPT-2 124M and Llama 1B (luban's presets) at the measured batch,
    seq 1024, bf16, one GPU; the planner's rows of that file are skipped."""
    from luban.model.config import ModelConfig as MC

    system = source_system("dgx-h100", systems)
    rows = []
    for r in read_source_table(SINGLE_GPU_TABLE):
        key = (r["runner"], r["compiled"])
        if key not in SINGLE_GPU_RUNNERS:
            continue
        runtime, compiled = SINGLE_GPU_RUNNERS[key]
        batch, seq = int(r["batch"]), int(r["seq"])
        # luban's rows ran main 3457f4b, before the head's GEMMs were padded (issue #22)
        problem = Problem(MC.from_dict({"preset": r["model"]}), system, 1, seq, batch, runtime=runtime, attention_kernel="fa2",
                          compiled=compiled, pads_vocab=False if runtime == "luban" else None)
        g = Grid.from_layout(ParallelLayout(precision="bf16", micro_batch=batch))
        est = Estimate.from_results(problem, g, evaluate(problem, g))
        ref = float(r["step_ms"]) / 1e3
        rows.append(dict(table="h100-single-gpu", row=f"{r['model']} b{batch} {r['runner']} compiled={r['compiled']}",
                         reference=ref, predicted=est.step_time_s, error=est.step_time_s / ref - 1, unit="s", estimate=est,
                         seq=seq, source="luban-h100-single-gpu"))
    return rows


# the independent sources' tables (each row carries its ``source``: luban.plan.loso)
SOURCE_TABLES = {"mosaicml-llm-foundry": lambda: source_rows("mosaicml_llm_foundry_throughput.csv", "mosaicml-llm-foundry"),
                 "torchtitan-h100": lambda: source_rows("torchtitan_llama3_h100.csv", "torchtitan-h100"),
                 "trainy-torchtitan-h200": lambda: source_rows("trainy_torchtitan_h200.csv", "trainy-torchtitan-h200"),
                 "megatron-deepspeed-a100": lambda: source_rows("megatron_deepspeed_a100.csv", "megatron-deepspeed-a100"),
                 "h100-single-gpu": h100_single_gpu}
