"""Single-GPU MFU of GPT-2 124M and Llama 1B: bf16 autocast, ``torch.compile``, fused AdamW.

    python bench/gpu_mfu.py [--models gpt2-124m llama-1b] [--batch 16] [--seq 1024] [--steps 20]
                            [--peak-tflops 989] [--out bench/results/gpu_mfu.md]

Uses luban's own ``Engine`` (layout ``precision = bf16``; the optimizer is AdamW with the
fused CUDA kernel) with every model part compiled (``nn.Module.compile``). MFU = model FLOPs
per token (``luban.model.flops.flops_per_token``, no recompute) x tokens/s / peak FLOP/s;
``--peak-tflops`` is the device's dense bf16 peak (H100 SXM: 989, H200: 989, A100: 312).
Timing: median over ``--steps`` steps after 5 warm-up steps (compilation), with
``torch.cuda.synchronize``. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path


def measure(preset: str, batch: int, seq: int, steps: int, peak_tflops: float) -> dict:
    import torch

    from luban.model import flops
    from luban.model.presets import get_preset
    from luban.parallel.engine import OptimizerConfig, build_engine
    from luban.parallel.layout import ParallelLayout

    device = torch.device("cuda")
    cfg = get_preset(preset).replace(seq_len=seq)
    layout = ParallelLayout(micro_batch=batch, precision="bf16")
    engine = build_engine(cfg, layout, OptimizerConfig(name="adamw"), batch, seed=0, device=device)
    for part in engine.model_parts:
        part.compile()
    x = torch.randint(0, cfg.vocab, (batch, seq), device=device)
    y = torch.randint(0, cfg.vocab, (batch, seq), device=device)
    times = []
    for i in range(5 + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.forward_backward(x, y)
        engine.step(3e-4, 1.0)
        torch.cuda.synchronize()
        if i >= 5:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens_s = batch * seq / step_s
    mfu = flops.flops_per_token(cfg, seq) * tokens_s / (peak_tflops * 1e12)
    return {"model": preset, "step_s": step_s, "tokens_s": tokens_s, "mfu": mfu,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "device": torch.cuda.get_device_name()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2-124m", "llama-1b"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--out", default="bench/results/gpu_mfu.md")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_mfu: needs a CUDA device", file=sys.stderr)
        return 2
    rows = [measure(m, args.batch, args.seq, args.steps, args.peak_tflops) for m in args.models]
    lines = [f"# GPU MFU ({datetime.date.today().isoformat()}, {rows[0]['device']})", "",
             f"Command: `python {' '.join(sys.argv)}`", "",
             "| model | step (s) | tokens/s | MFU | peak memory (GiB) |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['step_s']:.3f} | {r['tokens_s']:.0f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} |"
              for r in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
