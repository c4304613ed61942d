"""Peak FLOP/s used as the MFU denominator.

On a GPU: the vendor's dense peak for the training dtype, looked up by device name (NVIDIA
A100/H100/H200 datasheets: 312/989/989 TFLOP/s bf16·fp16 dense, 19.5/67/67 fp32 non-tensor —
the planner's system profiles carry the same figures). On a CPU there is no datasheet figure,
so the peak is measured: the best of a few large fp32 matmuls (``luban.plan.probe``).
The environment variable ``LUBAN_PEAK_FLOPS`` (FLOP/s per device) overrides both, for
devices not listed here.

A run uses one peak (``run_peak``): measured or looked up at its first start, recorded in
``<run>/peak.json`` and its checkpoints, reused on every resume. The trainer reports MFU/HFU
above 100% as not measured (null) with one warning: the recorded peak is then too low.
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


PEAK_FILE = "peak.json"


def env_peak() -> float:
    """``LUBAN_PEAK_FLOPS`` as a finite FLOP/s figure > 0 (a typo or NaN would make every MFU nonsense)."""
    from luban.errors import bad_value
    from luban.plan.system import MAX_PEAK  # the bound the planner's profiles have

    raw = os.environ["LUBAN_PEAK_FLOPS"]
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_PEAK:
        raise bad_value("LUBAN_PEAK_FLOPS", raw, f"the device's peak FLOP/s, a number > 0 and <= {MAX_PEAK:g}")
    return value


def run_peak(run_dir, device_type: str, precision: str, recorded: dict | None = None,
             write: bool = True) -> dict:
    """The peak of this run: ``{"flops" (per device), "device", "precision", "source"}``.

    One per run: the first start measures it (a CPU) or looks it up (a GPU) and records it in
    ``<run>/peak.json`` (and every checkpoint's meta.json); later starts and resumes reuse it, so
    a resume on a busier machine does not divide by a lower re-measured peak. ``recorded``: the
    resumed checkpoint's entry, used where the run folder has none. A recorded peak is reused
    while the device type is the same (a GPU's also needs the same precision). ``LUBAN_PEAK_FLOPS``
    wins over all of it and is not recorded."""
    import json
    from pathlib import Path

    if os.environ.get("LUBAN_PEAK_FLOPS"):
        return {"flops": env_peak(), "device": device_type, "precision": precision, "source": "LUBAN_PEAK_FLOPS"}
    path = Path(run_dir) / PEAK_FILE

    def usable(entry) -> bool:
        return (isinstance(entry, dict) and entry.get("device") == device_type
                and (device_type != "cuda" or entry.get("precision") == precision)
                and isinstance(entry.get("flops"), (int, float)) and 0 < entry["flops"] < float("inf"))

    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        found = None
    if usable(found):
        return found
    entry = recorded if usable(recorded) else {
        "flops": peak_flops(device_type, precision), "device": device_type, "precision": precision,
        "source": "datasheet" if device_type == "cuda" and any(f in torch.cuda.get_device_name() for f in GPU_PEAKS)
        else "measured (fp32 matmul)"}
    if write:
        from luban.data.atomic import write_bytes

        try:
            write_bytes(path, (json.dumps(entry, indent=1) + "\n").encode())
        except OSError:
            pass  # the checkpoints record it too
    return entry
