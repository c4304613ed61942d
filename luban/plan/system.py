"""``System``: the hardware profile the planner estimates on.

A profile is a flat TOML or JSON file (built-in ones live in ``luban/plan/systems/``; each cites
its datasheet sources). Bandwidths are bytes/s, latencies seconds, capacities bytes.
``[peak_flops]`` gives dense FLOP/s per GPU for each precision; ``[efficiency]`` holds the
calibration: matmul efficiency vs GEMM FLOPs and collective efficiency vs message bytes
(piece-wise linear in log10 of the size), the HBM traffic factor of memory-bound kernels and
the share of compute that hides prefetched transfers (``zero3_overlap``; what a runtime
overlaps is its model's, ``luban.plan.runtimes``). ``luban plan probe`` writes a profile of the machine it runs on, with a
``[cpu]`` table (cores, torch threads per process, seconds per ATen op plain and under tensor
parallelism, per parameter tensor (plain and DTensor) and per FSDP2 group, a reference micro-batch on all threads and
on one)
that turns on the CPU terms of the time model (``luban.plan.time.cpu_terms``).

Optional fields take a default from the others: ``nvlink_domain`` (GPUs sharing one NVLink
fabric) the node size, and the offload tier per GPU (host DRAM, CXL, Grace-style LPDDR) —
``offload_bytes`` its capacity, ``offload_bandwidth`` its link — the node's host memory split
over its GPUs and ``host_link_bandwidth``. ``luban plan estimate|search --system-set KEY=VALUE``
overrides any field of a profile for a what-if system (``apply_overrides``).
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from luban import schema
from luban.errors import LubanError, bad_value
from luban.parallel.layout import PRECISIONS

SYSTEMS_DIR = Path(__file__).with_name("systems")
EFFICIENCY_KEYS = {"matmul_size": None, "matmul": None, "collective_size": None, "collective": None,
                   "elementwise_traffic": 2.0, "hbm_efficiency": 0.8, "zero3_overlap": 0.8,
                   "fp8_matmul": 1.0, "attention_matmul": 1.0, "attention_fa3_speedup": 1.0, "kernel_launch_s": 0.0,
                   "unaligned_gemm": 0.0}
# kernel_launch_s: host seconds to dispatch and launch one eager kernel on this GPU's host (``luban plan
# probe --device cuda``); 0 (not probed): the host never paces an eager runtime (luban.plan.time.host_bound)
# fp8_matmul: share of the GEMM curve fp8 GEMMs reach (scaling, casts); attention_matmul: share of it an
# FA2-class fused causal attention kernel reaches on the causal FLOPs (runtimes with ``causal_skip``);
# attention_fa3_speedup: how much faster an FA3-class kernel is (Hopper only; 1 where none exists)
# unaligned_gemm: share of the peak a 16-bit GEMM with a dimension off the tensor-core alignment reaches
# (luban.plan.time.unaligned_head_seconds); 0 (not measured): no penalty
# what a profile's efficiencies may be: key -> (low, high, low included); the curves' values each.
# Shares of a peak or a link are at most 1; a probed CPU's elementwise traffic was 16 (bytes moved per
# byte of input), so 1000 bounds it loosely, and 0 is a CPU probe's fit when nothing is left for it
# (probe.fit_elementwise_traffic); a kernel launch of a second is no GPU's. The shares the time model
# divides by (a GEMM, a link, HBM, attention at that share of its peak) are at least MIN_SHARE: far below any
# fit (the built-in curves start at 0.016; probe.fit_collectives floors its curve at 1e-3; a 64-wide GEMM
# timed at a whole millisecond on an H100 is 5e-7), and a step time stays finite (the largest model on the
# smallest peaks and links: ~1e63 s, a float holds 1e308; a share of 1e-300 made it inf, then NaN).
# unaligned_gemm may also be 0: not measured.
MIN_SHARE = 1e-9
CURVES = ("matmul_size", "matmul", "collective_size", "collective")
EFFICIENCY_RANGES = {"matmul_size": (0, 1e30, False), "matmul": (MIN_SHARE, 1, True), "collective_size": (0, 1e30, False),
                     "collective": (MIN_SHARE, 1, True), "elementwise_traffic": (0, 1000, True),
                     "hbm_efficiency": (MIN_SHARE, 1, True), "zero3_overlap": (0, 1, True), "fp8_matmul": (MIN_SHARE, 1, True),
                     "attention_matmul": (MIN_SHARE, 1, True), "attention_fa3_speedup": (MIN_SHARE, 100, True),
                     "kernel_launch_s": (0, 1, True), "unaligned_gemm": (MIN_SHARE, 1, True)}
NOT_MEASURED = {"unaligned_gemm": 0.0}  # an efficiency's value for "not measured" outside its range
# [cpu] terms: key -> (low, high, low included). Cores and threads up to 2**24; contention grows as
# oversubscription ** exponent (probed ~1.3 on the 2-core VM; 16 keeps 2**24 ranks finite); every other
# term is seconds up to an hour (as latencies), the reference micro-batch's times from 1e-9 s (the probe's
# floor for a time it measures at nothing): time.thread_slowdown divides by them (1e-300 s made a step NaN)
CPU_RANGES = {"cores": (0, 1 << 24, False), "threads": (0, 1 << 24, False), "oversubscription_exponent": (0, 16.0, False),
              "reference_s": (1e-9, 3600.0, True), "reference_one_thread_s": (1e-9, 3600.0, True)}
CPU_SECONDS = (0, 3600.0, False)  # the other [cpu] terms
# a profile's numbers stay where the planner's sums are finite: bandwidths from 1 byte/s, latencies up to
# an hour, everything else up to 1e30 in its own unit (inf only where UNLIMITED says so); peaks from
# 1 FLOP/s to 1e24 (a million times a GB200's dense fp4): a what-if, never an overflow
MAX_NUMBER, MIN_PEAK, MAX_PEAK = 1e30, 1.0, 1e24
NUMBER_RANGES = {**{k: (1.0, MAX_NUMBER) for k in ("hbm_bandwidth", "nvlink_bandwidth", "internode_bandwidth",
                                                   "host_bandwidth", "host_link_bandwidth", "offload_bandwidth")},
                 "nvlink_latency": (0.0, 3600.0), "internode_latency": (0.0, 3600.0)}
MAX_GROUP = 1 << 24  # gpus_per_node, nvlink_domain: at most the planner's --gpus limit (luban.plan.cli.COUNT)
CPU_KEYS = ("cores", "threads", "oversubscription_exponent", "oversubscribed_stall_s", "op_overhead_s", "tensor_overhead_s", "reference_s",
            "reference_one_thread_s", "tp_op_overhead_s", "fsdp_group_overhead_s",
            "dtensor_tensor_overhead_s")


NUMBERS = ("gpus_per_node", "hbm_bytes", "hbm_bandwidth", "nvlink_domain", "nvlink_bandwidth", "nvlink_latency",
           "internode_bandwidth", "internode_latency", "host_bytes", "host_bandwidth", "host_link_bandwidth",
           "framework_overhead_bytes", "offload_bytes", "offload_bandwidth")
INTEGERS = ("gpus_per_node", "nvlink_domain")
UNLIMITED = ("hbm_bytes", "hbm_bandwidth", "nvlink_bandwidth", "internode_bandwidth", "host_bytes", "host_bandwidth",
             "host_link_bandwidth", "offload_bytes", "offload_bandwidth")  # may be inf (a what-if without a limit)
DEFAULTS = {"nvlink_domain": lambda v: v["gpus_per_node"],
            "offload_bytes": lambda v: v["host_bytes"] / v["gpus_per_node"],
            "offload_bandwidth": lambda v: v["host_link_bandwidth"]}
GIB = 2**30
# --system-set keys in convenient units: alias -> (profile field, factor); plus every field by its
# own name and unit, and ``peak_flops.<precision>``, ``peak_tflops.<precision>``, ``efficiency.<key>``
ALIASES = {"hbm_gib": ("hbm_bytes", GIB), "host_gib": ("host_bytes", GIB), "offload_gib": ("offload_bytes", GIB),
           "offload_gbps": ("offload_bandwidth", 1e9), "hbm_gbps": ("hbm_bandwidth", 1e9),
           "nvlink_gbps": ("nvlink_bandwidth", 1e9), "internode_gbps": ("internode_bandwidth", 1e9),
           "host_link_gbps": ("host_link_bandwidth", 1e9)}
PEAK_PREFIXES = {"peak_flops": 1.0, "peak_tflops": 1e12}


@dataclass(frozen=True)
class System:
    name: str
    description: str
    gpus_per_node: int
    hbm_bytes: float
    hbm_bandwidth: float
    nvlink_domain: int  # default: gpus_per_node
    nvlink_bandwidth: float
    nvlink_latency: float
    internode_bandwidth: float
    internode_latency: float
    host_bytes: float
    host_bandwidth: float
    host_link_bandwidth: float
    framework_overhead_bytes: float
    offload_bytes: float  # offload tier capacity per GPU; default host_bytes / gpus_per_node
    offload_bandwidth: float  # offload tier bytes/s per GPU, each way; default host_link_bandwidth
    peak_flops: dict
    efficiency: dict
    cpu: dict = field(default_factory=dict)  # CPU terms of a probed profile (docs/planner.md); empty on GPUs

    @classmethod
    def from_dict(cls, raw: dict, source: str = "system") -> "System":
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(names))
        if unknown:
            raise bad_value(f"{source}.{unknown[0]}", raw[unknown[0]], f"not a profile key; the keys are {', '.join(names)}")
        missing = [n for n in names if n not in raw and n not in ("description", "efficiency", "cpu", *DEFAULTS)]
        if missing:
            raise bad_value(f"{source}.{missing[0]}", "(missing)", f"required: a profile needs {', '.join(names)}")
        values = dict(raw)
        schema.check(f"{source}.name", values["name"], schema.text())
        schema.check(f"{source}.description", values.get("description", ""), schema.text(allowed="text", empty=True))
        for key in NUMBERS:
            if key not in values:  # DEFAULTS fills it below, from checked values
                continue
            value = values[key]
            low, high = NUMBER_RANGES.get(key, (0.0, MAX_NUMBER))
            if not _is_number(value) or not (low < value if low == 0 else low <= value) \
                    or not (value <= high or key in UNLIMITED and value == math.inf):
                raise bad_value(f"{source}.{key}", value, f"a number {'>' if low == 0 else '>='} {low:g} and <= {high:g}"
                                + (" (or inf: unlimited)" if key in UNLIMITED else ""))
        for key in INTEGERS:
            if key in values and not (float(values[key]).is_integer() and values[key] <= MAX_GROUP):
                raise bad_value(f"{source}.{key}", values[key], f"must be a positive integer up to {MAX_GROUP:,}")
        for key, default in DEFAULTS.items():
            values.setdefault(key, default(values))
        domain, node = int(values["nvlink_domain"]), int(values["gpus_per_node"])
        if domain % node and node % domain:  # (3 of 8: groups straddled domains, classed as inside or not at random)
            raise bad_value(f"{source}.nvlink_domain", values["nvlink_domain"], f"a divisor or a multiple of "
                            f"gpus_per_node = {node} (a domain is part of a node, or whole nodes: NVL72's 72 of 4)")
        values.setdefault("description", "")
        given = values.get("efficiency", {})
        if not isinstance(given, dict):
            raise bad_value(f"{source}.efficiency", given, "a table of efficiency.KEY = value")
        unknown = sorted(set(given) - set(EFFICIENCY_KEYS))
        if unknown:
            raise bad_value(f"{source}.efficiency.{unknown[0]}", given[unknown[0]], f"a key of {', '.join(EFFICIENCY_KEYS)}")
        eff = {**EFFICIENCY_KEYS, **given}
        for key, value in eff.items():
            if value is None:
                raise bad_value(f"{source}.efficiency.{key}", None, "required (no default)")
            ok = (isinstance(value, (list, tuple)) and all(_in_range(v, *EFFICIENCY_RANGES[key]) for v in value)
                  if key in CURVES else efficiency_ok(key, value))
            if not ok:
                raise bad_value(f"{source}.efficiency.{key}", value, efficiency_allowed(key))
        for a, b in (("matmul_size", "matmul"), ("collective_size", "collective")):
            if len(eff[a]) != len(eff[b]) or len(eff[a]) < 2 or list(eff[a]) != sorted(eff[a]):
                raise bad_value(f"{source}.efficiency.{a}", eff[a], f"ascending sizes, as many as efficiency.{b}")
        values["efficiency"] = eff
        cpu = values.get("cpu", {})
        if not isinstance(cpu, dict) or cpu and sorted(cpu) != sorted(CPU_KEYS):  # {}: no CPU terms; false, 0, "": a mistake
            raise bad_value(f"{source}.cpu", cpu, f"a table of {', '.join(CPU_KEYS)} (or none: a GPU profile)")
        for key in CPU_KEYS if cpu else ():
            low, high, closed = CPU_RANGES.get(key, CPU_SECONDS)
            whole = key in ("cores", "threads")
            if not _in_range(cpu[key], low, high, closed) or whole and not float(cpu[key]).is_integer():
                top = f"{high:,}" if isinstance(high, int) else f"{high:g}"
                raise bad_value(f"{source}.cpu.{key}", cpu[key], f"{'a whole number' if whole else 'a number'} "
                                f"{'>=' if closed else '>'} {low:g} and <= {top}{' (seconds)' if key.endswith('_s') else ''}")
        if not isinstance(values["peak_flops"], dict) or not values["peak_flops"] or any(
                k not in PRECISIONS or not _is_number(v) or not MIN_PEAK <= v <= MAX_PEAK for k, v in values["peak_flops"].items()):
            raise bad_value(f"{source}.peak_flops", values["peak_flops"],
                            f"FLOP/s per precision ({', '.join(PRECISIONS)}), each from {MIN_PEAK:g} to {MAX_PEAK:g}")
        return cls(**values)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def peak(self, precision: str) -> float:
        """Dense FLOP/s per GPU for ``precision`` (fp16 falls back to bf16 and vice versa)."""
        for key in (precision, {"fp16": "bf16", "bf16": "fp16"}.get(precision, "")):
            if key in self.peak_flops:
                return float(self.peak_flops[key])
        raise bad_value("parallel.precision", precision, f"system {self.name} lists {', '.join(self.peak_flops)}")

    def faster_precision(self) -> str:
        """bf16 where this system's peak is higher in it, else fp32: the precision ``luban plan estimate``,
        ``luban plan search`` and ``choose_layout`` plan when none is given (fp32 on most CPUs). A profile
        that lists only one of them gets that one (it was refused for lacking the other, which no one asked
        for); one that lists neither, fp32 (``peak`` names what it lists)."""
        def listed(precision):
            return precision in self.peak_flops or precision == "bf16" and "fp16" in self.peak_flops  # as ``peak``

        if not (listed("bf16") and listed("fp32")):
            return "bf16" if listed("bf16") else "fp32"
        return "bf16" if self.peak("bf16") > self.peak("fp32") else "fp32"

    def matmul_efficiency(self, flops):
        """Share of peak a GEMM of ``flops`` FLOPs reaches (array in, array out)."""
        return _log_interp(flops, self.efficiency["matmul_size"], self.efficiency["matmul"])

    def collective_efficiency(self, nbytes):
        """Share of link bandwidth a collective of ``nbytes`` per rank reaches."""
        return _log_interp(nbytes, self.efficiency["collective_size"], self.efficiency["collective"])


TEXT_KEYS = ("name",)  # a profile's fields that are text, not numbers


def apply_overrides(raw: dict, sets, key: str = "--system-set") -> dict:
    """``raw`` (a profile's fields) with each ``KEY=VALUE`` of ``sets`` applied (module docstring;
    ``inf`` allowed: an unlimited tier). Unknown keys and non-numbers raise one-line errors;
    the result is validated by ``System.from_dict``."""
    out = {**raw, "peak_flops": dict(raw.get("peak_flops", {})), "efficiency": dict(raw.get("efficiency", {}))}
    fields_ = list(NUMBERS)
    allowed = (f"KEY=VALUE with KEY one of {', '.join(sorted(fields_ + list(ALIASES)))}, "
               f"peak_flops.PRECISION, peak_tflops.PRECISION or efficiency.KEY")
    for item in sets:
        name, eq, text = str(item).partition("=")
        name = name.strip()
        if not eq:
            raise bad_value(key, item, allowed)
        if name in TEXT_KEYS:  # (it said "a number")
            raise bad_value(f"{key} {name}", text, f"text, which {key} does not set (it sets numbers): write it in "
                                                   "a profile file (--system FILE)")
        try:  # float() also takes "1_0" (10) and other scripts' digits ("٨٠"): as the command line's numbers
            if not schema.FLOAT.fullmatch(text.strip()):
                raise ValueError
            value = float(text)
        except ValueError:
            raise bad_value(f"{key} {name}", text, "a number (inf for unlimited)") from None
        prefix, _, sub = name.partition(".")
        if prefix == "efficiency" and sub in CURVES:  # (it said "unknown key", efficiency.KEY being advertised)
            raise bad_value(f"{key} {name}", text, f"a curve (a list of numbers by size), which {key} does not set: "
                                                   "write it in a profile file (--system FILE)")
        if prefix == "efficiency" and sub in EFFICIENCY_KEYS and sub not in CURVES:  # the profile's own range
            if not efficiency_ok(sub, value):
                raise bad_value(f"{key} {name}", text, efficiency_allowed(sub))
            out["efficiency"][sub] = value
            continue
        if prefix in PEAK_PREFIXES and sub in PRECISIONS:  # checked in the unit typed (was: the whole peak_flops table)
            factor = PEAK_PREFIXES[prefix]
            out["peak_flops"][sub] = value * factor
            if not MIN_PEAK <= out["peak_flops"][sub] <= MAX_PEAK:
                raise bad_value(f"{key} {name}", text, f"a number from {MIN_PEAK / factor:g} to {MAX_PEAK / factor:g}"
                                                       f" ({'T' if factor > 1 else ''}FLOP/s per GPU)")
            continue
        if name not in fields_ and name not in ALIASES:
            raise bad_value(key, item, f"unknown key {name!r}; {allowed}")
        target = ALIASES[name][0] if name in ALIASES else name
        if target in INTEGERS and not (value.is_integer() and 1 <= value <= MAX_GROUP):
            raise bad_value(f"{key} {name}", text, f"an integer from 1 to {MAX_GROUP}")
        if not value > 0:
            raise bad_value(f"{key} {name}", text, "a positive number" + (" (inf for unlimited)" if target in UNLIMITED
                                                                           else ""))
        if name in fields_:
            out[name] = int(value) if name in INTEGERS and value.is_integer() and value <= MAX_GROUP else value
        else:  # an alias, checked in the unit typed (hbm_gbps=1e-300 was refused as hbm_bandwidth = 1e-291)
            field_, factor = ALIASES[name]
            out[field_] = value * factor
            low, high = NUMBER_RANGES.get(field_, (0.0, MAX_NUMBER))
            if math.isfinite(value) and not low <= out[field_] <= high:  # hbm_gib=1e300 overflowed to inf
                raise bad_value(f"{key} {name}", text, f"a number {'>' if low == 0 else '>='} {low / factor:g} and "
                                                       f"<= {high / factor:g} (inf for unlimited)")
    return out


def efficiency_ok(key: str, value) -> bool:
    """Whether ``value`` may be the profile's scalar ``efficiency.<key>`` (``EFFICIENCY_RANGES``, ``NOT_MEASURED``)."""
    return (_in_range(value, *EFFICIENCY_RANGES[key])
            or key in NOT_MEASURED and _is_number(value) and value == NOT_MEASURED[key])


def efficiency_allowed(key: str) -> str:
    """What ``efficiency.<key>`` may be, in words (the error line's last part)."""
    low, high, closed = EFFICIENCY_RANGES[key]
    what = f"{'a list of numbers, each' if key in CURVES else 'a number'} {'>=' if closed else '>'} {low:g} and <= {high:g}"
    return f"{NOT_MEASURED[key]:g} (not measured) or {what}" if key in NOT_MEASURED else what


def is_json(path: Path) -> bool:
    """A model or profile file is JSON by its suffix, in any case (``.json``, ``.JSON``); else TOML."""
    return path.suffix.lower() == ".json"


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _in_range(x, low: float, high: float, closed: bool) -> bool:
    """A finite number in [low, high] (``closed``) or (low, high]. An int is compared as it is: one beyond a
    float (a JSON profile's 10**400) is out of range, not an OverflowError."""
    return _is_number(x) and (isinstance(x, int) or math.isfinite(x)) and (low <= x if closed else low < x) and x <= high


def _log_interp(x, xs, ys):
    return np.interp(np.log10(np.maximum(x, 1.0)), np.log10(xs), ys)


# a profile or a model file (``--system``, ``--model``): the built-in profiles are ~4 KB; a file beyond 16 MiB
# (a checkpoint named by mistake) is refused after reading that much, not read whole into memory
MAX_FILE_BYTES = 1 << 24


def read_small_text(path: Path, key: str, spec) -> str:
    """The UTF-8 text of ``path`` (``UnicodeDecodeError``, a ``ValueError``, if it is not), or the one-line
    error for ``key`` beyond ``MAX_FILE_BYTES``; ``OSError`` as ``open`` raises it."""
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise bad_value(key, str(spec), f"a file of at most {MAX_FILE_BYTES:,} bytes (a profile or a model "
                                        f"config, not a checkpoint)")
    return data.decode("utf-8")


def builtin_systems() -> list[str]:
    return sorted(p.stem for p in SYSTEMS_DIR.glob("*.toml"))


def load_system(spec: "str | Path | System", overrides=(), key: str = "--system") -> System:
    """A built-in profile name, or the path of a TOML/JSON profile file; ``overrides``: the
    ``KEY=VALUE`` strings of ``--system-set`` (``apply_overrides``); ``key``: what named it, for
    the error line (``run.system`` in a training config)."""
    if isinstance(spec, System):
        return System.from_dict(apply_overrides(spec.to_dict(), overrides), source=spec.name) if overrides else spec
    path = Path(spec)
    if not path.suffix and (SYSTEMS_DIR / f"{spec}.toml").exists():
        path = SYSTEMS_DIR / f"{spec}.toml"
    if not path.is_file():
        raise bad_value(key, str(spec), f"a profile file or one of {', '.join(builtin_systems())}")
    try:
        text = read_small_text(path, key, spec)
        raw = json.loads(text) if is_json(path) else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError, RecursionError) as err:
        raise LubanError(f"{key} = {str(spec)!r}: cannot parse {path.name}: {err}".replace("\n", " ")) from None
    except OSError as err:
        raise bad_value(key, str(spec), f"a readable profile file ({err.strerror})") from None
    if not isinstance(raw, dict):
        raise bad_value(key, str(spec), f"a profile table (name, gpus_per_node, ...), not {type(raw).__name__}")
    system = System.from_dict(raw, source=path.name)  # the file's own faults named by the file, not by --system-set
    return System.from_dict(apply_overrides(raw, overrides), source="--system-set") if overrides else system
