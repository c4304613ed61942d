"""Hugging Face nanotron's H100 scaling table against the planner's existing runtime models
(a candidate source for issue #25's leave-one-source-out, not in the headline: no runtime model
describes nanotron yet; docs/planner.md "Validation by source").

    .venv/bin/python bench/plan_nanotron_check.py

``luban/plan/reference/nanotron_scaling_h100.csv`` holds the 26 cells of nanotron v0.5's
benchmark summary (best configuration per model size and node count: MFU, layout, micro-batch,
ZeRO stage), with its citations. Each row's MFU is converted to tokens/s per GPU with nanotron's
own model-FLOPs count (``nanotron_flops_per_token``: src/nanotron/models/llama.py ``get_flops``,
which counts the full s x s attention and differs from ``luban.model.flops``) and the H100 SXM
dense bf16 peak, then planned at its layout (dgx-h100, bf16, sequence parallel where tp > 1, no
recompute) under each runtime model named below; the report is every row's error and each
runtime's mean |error|.
"""

from __future__ import annotations

import argparse

from luban.parallel.layout import ParallelLayout
from luban.plan.estimate import Estimate, evaluate
from luban.plan.grid import Grid
from luban.plan.problem import Problem
from luban.plan.system import load_system
from luban.plan.validate import _source_model, read_source_table

TABLE = "nanotron_scaling_h100.csv"
H100_BF16_PEAK = 989e12  # FLOP/s, H100 SXM dense bf16 (NVIDIA H100 datasheet: 1,979 with sparsity); the table does not print its peak


def nanotron_flops_per_token(r: dict) -> float:
    """nanotron ``get_flops`` per token: 3 x (QKV + attention out + SwiGLU MLP GEMMs, QK^T and AV
    over the full sequence, LM head), forward 1x + backward 2x."""
    h, layers, heads, kv = (int(r[k]) for k in ("hidden", "layers", "heads", "kv_heads"))
    f, vocab, seq = int(r["ffn_hidden"]), int(r["vocab"]), int(r["seq"])
    d = h // heads
    linear = 2 * layers * (h * heads * d + h * 2 * kv * d + heads * d * h + 3 * h * f)
    attention = 2 * layers * 2 * heads * d * seq
    return 3 * (linear + attention + 2 * h * vocab)


def plan(r: dict, runtime: str) -> float:
    """Planned tokens/s per GPU of one row under ``runtime``."""
    gpus, tp, pp = int(r["gpus"]), int(r["tp"]), int(r["pp"])
    layout = ParallelLayout(dp=gpus // (tp * pp), tp=tp, sp=tp > 1, pp=pp, zero=int(r["zero"]), precision=r["precision"],
                            recompute=r["recompute"], micro_batch=int(r["micro_batch"]))
    problem = Problem(_source_model(r), load_system(r["system"]), gpus, int(r["seq"]), int(r["global_batch"]),
                      runtime=runtime, attention_kernel="fa2")
    g = Grid.from_layout(layout)
    return Estimate.from_results(problem, g, evaluate(problem, g)).tokens_per_s / gpus


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtimes", nargs="+", default=["megatron-core", "megatron", "fsdp2"])
    args = parser.parse_args(argv)
    rows = read_source_table(TABLE)
    print("| cell | layout | MFU | tokens/s/GPU | " + " | ".join(args.runtimes) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(args.runtimes))
    errors = {rt: [] for rt in args.runtimes}
    for r in rows:
        measured = float(r["value"]) / 100 * H100_BF16_PEAK / nanotron_flops_per_token(r)
        cells = []
        for rt in args.runtimes:
            try:
                e = plan(r, rt) / measured - 1
            except Exception as err:  # noqa: BLE001 - a layout a runtime model refuses is reported, not fatal
                cells.append(f"refused ({str(err).splitlines()[0][:60]})")
                continue
            errors[rt].append(abs(e))
            cells.append(f"{e:+.1%}")
        gpus, tp, pp = int(r["gpus"]), int(r["tp"]), int(r["pp"])
        layout = f"dp{gpus // (tp * pp)} tp{tp} pp{pp} mb{r['micro_batch']} zero{r['zero']}"
        print(f"| {gpus // 8} nodes {r['model']} | {layout} | {r['value']}% | {measured:,.0f} | " + " | ".join(cells) + " |")
    print("| **mean \\|error\\|** | | | | " + " | ".join(
        f"**{sum(v) / len(v):.1%}** ({len(v)} rows)" if v else "n/a" for v in errors.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
