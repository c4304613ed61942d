"""Issue 12 bench (item 8, MoE part): MoE step time per layout on 4 CPU ranks, and the measured
all-to-all time of expert parallel.

Every layout trains the same MoE (``tiny-moe`` shape, default 8 experts top-2, seq 128) on the
same batches with SGD, all in one spawn of 4 gloo ranks, one after another: ``--warmup`` steps,
then ``--steps`` timed steps (median reported). Under ep > 1 the forward dispatch and combine
all-to-alls are timed around the collective (``expert_parallel._all_to_all``, forward calls
only: the backward's two all-to-alls of the same sizes run inside autograd) and reported per
step, with the bytes each rank sends, next to the planner's all-to-all volume
(``luban.plan.memory.all_to_all_bytes`` per token and MoE layer, x 2 for dispatch and combine,
x this rank's tokens and MoE layers). Results are ratios within one run; the machine is
shared, so absolute times vary between runs.

    .venv/bin/python bench/moe_steptime.py [--steps 8] [--warmup 2] [--batch 16] [--experts 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

LAYOUTS = [
    ("dp4 (experts replicated)", {"dp": 4}),
    ("dp4 ep2", {"dp": 4, "ep": 2}),
    ("dp4 ep4", {"dp": 4, "ep": 4}),
    ("dp4 ep4 zero3", {"dp": 4, "ep": 4, "zero": 3}),
    ("dp2 ep2 tp2 zero1", {"dp": 2, "ep": 2, "tp": 2, "zero": 1}),
    ("dp2 ep2 pp2", {"dp": 2, "ep": 2, "pp": 2, "micro_batch": 2}),
]


def rank_main(args_file: str, out_file: str) -> int:
    import torch.distributed as dist

    from luban.model.presets import get_preset
    from luban.parallel import expert_parallel
    from luban.parallel.engine import build_engine
    from luban.parallel.layout import ParallelLayout
    from luban.parallel.optimizer import OptimizerConfig

    torch.set_num_threads(1)
    args = json.loads(Path(args_file).read_text())
    cfg = get_preset("tiny-moe").replace(seq_len=args["seq"], experts=args["experts"])
    a2a = {"seconds": 0.0, "calls": 0, "bytes": 0}
    inner = expert_parallel._all_to_all

    def timed(x, send, recv, group):
        t0 = time.perf_counter()
        out = inner(x, send, recv, group)
        a2a["seconds"] += time.perf_counter() - t0
        a2a["calls"] += 1
        a2a["bytes"] += x.numel() * x.element_size()
        return out

    expert_parallel._all_to_all = timed
    results = []
    for name, layout in LAYOUTS:
        layout = ParallelLayout.from_dict(layout)
        engine = build_engine(cfg, layout, OptimizerConfig(name="sgd", weight_decay=0.0), args["batch"], seed=0,
                              device=torch.device("cpu"))
        per_dp = args["batch"] // layout.dp
        rows = slice(engine.dp_rank * per_dp, (engine.dp_rank + 1) * per_dp)
        times, a2a_times, a2a_bytes = [], [], []
        for step in range(args["warmup"] + args["steps"]):
            data = torch.randint(0, cfg.vocab, (args["batch"], cfg.seq_len + 1),
                                 generator=torch.Generator().manual_seed(step))
            a2a.update(seconds=0.0, calls=0, bytes=0)
            dist.barrier()
            t0 = time.perf_counter()
            engine.forward_backward(data[rows, :-1], data[rows, 1:])
            engine.step(0.01, 1.0)
            times.append(time.perf_counter() - t0)
            a2a_times.append(a2a["seconds"])
            a2a_bytes.append(a2a["bytes"])
        keep = slice(args["warmup"], None)
        results.append({"layout": name, "step_s": statistics.median(times[keep]),
                        "a2a_fwd_s": statistics.median(a2a_times[keep]), "a2a_fwd_bytes": a2a_bytes[-1]})
        del engine
    if dist.get_rank() == 0:
        Path(out_file).write_text(json.dumps(results))
    return 0


def planner_bytes(layout: dict, args) -> float:
    """The planner's forward all-to-all bytes per rank and step for this layout."""
    from luban.model.presets import get_preset
    from luban.parallel.layout import ParallelLayout
    from luban.plan.grid import Grid
    from luban.plan.memory import all_to_all_bytes
    from luban.plan.problem import Problem
    from luban.plan.system import builtin_systems, load_system

    cfg = get_preset("tiny-moe").replace(seq_len=args.seq, experts=args.experts)
    problem = Problem(cfg, load_system(builtin_systems()[0]), 4, args.seq, args.batch, runtime="luban")
    grid = Grid.from_layout(ParallelLayout.from_dict(layout))
    tokens = args.batch // layout.get("dp", 1) * args.seq
    moe_layers = cfg.moe_layers // layout.get("pp", 1)  # this rank's stage
    return 2 * moe_layers * tokens * float(all_to_all_bytes(problem, grid, 4.0))  # fp32 activations


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    args = ap.parse_args()
    from luban.parallel.launch import launch

    out = Path(f"/tmp/moe_steptime-{os.getpid()}")
    out.mkdir(exist_ok=True)
    (out / "args.json").write_text(json.dumps(vars(args)))
    os.environ["OMP_NUM_THREADS"] = "1"
    code = launch([str(out / "args.json"), str(out / "results.json")], nproc=4, module="bench.moe_steptime")
    if code:
        sys.exit(code)
    results = json.loads((out / "results.json").read_text())
    base = results[0]["step_s"]
    print(f"tiny-moe shape, {args.experts} experts top-2, seq {args.seq}, global batch {args.batch}, 4 gloo ranks, "
          f"median of {args.steps} steps")
    print("| layout | step (s) | vs dp4 | forward all-to-all (s/step) | share of step | "
          "bytes sent/rank/step (fwd dispatch + combine) | planner's bytes | measured/planner |")
    print("|---|---|---|---|---|---|---|---|")
    for (_, layout), r in zip(LAYOUTS, results):
        predicted = planner_bytes(layout, args)
        ratio = f"{r['a2a_fwd_bytes'] / predicted:.3f}" if predicted else "-"
        print(f"| {r['layout']} | {r['step_s']:.3f} | {r['step_s'] / base:.2f} | {r['a2a_fwd_s']:.4f} | "
              f"{r['a2a_fwd_s'] / r['step_s']:.1%} | {r['a2a_fwd_bytes']:,} | {predicted:,.0f} | {ratio} |")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1].endswith(".json"):
        sys.exit(rank_main(*sys.argv[1:]))
    main()
