"""``System``: the hardware profile the planner estimates on.

A profile is a flat TOML or JSON file (built-in ones live in ``luban/plan/systems/``; each cites
its datasheet sources). Bandwidths are bytes/s, latencies seconds, capacities bytes.
``[peak_flops]`` gives dense FLOP/s per GPU for each precision; ``[efficiency]`` holds the
calibration: matmul efficiency vs GEMM FLOPs and collective efficiency vs message bytes
(piece-wise linear in log10 of the size), the HBM traffic factor of memory-bound kernels and
the overlap shares. ``luban plan probe`` writes a profile of the machine it runs on, with a
``[cpu]`` table (cores, torch threads per process, seconds per ATen op plain and under tensor
parallelism, per parameter tensor (plain and DTensor) and per FSDP2 group, a reference micro-batch on all threads and
on one)
that turns on the CPU terms of the time model (``luban.plan.time.cpu_terms``).
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from luban.errors import LubanError, bad_value

SYSTEMS_DIR = Path(__file__).with_name("systems")
EFFICIENCY_KEYS = {"matmul_size": None, "matmul": None, "collective_size": None, "collective": None,
                   "elementwise_traffic": 2.0, "hbm_efficiency": 0.8, "dp_overlap": 0.0, "zero3_overlap": 0.8,
                   "pp_overlap": 0.0}
CPU_KEYS = ("cores", "threads", "oversubscription_exponent", "oversubscribed_stall_s", "op_overhead_s", "tensor_overhead_s", "reference_s",
            "reference_one_thread_s", "tp_op_overhead_s", "fsdp_group_overhead_s",
            "dtensor_tensor_overhead_s")


@dataclass(frozen=True)
class System:
    name: str
    description: str
    gpus_per_node: int
    hbm_bytes: float
    hbm_bandwidth: float
    nvlink_domain: int
    nvlink_bandwidth: float
    nvlink_latency: float
    internode_bandwidth: float
    internode_latency: float
    host_bytes: float
    host_bandwidth: float
    host_link_bandwidth: float
    framework_overhead_bytes: float
    peak_flops: dict
    efficiency: dict
    cpu: dict = field(default_factory=dict)  # CPU terms of a probed profile (docs/planner.md); empty on GPUs

    @classmethod
    def from_dict(cls, raw: dict, source: str = "system") -> "System":
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(names))
        if unknown:
            raise LubanError(f"{source}: unknown key {unknown[0]!r}; allowed: {', '.join(names)}")
        missing = [n for n in names if n not in raw and n not in ("description", "efficiency", "cpu")]
        if missing:
            raise LubanError(f"{source}: missing key {missing[0]!r} (a profile needs {', '.join(names)})")
        values = dict(raw)
        values.setdefault("description", "")
        eff = {**EFFICIENCY_KEYS, **values.get("efficiency", {})}
        for key, value in eff.items():
            if value is None:
                raise LubanError(f"{source}: efficiency.{key} is required")
        for a, b in (("matmul_size", "matmul"), ("collective_size", "collective")):
            if len(eff[a]) != len(eff[b]) or len(eff[a]) < 2 or list(eff[a]) != sorted(eff[a]):
                raise bad_value(f"{source}.efficiency.{a}", eff[a], f"ascending sizes, as many as efficiency.{b}")
        values["efficiency"] = eff
        cpu = values.get("cpu", {})
        if cpu and (sorted(cpu) != sorted(CPU_KEYS) or any(v <= 0 for v in cpu.values())):
            raise bad_value(f"{source}.cpu", cpu, f"positive {', '.join(CPU_KEYS)}")
        for key in names[2:-3]:
            if not isinstance(values[key], (int, float)) or values[key] <= 0:
                raise bad_value(f"{source}.{key}", values[key], "must be a positive number")
        if not values["peak_flops"] or any(v <= 0 for v in values["peak_flops"].values()):
            raise bad_value(f"{source}.peak_flops", values["peak_flops"], "positive FLOP/s per precision")
        return cls(**values)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def peak(self, precision: str) -> float:
        """Dense FLOP/s per GPU for ``precision`` (fp16 falls back to bf16 and vice versa)."""
        for key in (precision, {"fp16": "bf16", "bf16": "fp16"}.get(precision, "")):
            if key in self.peak_flops:
                return float(self.peak_flops[key])
        raise bad_value("parallel.precision", precision, f"system {self.name} lists {', '.join(self.peak_flops)}")

    def matmul_efficiency(self, flops):
        """Share of peak a GEMM of ``flops`` FLOPs reaches (array in, array out)."""
        return _log_interp(flops, self.efficiency["matmul_size"], self.efficiency["matmul"])

    def collective_efficiency(self, nbytes):
        """Share of link bandwidth a collective of ``nbytes`` per rank reaches."""
        return _log_interp(nbytes, self.efficiency["collective_size"], self.efficiency["collective"])


def _log_interp(x, xs, ys):
    return np.interp(np.log10(np.maximum(x, 1.0)), np.log10(xs), ys)


def builtin_systems() -> list[str]:
    return sorted(p.stem for p in SYSTEMS_DIR.glob("*.toml"))


def load_system(spec: "str | Path | System") -> System:
    """A built-in profile name, or the path of a TOML/JSON profile file."""
    if isinstance(spec, System):
        return spec
    path = Path(spec)
    if not path.suffix and (SYSTEMS_DIR / f"{spec}.toml").exists():
        path = SYSTEMS_DIR / f"{spec}.toml"
    if not path.is_file():
        raise bad_value("--system", str(spec), f"a profile file or one of {', '.join(builtin_systems())}")
    try:
        raw = json.loads(path.read_text()) if path.suffix == ".json" else tomllib.loads(path.read_text())
    except (ValueError, tomllib.TOMLDecodeError) as err:
        raise LubanError(f"--system = {str(spec)!r}: cannot parse {path.name}: {err}") from None
    return System.from_dict(raw, source=path.name)
