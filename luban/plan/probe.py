"""``luban plan probe``: measure this machine and describe it as a system profile.

Measures matmul FLOP/s vs size (fp32, and bf16), memory bandwidth (a large copy), and gloo
all-reduce / all-gather / reduce-scatter time vs message size between 2 local processes, and
the CPU terms (``[cpu]``: per-op and per-tensor framework overhead, plain and under tensor
parallelism / FSDP2, a reference micro-batch on all threads and on one, and what ranks that
outnumber the cores cost: 2·cores processes at once; docs/planner.md). A
"GPU" of the profile is one training process; the planner's ``runtime="luban"`` estimates
then describe luban's CPU runs. ``cached_profile()`` keeps one probe per host and torch version.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import time
from pathlib import Path

from luban import interrupt
from luban.config import toml_value

MATMUL_SIZES = (64, 128, 256, 512, 1024)
MESSAGE_SIZES = (2**10, 2**14, 2**17, 2**20, 2**22)
REFERENCE_BATCH = 4  # the "tiny" preset at 4 x 128 tokens: framework_overhead's reference_s
OVERSUBSCRIBED_MAX = 8  # processes the oversubscription probe may start


def _best_seconds(fn, budget: float, min_reps: int = 3, stat=min, warmup: int = 1) -> float:
    """Best time (or ``stat`` of the times) of ``fn`` over at least ``min_reps`` runs and
    ``budget`` seconds (``budget`` 0: exactly ``min_reps`` runs, as collectives need the same
    count on every rank), after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times, start = [], time.perf_counter()
    while len(times) < min_reps or (budget and time.perf_counter() - start < budget):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return stat(times)


def matmul_flops(n: int, dtype=None, budget: float = 0.2) -> float:
    """FLOP/s of an n×n×n matmul (2n³ FLOPs), best of repeated runs. Its operands come from a
    generator of its own: the trainer measures this (the MFU peak on a CPU) once per process,
    after a resume has restored the global RNG, which must then advance as in the
    uninterrupted run."""
    import torch

    dtype = dtype or torch.float32
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
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


def _training_step(model, x, opt):
    """One step as ``Engine.step`` does it on a CPU: forward + backward, the gradient norm (one
    fused kernel over the local shards), the optimizer step, zero_grad."""
    import torch

    from luban.model.transformer import lm_loss
    from luban.parallel.memory import local

    params = [p for group in opt.param_groups for p in group["params"]]

    def step():
        lm_loss(model(x), x).backward()
        torch._foreach_norm([local(p.grad) for p in params])
        opt.step()
        opt.zero_grad(set_to_none=False)
    return step


def reference_seconds(budget: float) -> float:
    """Median seconds of one forward + backward of the "tiny" preset at micro-batch
    ``REFERENCE_BATCH`` on this process's threads, after 3 warm-up passes (the first passes of a
    fresh model run 2-5x slower while the allocator grows its pools)."""
    import torch

    from luban.model.presets import get_preset
    from luban.model.transformer import build_model, lm_loss

    tiny = get_preset("tiny")
    model, x = build_model(tiny), torch.randint(0, tiny.vocab, (REFERENCE_BATCH, tiny.seq_len))
    return _best_seconds(lambda: lm_loss(model(x), x).backward(), budget, min_reps=5, warmup=3, stat=sorted_median)


def framework_overhead(budget: float = 1.5) -> dict:
    """Seconds per ATen operation of luban's forward + backward and per parameter tensor of its
    optimizer step (gradient norm, AdamW, zero_grad as ``Engine.step`` does them), on a 4-layer
    GPT at tiny widths where fixed costs are all there is (``luban.plan.overhead``); and
    ``reference_s``, one forward + backward of the "tiny" preset at micro-batch
    ``REFERENCE_BATCH``, wide enough for the kernels to use every thread, and
    ``reference_one_thread_s``, the same on one thread (how kernels scale with threads;
    ``reference_seconds``). Each is the median of repeated runs, as the trainer reports
    the median step (with this process's thread count; ``cpu_profile`` relates it to a launched
    rank's)."""
    import torch

    from luban.model.presets import get_preset
    from luban.model.transformer import build_model, lm_loss
    from luban.plan.overhead import count_ops, shrink

    def best(fn):
        return _best_seconds(fn, budget / 4, min_reps=5, stat=sorted_median)

    cfg = shrink(get_preset("tiny"), 4)
    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab, (1, cfg.seq_len))
    params = list(model.parameters())
    step = _training_step(model, x, torch.optim.AdamW(params, lr=1e-3, fused=True))
    op = best(lambda: lm_loss(model(x), x).backward()) / count_ops(cfg)
    tensor = max(1e-9, best(step) - op * count_ops(cfg)) / len(params)
    threads = torch.get_num_threads()
    reference_s = reference_seconds(budget / 4)
    torch.set_num_threads(1)
    try:
        one_thread_s = reference_seconds(budget / 4)
    finally:
        torch.set_num_threads(threads)
    return {"op_overhead_s": op, "tensor_overhead_s": tensor, "reference_s": reference_s,
            "reference_one_thread_s": max(one_thread_s, reference_s)}


def parallel_overhead(world: int, latency: dict, budget: float = 1.0) -> dict:
    """Seconds per ATen operation of luban's forward + backward under tensor parallelism over
    ``world`` ranks (``tp_op_overhead_s``: DTensor dispatch and sharding propagation instead of
    the plain op's cost), and per FSDP2 group per micro-batch (``fsdp_group_overhead_s``: its
    pre-/post-forward and backward hooks, ZeRO-2 wrapping as ``luban.parallel.data_parallel``
    does), on the 4-layer tiny-width GPT of ``framework_overhead``, where fixed costs are all
    there is. The collectives the time model counts separately are taken out at the
    smallest-message times in ``latency`` (per kind): 4 all-reduces per layer under tp (2 forward,
    2 backward), one all-gather and one reduce-scatter per FSDP group. And
    ``dtensor_tensor_overhead_s``: seconds per parameter tensor of the optimizer step (norm,
    foreach AdamW, zero_grad) when the parameters are DTensors, as under FSDP2 or tp. Called by
    every rank of a gloo group at once."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from luban.model.presets import get_preset
    from luban.model.transformer import build_model, lm_loss
    from luban.parallel.tensor_parallel import apply_tensor_parallel, loss_parallel, vocab_parallel_loss
    from luban.plan.overhead import count_ops, shrink

    cfg = shrink(get_preset("tiny"), 4)
    x = torch.randint(0, cfg.vocab, (1, cfg.seq_len))
    mesh = init_device_mesh("cpu", (world,))

    def timed(step) -> float:
        dist.barrier()  # the same number of runs on every rank: their collectives must pair up
        return _best_seconds(step, 0, min_reps=max(5, int(budget / 3 / 0.01)), stat=sorted_median)

    plain = build_model(cfg)
    base = timed(lambda: lm_loss(plain(x), x).backward())
    tp = build_model(cfg)
    apply_tensor_parallel(tp, mesh, sp=False)
    tp_loss = vocab_parallel_loss(mesh, cfg.vocab)

    def tp_step():
        with loss_parallel():
            tp_loss(tp(x), x).backward()

    tp_s = timed(tp_step)
    fsdp = build_model(cfg)
    for block in fsdp.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(fsdp, mesh=mesh, reshard_after_forward=False)
    fsdp_s = timed(lambda: lm_loss(fsdp(x), x).backward())
    params = list(fsdp.parameters())
    fsdp_step = _training_step(fsdp, x, torch.optim.AdamW(params, lr=1e-3, foreach=True))  # DTensor: no fused kernel
    optimizer_s = timed(fsdp_step) - fsdp_s
    ops = count_ops(cfg)
    tp_comm = 4 * cfg.layers * latency["all-reduce"]
    fsdp_comm = latency["all-gather"] + latency["reduce-scatter"]
    return {"tp_op_overhead_s": max(base / ops, (tp_s - tp_comm) / ops),
            "fsdp_group_overhead_s": max(1e-9, (fsdp_s - base) / (cfg.layers + 1) - fsdp_comm),
            "dtensor_tensor_overhead_s": max(1e-9, optimizer_s / len(params))}


def sorted_median(times: list[float]) -> float:
    """The median: collectives pair up ranks, so one rank's best run is not the other's."""
    return sorted(times)[len(times) // 2]


def _collective_worker(rank: int, world: int, port: int, out: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    from luban.parallel.launch import host_cores, rank_threads

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(rank_threads(host_cores(), world))  # as luban.parallel.launch sets its ranks
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
    smallest = {name: times[MESSAGE_SIZES[0]] or 0.0 for name, times in results.items()}
    results["overhead"] = {**framework_overhead(), **parallel_overhead(world, smallest)}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _spawn(worker, world: int) -> dict:
    """Run ``worker(rank, world, port, out)`` on ``world`` local processes; rank 0's JSON result."""
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        # the workers start with SIGINT blocked: a terminal's Ctrl-C reaches the whole process group,
        # and this process alone answers it (luban.interrupt), ending the workers with it. The
        # resource tracker is started first: starting it unblocks SIGINT in the starting thread
        # (multiprocessing/resource_tracker.py), and a worker started from that thread would take
        # Ctrl-C while importing torch and print a traceback
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            context = mp.spawn(worker, args=(world, port, out), nprocs=world, join=False)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

        def kill():
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join(5)

        try:
            with interrupt.on_abort(kill):
                while not context.join():
                    pass
        except BaseException:
            kill()
            raise
        return json.loads(Path(out).read_text())


def collective_times(world: int = 2) -> dict:
    """Seconds per collective and message size between ``world`` local gloo processes, and
    (``"overhead"``) ``framework_overhead()`` of one of them while all ``world`` run it."""
    raw = _spawn(_collective_worker, world)
    overhead = raw.pop("overhead")
    return {"overhead": overhead, **{name: {int(k): v for k, v in sizes.items()} for name, sizes in raw.items()}}


def _oversubscribed_worker(rank: int, world: int, port: int, out: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)  # as luban.parallel.launch sets ranks that outnumber the cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.ones(MESSAGE_SIZES[0] // 4)
    dist.barrier()
    result = {"all_reduce_s": _best_seconds(lambda: dist.all_reduce(x), 0, min_reps=30, stat=sorted_median)}
    dist.barrier()
    result["reference_s"] = reference_seconds(1.0)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def oversubscribed_times(cores: int) -> "dict | None":
    """A smallest-message all-reduce and the reference pass (``reference_seconds``) when
    2·cores one-thread processes share the cores, as ``luban train --nproc N`` with N > cores
    runs; None on hosts of more than ``OVERSUBSCRIBED_MAX // 2`` cores (too many processes to
    start for a probe)."""
    if 2 * cores > OVERSUBSCRIBED_MAX:
        return None
    return {"world": 2 * cores, **_spawn(_oversubscribed_worker, 2 * cores)}


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

    from luban.parallel.launch import host_cores

    cores = os.cpu_count() or 1
    mem_total = _mem_total()
    fp32 = {n: matmul_flops(n, budget=0.1) for n in MATMUL_SIZES}
    peak32 = max(fp32.values())
    bf16 = matmul_flops(256, torch.bfloat16)  # one size: CPUs without bf16 units are very slow here
    hbm = memory_bandwidth()
    times = collective_times(world)
    coll = fit_collectives(times, world)
    cpu = cpu_profile(framework_overhead(), times["overhead"], world, oversubscribed_times(host_cores()),
                      coll["latency"])
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
                       "elementwise_traffic": 2.0, "hbm_efficiency": 1.0,
                       "zero3_overlap": 0.0},
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


def cpu_profile(alone: dict, together: dict, world: int, over: "dict | None" = None, latency: float = 0.0) -> dict:
    """The profile's ``[cpu]`` table from ``framework_overhead()`` of one process (``alone``, this
    process's ``threads``), of one of ``world`` processes running it at once (``together``, each
    with ``rank_threads(cores, world)`` threads, as launched ranks have), which also holds their
    ``parallel_overhead()``, and ``oversubscribed_times()`` (``over``; None: not measured).

    Ranks that together run more threads than there are cores contend for them: a rank's
    framework overhead runs max(1, N·t/cores)^γ times slower than alone (γ = 1: a fair share of
    the cores; more when they stall each other), and each step of a ring collective waits
    ``oversubscribed_stall_s`` × (N·t/cores − 1) longer for peers that are not running. Both
    come from ``over`` (2·cores one-thread processes: N·t/cores = 2): γ from its reference pass
    against ``reference_one_thread_s``, the stall from its all-reduce against the 2-process
    ``latency`` per ring step. Without ``over``, γ is fitted to ``together`` where its processes
    oversubscribe the cores (after taking out the threads they have fewer of than this process,
    ``luban.plan.time.thread_slowdown``) and is 1 otherwise, and the stall is 0 (1e-9)."""
    import math

    import torch

    from luban.parallel.launch import host_cores, rank_threads
    from luban.plan.time import thread_slowdown

    cores, threads = host_cores(), torch.get_num_threads()
    gamma, stall = 1.0, 1e-9
    if over:
        ratio = over["reference_s"] / alone["reference_one_thread_s"]
        gamma = max(1.0, math.log(ratio) / math.log(over["world"] / cores)) if ratio > 1 else 1.0
        stall = max(stall, over["all_reduce_s"] / (2 * (over["world"] - 1)) - latency)
    else:
        each = rank_threads(cores, world)
        factor = world * each / cores
        if factor > 1:
            fewer_threads = thread_slowdown({**alone, "threads": threads}, each)
            ratio = together["reference_s"] / alone["reference_s"] / fewer_threads
            gamma = max(1.0, math.log(ratio) / math.log(factor)) if ratio > 1 else 1.0
    return {"cores": cores, "threads": threads, "oversubscription_exponent": gamma, "oversubscribed_stall_s": stall,
            **alone, **{k: together[k] for k in ("tp_op_overhead_s", "fsdp_group_overhead_s", "dtensor_tensor_overhead_s")}}


def _mem_total() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def write_profile(profile: dict, path: "str | Path", own: bool = False) -> Path:
    """Write a profile as JSON (``.json``) or TOML (anything else), whole or not at all: to a new
    file, never over an existing one (``--out``'s error line if something is there), or, ``own``,
    replacing luban's own file (its probe cache). A profile ``System.from_dict`` refuses is not written."""
    from luban.data.atomic import create_bytes, write_bytes
    from luban.errors import bad_value
    from luban.plan.system import System, is_json

    path = Path(path)
    System.from_dict(profile, source="probe")  # a measurement out of the planner's bounds: one line, no file it cannot read
    if is_json(path):
        text = json.dumps(profile, indent=2) + "\n"
    else:
        flat = [f"{k} = {toml_value(v)}" for k, v in profile.items() if not isinstance(v, dict)]
        tables = [f"\n[{k}]\n" + "\n".join(f"{kk} = {toml_value(vv)}" for kk, vv in v.items())
                  for k, v in profile.items() if isinstance(v, dict)]
        text = "\n".join(flat) + "\n" + "\n".join(tables) + "\n"
    try:
        (write_bytes if own else create_bytes)(path, text.encode())
    except FileExistsError:
        raise bad_value("--out", str(path), "a new file's path (luban never overwrites a file)") from None
    except OSError as err:
        raise bad_value("--out", str(path), f"a new file's path in an existing, writable folder ({err.strerror})") from None
    return path


def cache_path() -> Path:
    import torch

    from luban.train.resolve import cache_dir  # one variable for every cache: LUBAN_CACHE

    return cache_dir() / f"probe-{socket.gethostname()}-torch{torch.__version__}.json"


def cached_profile() -> dict:
    """This machine's probe, measured once and kept in ``cache_path()`` (measured again when the
    cached one predates any of the ``cpu`` terms)."""
    from luban.errors import LubanError
    from luban.plan.system import CPU_KEYS, System

    path = cache_path()
    try:  # luban's own cache: an unreadable or damaged one, or one the planner refuses, is measured again
        cached = json.loads(path.read_text())
        if isinstance(cached, dict) and isinstance(cached.get("cpu"), dict) and set(CPU_KEYS) <= set(cached["cpu"]):
            System.from_dict(cached, source="probe")  # edited, or written under looser bounds than today's
            return cached
    except (OSError, ValueError, RecursionError, LubanError):
        pass
    profile = probe_system()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_profile(profile, path, own=True)
    return profile

