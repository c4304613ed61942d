"""``luban plan probe``: measure this machine and describe it as a system profile.

Measures matmul FLOP/s vs size (fp32, and bf16), memory bandwidth (a large copy), and gloo
all-reduce / all-gather / reduce-scatter time vs message size between 2 local processes, and
the CPU terms (``[cpu]``: per-op and per-tensor framework overhead, a reference micro-batch alone
and in 2 processes at once, hence the oversubscription exponent; docs/planner.md). A
"GPU" of the profile is one training process; the planner's ``runtime="luban"`` estimates
then describe luban's CPU runs. ``cached_profile()`` keeps one probe per host and torch version.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from pathlib import Path

MATMUL_SIZES = (64, 128, 256, 512, 1024)
MESSAGE_SIZES = (2**10, 2**14, 2**17, 2**20, 2**22)
REFERENCE_BATCH = 4  # the "tiny" preset at 4 x 128 tokens: framework_overhead's reference_s


def _best_seconds(fn, budget: float, min_reps: int = 3, stat=min) -> float:
    """Best time (or ``stat`` of the times) of ``fn`` over at least ``min_reps`` runs and
    ``budget`` seconds (``budget`` 0: exactly ``min_reps`` runs, as collectives need the same
    count on every rank)."""
    fn()  # warm-up
    times, start = [], time.perf_counter()
    while len(times) < min_reps or (budget and time.perf_counter() - start < budget):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return stat(times)


def matmul_flops(n: int, dtype=None, budget: float = 0.2) -> float:
    """FLOP/s of an n×n×n matmul (2n³ FLOPs), best of repeated runs."""
    import torch

    dtype = dtype or torch.float32
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b), budget)


def measure_matmul_peak(seconds: float = 1.0, dtype=None) -> float:
    """Peak matmul FLOP/s of this process's CPU threads (fp32 by default), in about ``seconds``.

    The trainer uses it as the denominator of MFU on CPU."""
    sizes = (256, 512)
    return max(matmul_flops(n, dtype, seconds / len(sizes)) for n in sizes)


def memory_bandwidth(nbytes: int = 2**27, budget: float = 0.3) -> float:
    """Bytes/s of a large tensor copy (each byte read once and written once)."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), budget)


def framework_overhead(budget: float = 1.5) -> dict:
    """Seconds per ATen operation of luban's forward + backward and per parameter tensor of its
    optimizer step (gradient norm, AdamW, zero_grad as ``Engine.step`` does them), on a 4-layer
    GPT at tiny widths where fixed costs are all there is (``luban.plan.overhead``); and
    ``reference_s``, one forward + backward of the "tiny" preset at micro-batch
    ``REFERENCE_BATCH``, wide enough for the kernels to use every thread. Best of repeated runs,
    like the matmul and bandwidth figures: what the machine does when other processes leave it
    alone (on a shared host a median moves tenfold with their load), with this process's thread
    count, which the trainer's ranks inherit (``luban.parallel.launch`` passes the environment on)."""
    import torch

    from luban.model.presets import get_preset
    from luban.model.transformer import build_model, lm_loss
    from luban.plan.overhead import count_ops, shrink

    def best(fn):
        return _best_seconds(fn, budget / 3, min_reps=5)

    tiny = get_preset("tiny")
    reference, ref_x = build_model(tiny), torch.randint(0, tiny.vocab, (REFERENCE_BATCH, tiny.seq_len))
    cfg = shrink(tiny, 4)
    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab, (1, cfg.seq_len))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)

    def step():
        lm_loss(model(x), x).backward()
        float(sum(p.grad.double().pow(2).sum() for p in params))
        opt.step()
        opt.zero_grad(set_to_none=False)

    op = best(lambda: lm_loss(model(x), x).backward()) / count_ops(cfg)
    tensor = max(1e-9, best(step) - op * count_ops(cfg)) / len(params)
    return {"op_overhead_s": op, "tensor_overhead_s": tensor,
            "reference_s": best(lambda: lm_loss(reference(ref_x), ref_x).backward())}


def _collective_worker(rank: int, world: int, port: int, out: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for size in MESSAGE_SIZES:
        n = size // 4
        x = torch.ones(n)
        gathered = torch.empty(n * world)
        ops = {"all-reduce": lambda: dist.all_reduce(x),
               "all-gather": lambda: dist.all_gather_into_tensor(gathered, x),
               "reduce-scatter": lambda: dist.reduce_scatter_tensor(x, gathered)}
        for name, op in ops.items():
            try:
                dist.barrier()
                results.setdefault(name, {})[size] = _best_seconds(op, 0, min_reps=5)
            except (RuntimeError, NotImplementedError):  # gloo lacks some collectives in some builds
                results.setdefault(name, {})[size] = None
    dist.barrier()  # every rank measures the framework overhead at once, as luban's ranks run
    results["overhead"] = framework_overhead()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def collective_times(world: int = 2) -> dict:
    """Seconds per collective and message size between ``world`` local gloo processes, and
    (``"overhead"``) ``framework_overhead()`` of one of them while all ``world`` run it."""
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "collectives.json")
        mp.spawn(_collective_worker, args=(world, port, out), nprocs=world, join=True)
        raw = json.loads(Path(out).read_text())
    overhead = raw.pop("overhead")
    return {"overhead": overhead, **{name: {int(k): v for k, v in sizes.items()} for name, sizes in raw.items()}}


def fit_collectives(times: dict, world: int) -> dict:
    """Latency (smallest message), bus bandwidth (largest) and efficiency vs size of the ring
    model ``steps·latency + factor·M/bandwidth`` (all-reduce: factor 2(n−1)/n)."""
    ar = {m: t for m, t in times["all-reduce"].items() if t}
    factor = 2 * (world - 1) / world
    sizes = sorted(ar)
    bus = {m: factor * m / ar[m] for m in sizes}
    bandwidth = max(bus.values())
    latency = ar[sizes[0]] / (2 * (world - 1))
    return {"bandwidth": bandwidth, "latency": latency, "sizes": [float(m) for m in sizes],
            "efficiency": [max(1e-3, bus[m] / bandwidth) for m in sizes]}


def probe_system(world: int = 2) -> dict:
    """Measure this machine; return a profile dict (see ``luban.plan.system``)."""
    import torch

    cores = os.cpu_count() or 1
    mem_total = _mem_total()
    fp32 = {n: matmul_flops(n, budget=0.1) for n in MATMUL_SIZES}
    peak32 = max(fp32.values())
    bf16 = matmul_flops(256, torch.bfloat16)  # one size: CPUs without bf16 units are very slow here
    hbm = memory_bandwidth()
    times = collective_times(world)
    coll = fit_collectives(times, world)
    cpu = cpu_profile(framework_overhead(), times["overhead"], world)
    sizes = [2.0 * n**3 for n in MATMUL_SIZES]
    profile = {
        "name": f"probe-{socket.gethostname()}",
        "description": f"measured by luban plan probe: {platform.processor() or platform.machine()}, {cores} cores, "
                       f"torch {torch.__version__}, {torch.get_num_threads()} threads; one process = one 'GPU'",
        "gpus_per_node": world, "hbm_bytes": mem_total / world, "hbm_bandwidth": hbm,
        "nvlink_domain": world, "nvlink_bandwidth": coll["bandwidth"], "nvlink_latency": coll["latency"],
        "internode_bandwidth": coll["bandwidth"], "internode_latency": coll["latency"],
        "host_bytes": mem_total, "host_bandwidth": hbm, "host_link_bandwidth": hbm,
        "framework_overhead_bytes": 512 * 2**20,
        "cpu": cpu,
        "peak_flops": {"fp32": peak32, "bf16": bf16, "fp16": bf16},
        "efficiency": {"matmul_size": sizes, "matmul": [fp32[n] / peak32 for n in MATMUL_SIZES],
                       "collective_size": coll["sizes"], "collective": coll["efficiency"],
                       "elementwise_traffic": 2.0, "hbm_efficiency": 1.0, "dp_overlap": 0.0,
                       "zero3_overlap": 0.0, "pp_overlap": 0.0},
    }
    profile["efficiency"]["elementwise_traffic"] = fit_elementwise_traffic(profile)
    return profile



def fit_elementwise_traffic(profile: dict) -> float:
    """``elementwise_traffic`` that makes the planner's one-micro-batch forward + backward of the
    "tiny" preset (one process, ``micro_batch`` 4) equal its measured time (``[cpu]
    reference_s``): the memory-bound
    term absorbs what the matmul and overhead terms miss at real widths (CPU attention, norms,
    GELU and their backward). The time model is linear in it: two estimates fix the line."""
    from luban.model.presets import get_preset
    from luban.parallel.layout import ParallelLayout
    from luban.plan.estimate import estimate
    from luban.plan.system import System

    cfg = get_preset("tiny")
    measured = profile["cpu"]["reference_s"]

    def predicted(traffic: float) -> float:
        raw = json.loads(json.dumps(profile))
        raw["efficiency"]["elementwise_traffic"] = traffic
        est = estimate(cfg, System.from_dict(raw), ParallelLayout(micro_batch=REFERENCE_BATCH),
                       global_batch=REFERENCE_BATCH, runtime="luban")
        return est.time_breakdown_s["forward"] + est.time_breakdown_s["backward"]

    base = predicted(0.0)
    return max(0.0, (measured - base) / (predicted(1.0) - base))


def cpu_profile(alone: dict, together: dict, world: int) -> dict:
    """The profile's ``[cpu]`` table from ``framework_overhead()`` of one process (``alone``) and of
    one of ``world`` processes running it at once (``together``).

    A rank of N, each with ``threads`` torch threads on ``cores`` cores, runs
    max(1, N·threads/cores)^γ times slower than one process alone; γ is fitted to the two
    ``reference_s`` measurements (the tiny-width ops do not use the threads) (γ = 1: a fair share of the cores; more when OpenMP threads stall each other),
    and is 1 when ``world`` processes do not oversubscribe the cores."""
    import math

    import torch

    cores, threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
    over = world * threads / cores
    gamma = 1.0
    if over > 1:
        ratio = together["reference_s"] / alone["reference_s"]
        gamma = max(1.0, math.log(ratio) / math.log(over))
    return {"cores": cores, "threads": threads, "oversubscription_exponent": gamma, **alone}


def _mem_total() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def write_profile(profile: dict, path: "str | Path") -> Path:
    """Write a profile as JSON (``.json``) or TOML (anything else)."""
    path = Path(path)
    if path.suffix == ".json":
        path.write_text(json.dumps(profile, indent=2) + "\n")
        return path
    flat = [f"{k} = {_toml_value(v)}" for k, v in profile.items() if not isinstance(v, dict)]
    tables = [f"\n[{k}]\n" + "\n".join(f"{kk} = {_toml_value(vv)}" for kk, vv in v.items())
              for k, v in profile.items() if isinstance(v, dict)]
    path.write_text("\n".join(flat) + "\n" + "\n".join(tables) + "\n")
    return path


def _toml_value(v) -> str:
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(float(v)) if isinstance(v, float) else str(v)


def cache_path() -> Path:
    import torch

    root = Path(os.environ.get("LUBAN_CACHE_DIR", Path.home() / ".cache" / "luban"))
    return root / f"probe-{socket.gethostname()}-torch{torch.__version__}.json"


def cached_profile() -> dict:
    """This machine's probe, measured once and kept in ``cache_path()`` (measured again when the
    cached one predates the ``cpu`` terms)."""
    path = cache_path()
    if path.is_file():
        cached = json.loads(path.read_text())
        if "cpu" in cached:
            return cached
    profile = probe_system()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_profile(profile, path)
    return profile

