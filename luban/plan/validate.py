"""Reproduce the published tables with one system profile and no per-row adjustment.

* Korthikanti et al. 2022, Table 5: iteration time of 4 models, full recompute (tensor parallel
  all-reduce) and sequence parallel + selective recompute, at the published layouts.
* Narayanan et al. 2021, Table 1: TFLOP/s per GPU (their Eq. 3, i.e. our ``tflops_per_gpu``)
  at the published tp, pp, dp, with full recompute and the 1F1B schedule; the micro-batch size
  is not published, so each row takes the size (<= 8) the planner predicts fastest, as the
  authors tuned it.
* ZeRO Table 1: model-state GB per device for mixed-precision Adam (K = 12), printed rounded.

The papers ran Megatron-LM (fp16, plain data parallel), so these use ``runtime="megatron"``
and are not subject to luban's own layout rules (``check_layout``).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np

from luban.model.config import ModelConfig
from luban.parallel.layout import PRECISIONS, ParallelLayout
from luban.plan.estimate import Estimate, evaluate
from luban.plan.grid import Grid
from luban.plan.memory import model_state_bytes, param_bytes
from luban.plan.problem import Problem
from luban.plan.system import load_system

PACKAGED = Path(__file__).with_name("reference")
FP16 = PRECISIONS.index("fp16")


def reference_dir() -> Path:
    """``$LUBAN_REFERENCE_DIR`` if set, else the copies shipped in ``luban/plan/reference``."""
    return Path(os.environ.get("LUBAN_REFERENCE_DIR") or PACKAGED)


def read_table(name: str) -> list[dict]:
    with open(reference_dir() / name, newline="") as f:
        return list(csv.DictReader(f))


def _megatron_gpt(hidden: int, layers: int, heads: int, name: str) -> ModelConfig:
    return ModelConfig(name=name, arch="gpt2", hidden=hidden, layers=layers, heads=heads, vocab=51200, seq_len=2048)


def _estimate(model, system, layout: ParallelLayout, gpus: int, global_batch: int) -> Estimate:
    problem = Problem(model, system, gpus, 2048, global_batch, runtime="megatron")
    g = Grid.from_layout(layout)
    return Estimate.from_results(problem, g, evaluate(problem, g))


def korthikanti_table5(system="dgx-a100-80g") -> list[dict]:
    system = load_system(system)
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


def narayanan_table1(system="dgx-a100-80g") -> list[dict]:
    system = load_system(system)
    rows = []
    for r in read_table("narayanan2021_table1_weak_scaling.csv"):
        model = _megatron_gpt(int(r["hidden_size"]), int(r["num_layers"]), int(r["attention_heads"]),
                              f"gpt-{r['params_billion']}b")
        tp, pp, gpus, batch = (int(r[k]) for k in ("TP", "PP", "num_GPUs", "global_batch_seqs"))
        dp = gpus // (tp * pp)
        sizes = [b for b in (1, 2, 4, 8) if batch % (dp * b) == 0 and batch // (dp * b) >= pp]
        problem = Problem(model, system, gpus, int(r["seq_len"]), batch, runtime="megatron")
        g = Grid.from_layout(ParallelLayout(dp=dp, tp=tp, pp=pp, recompute="full", precision="fp16"))
        g.micro_batch = np.array(sizes)
        results = evaluate(problem, g)
        speed = np.where(results["memory"]["fits"], results["tokens_per_s"], 0.0)
        est = Estimate.from_results(problem, g, results, (int(np.argmax(speed)),))
        ref = float(r["achieved_TFLOPs_per_GPU"])
        rows.append(dict(table="narayanan2021-t1", row=f"{r['params_billion']}B tp{tp} pp{pp} dp{dp} mb{est.layout.micro_batch}",
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


def summary(rows: list[dict]) -> dict:
    errors = np.abs([r["error"] for r in rows])
    return {"rows": len(rows), "mean_abs_error": float(errors.mean()), "max_abs_error": float(errors.max())}


def validate_all(system="dgx-a100-80g") -> dict:
    tables = {"korthikanti2022-t5": korthikanti_table5(system), "narayanan2021-t1": narayanan_table1(system),
              "zero2019-t1": zero_table1()}
    return {name: {"summary": summary(rows), "rows": rows} for name, rows in tables.items()}
