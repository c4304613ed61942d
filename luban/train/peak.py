"""Peak FLOP/s used as the MFU denominator.

On a GPU: the vendor's dense peak for the training dtype, looked up by device name (NVIDIA
A100/H100/H200 datasheets: 312/989/989 TFLOP/s bf16·fp16 dense, 19.5/67/67 fp32 non-tensor —
the planner's system profiles carry the same figures). On a CPU there is no datasheet figure,
so the peak is measured: the best of a few large fp32 matmuls (``luban.plan.probe``).
The environment variable ``LUBAN_PEAK_FLOPS`` (FLOP/s per device) overrides both, for
devices not listed here.
"""

from __future__ import annotations

import functools
import os

import torch

GPU_PEAKS = {  # name fragment -> {dtype: FLOP/s}
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
}


@functools.cache
def peak_flops(device_type: str, precision: str) -> float:
    """Peak FLOP/s of one device of this process for ``precision`` (fp32 | bf16 | fp16)."""
    if os.environ.get("LUBAN_PEAK_FLOPS"):
        return float(os.environ["LUBAN_PEAK_FLOPS"])
    if device_type == "cuda":
        name = torch.cuda.get_device_name()
        for fragment, peaks in GPU_PEAKS.items():
            if fragment in name:
                return peaks[precision]
    from luban.plan.probe import measure_matmul_peak

    return measure_matmul_peak(dtype=torch.float32)
