"""Starting the rank processes: ``launch`` (a small torchrun) and ``init_distributed``.

``launch`` runs ``python -m luban <argv>`` once per local rank with the torchrun environment
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), forwards
SIGUSR1/SIGTERM/SIGINT to every child, kills the others when one fails, and returns 75
(suspended) only when every rank exited with 75. Under Slurm the node count, node rank and
master address default to SLURM_NNODES/SLURM_NODEID/SLURM_JOB_NODELIST, and a process
started directly by ``srun`` (one task per rank) takes its rank from SLURM_PROCID.

Each rank gets ``OMP_NUM_THREADS = rank_threads(cores, nproc)`` unless the caller set it: N ranks
each running the default one-thread-per-core pool on the same cores oversubscribe them N-fold,
and OpenMP regions then wait on descheduled threads (torchrun sets 1; luban shares the cores out).
The planner's CPU model (``luban.plan.time.cpu_terms``) assumes the same rule.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from luban.errors import EXIT_SUSPENDED

FORWARDED = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_threads(cores: int, nproc: int) -> int:
    """Torch (OpenMP) threads of each of ``nproc`` ranks sharing ``cores`` cores: a fair share, at least 1."""
    return max(1, cores // nproc)


def host_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def slurm_defaults(env=os.environ) -> dict:
    """Node count, node rank, master address and port from a Slurm allocation (empty outside one)."""
    if "SLURM_JOB_ID" not in env:
        return {}
    out = {"nnodes": int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1"))),
           "node_rank": int(env.get("SLURM_NODEID", "0")),
           "master_port": 20000 + int(env["SLURM_JOB_ID"]) % 20000}
    nodelist = env.get("SLURM_JOB_NODELIST", "")
    if nodelist:
        try:
            hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                   text=True, check=True).stdout.split()
            out["master_addr"] = hosts[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            out["master_addr"] = nodelist.split(",")[0]
    return out


def launch(argv: list[str], nproc: int, nnodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1",
           master_port: int = 0, module: str = "luban") -> int:
    """Run ``python -m <module> <argv>`` as ``nproc`` local ranks; return their common exit code."""
    slurm = slurm_defaults()
    if nnodes == 1 and slurm:
        nnodes, node_rank = slurm["nnodes"], slurm["node_rank"]
        master_addr = slurm.get("master_addr", master_addr) if nnodes > 1 else master_addr
        master_port = master_port or (slurm["master_port"] if nnodes > 1 else 0)
    if master_port == 0:
        if nnodes > 1:
            raise ValueError("a multi-node launch needs an agreed master_port")
        master_port = free_port()
    world = nproc * nnodes
    threads = os.environ.get("OMP_NUM_THREADS") or str(rank_threads(host_cores(), nproc))
    children = []
    for local in range(nproc):
        env = dict(os.environ, OMP_NUM_THREADS=threads, RANK=str(node_rank * nproc + local), LOCAL_RANK=str(local),
                   WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(node_rank),
                   MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        # own session: a terminal's Ctrl-C reaches the children once, through us
        children.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=env, start_new_session=True))

    def forward(signum, _frame):
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        return _wait(children)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait(children: list[subprocess.Popen], grace_s: float = 10.0) -> int:
    """Wait for all; a rank failing (not 0, not 75) terminates the rest and its code is returned."""
    while True:
        codes = [c.poll() for c in children]
        failed = [code for code in codes if code not in (None, 0, EXIT_SUSPENDED)]
        if failed:
            _terminate(children, grace_s)
            return failed[0] if failed[0] > 0 else 128 - failed[0]
        if all(code is not None for code in codes):
            if len(set(codes)) == 1:
                return codes[0]
            return 1  # some ranks suspended, others finished: they disagree on the step
        time.sleep(0.05)


def _terminate(children: list[subprocess.Popen], grace_s: float) -> None:
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def rank_env(env=os.environ) -> dict:
    """RANK/WORLD_SIZE/LOCAL_RANK from torchrun's variables, else from ``srun``'s SLURM_* ones."""
    if "RANK" in env or "SLURM_PROCID" not in env:
        return {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in env}
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"], "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}


def world_size() -> int:
    return int(rank_env().get("WORLD_SIZE", "1"))


def init_distributed(device) -> None:
    """Join the process group once: NCCL on CUDA, gloo otherwise (env:// rendezvous)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(rank_env())
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
