"""Starting the rank processes: ``launch`` (a small torchrun) and ``init_distributed``.

``launch`` runs ``python -m luban <argv>`` once per local rank with the torchrun environment
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), forwards
SIGUSR1/SIGTERM/SIGINT to every child, kills the others when one fails, and returns 75
(suspended) only when every rank exited with 75.

Ranks are one unit with their launcher (``luban.procs``): they share one process group of their
own (a terminal's Ctrl-C reaches them once, through the launcher), ask for SIGKILL when the
launcher dies (``LUBAN_LAUNCHER_PID``), start with the forwarded signals blocked until their
handlers are installed, and whatever is left of them is killed when ``launch`` returns. The
forwarding handlers are installed before the first rank starts, and a signal recorded before
``launch`` was called ends it with 75 without starting any rank; one while a rank waits in a
rendezvous that cannot complete ends that rank with 75 ``JOIN_GRACE_S`` later (``init_distributed``).
A rendezvous that could not work (no agreed port across nodes, a port in use, an address that does
not resolve) is refused, one line, before any rank starts. Under Slurm the node count, node rank and
master address default to SLURM_NNODES/SLURM_NODEID/SLURM_JOB_NODELIST, and a process
started directly by ``srun`` (one task per rank) takes its rank from SLURM_PROCID.

Each rank gets ``OMP_NUM_THREADS = rank_threads(cores, nproc)`` unless the caller set it: N ranks
each running the default one-thread-per-core pool on the same cores oversubscribe them N-fold,
and OpenMP regions then wait on descheduled threads (torchrun sets 1; luban shares the cores out).
The planner's CPU model (``luban.plan.time.cpu_terms``) assumes the same rule.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from luban import procs
from luban.errors import EXIT_SUSPENDED, LubanError, bad_value
from luban.train import preempt

FORWARDED = preempt.HANDLED  # the suspend signals: forwarded to every rank
MAX_WORLD = 1 << 24  # ranks of one job (RENDEZVOUS in luban.train.cli bounds nproc and nnodes apart)


# ports handed out for a rendezvous lie below the kernel's ephemeral range (Linux default
# 32768-60999, /proc/sys/net/ipv4/ip_local_port_range): a port there, freed by ``free_port`` and
# bound by rank 0 seconds later, can meanwhile become the source port of any outgoing connection
# (gloo opens many) — EADDRINUSE, seen in a 2-worker CI run
RENDEZVOUS_PORTS = (20000, 32768)


def free_port() -> int:
    """A port that is free now, outside the ephemeral range when one is (else any free one)."""
    import random

    low, high = RENDEZVOUS_PORTS
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = min(high, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        pass
    for port in random.Random().sample(range(low, high), min(64, max(high - low, 0))):  # not the global RNG
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    """Whether a rendezvous server could listen on ``port`` (all addresses, as torch's TCPStore does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to it too
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


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


def check_rendezvous(nnodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1",
                     master_port: int = 0) -> tuple[int, int, str, int]:
    """The rendezvous a launch would use (Slurm's where it runs under Slurm), refused in one line where it
    could not work; a port of 0 on one node stays 0 (``launch`` picks a free one). ``luban train`` and
    ``demo`` call it before they plan or make anything, ``launch`` again."""
    slurm = slurm_defaults()
    if nnodes == 1 and slurm:
        nnodes, node_rank = slurm["nnodes"], slurm["node_rank"]
        master_addr = slurm.get("master_addr", master_addr) if nnodes > 1 else master_addr
        master_port = master_port or (slurm["master_port"] if nnodes > 1 else 0)
    if master_port == 0:
        if nnodes > 1:
            raise bad_value("--master-port", master_port, "a port from 1 to 65535, the same on every node: a "
                            "multi-node launch needs an agreed one")
    elif node_rank == 0 and not port_free(master_port):  # rank 0 would fail to serve the rendezvous on it
        raise bad_value("--master-port", master_port, "a port free on this node (rank 0 serves the rendezvous "
                        "on it; it is in use): pick another, or leave it out on one node")
    try:  # a name no rank can resolve would leave every rank retrying its rendezvous for 30 minutes
        socket.getaddrinfo(master_addr, master_port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as err:
        raise bad_value("--master-addr", master_addr, "a host name or address of the node running rank 0 "
                        f"that this node can resolve ({getattr(err, 'strerror', None) or err})") from None
    return nnodes, node_rank, master_addr, master_port


def launch(argv: list[str], nproc: int, nnodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1",
           master_port: int = 0, module: str = "luban") -> int:
    """Run ``python -m <module> <argv>`` as ``nproc`` local ranks; return their common exit code."""
    nnodes, node_rank, master_addr, master_port = check_rendezvous(nnodes, node_rank, master_addr, master_port)
    master_port = master_port or free_port()
    world = nproc * nnodes
    threads = os.environ.get("OMP_NUM_THREADS") or str(rank_threads(host_cores(), nproc))
    children: list[subprocess.Popen] = []
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    # forwarding is in place before the first rank exists; a signal that came even earlier (the
    # trainer's early handler recorded it) means: suspended before any work, start nothing
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        if preempt.early_signal():
            print(f"suspended on {preempt.early_signal()} before any rank started; exit {EXIT_SUSPENDED} "
                  "(resume with --resume auto)", flush=True)
            return EXIT_SUSPENDED
        preempt.start_up_over()  # the ranks answer the signals from now on (a demo's launcher then samples)
        # between fork and exec: die with this launcher (PR_SET_PDEATHSIG survives exec); luban ranks
        # keep the forwarded signals blocked until their handlers are in (preempt.install), other
        # modules get them unblocked
        me, unblock = os.getpid(), module != "luban"

        def prepare_rank():
            procs.die_with_parent(me)
            if unblock:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)

        for local in range(nproc):
            env = dict(os.environ, OMP_NUM_THREADS=threads, RANK=str(node_rank * nproc + local),
                       LOCAL_RANK=str(local), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(nproc),
                       GROUP_RANK=str(node_rank), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                       **{procs.PARENT_VAR: str(me)})
            group = children[0].pid if children else 0  # all ranks in one process group, not ours
            signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # no forward() while the list changes
            try:
                children.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=env,
                                                 process_group=group, preexec_fn=prepare_rank))
                for signum in received:  # arrived before this rank existed
                    children[-1].send_signal(signum)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        return _wait(children)
    finally:
        _terminate(children, 0.0)  # nothing of a rank outlives its launcher
        for sig, handler in previous.items():
            signal.signal(sig, handler)


SETTLE_S = 3.0  # after a rank fails, how long the others may take to end on their own before the code is chosen


def _wait(children: list[subprocess.Popen], grace_s: float = 10.0, settle_s: float = SETTLE_S) -> int:
    """Wait for all; a rank failing (not 0, not 75) terminates the rest and its code is returned:
    a rank killed by a signal first (the others then only lost their peer), named in one line, else
    a code a rank chose (2, 74, 141, ...) over 1. A rank that lost its peer exits 1 without a word
    (luban.cli), often before the rank that stopped has been reaped: the others get ``settle_s`` to
    end on their own first, so that the cause, not the first rank seen, gives the exit code."""
    while True:
        codes = [c.poll() for c in children]
        failed = [code for code in codes if code not in (None, 0, EXIT_SUSPENDED)]
        if failed:
            deadline = time.monotonic() + settle_s
            while None in codes and time.monotonic() < deadline:
                time.sleep(0.05)
                codes = [c.poll() for c in children]
            failed = [code for code in codes if code not in (None, 0, EXIT_SUSPENDED)]
            killed = next(((rank, code) for rank, code in enumerate(codes) if code is not None and code < 0), None)
            if killed is not None:
                rank, code = killed
                print(f"luban: error: rank {rank} was killed by {signal.Signals(-code).name}; the other ranks were "
                      f"stopped (exit {128 - code}; resume with --resume auto)", file=sys.stderr, flush=True)
            _terminate(children, grace_s)
            first = killed[1] if killed else next((code for code in failed if code != 1), failed[0])
            return first if first > 0 else 128 - first
        if all(code is not None for code in codes):
            if len(set(codes)) == 1:
                return codes[0]
            return 1  # some ranks suspended, others finished: they disagree on the step
        time.sleep(0.05)


def _terminate(children: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM the ranks, SIGKILL what is left after ``grace_s``, then the ranks' process group
    (their own children included)."""
    for child in children:
        if child.poll() is None:
            child.terminate() if grace_s > 0 else child.kill()
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    if children:
        try:
            os.killpg(children[0].pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# what a collective raises on a rank whose peer died (gloo's TCP pair; NCCL's socket and watchdog)
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
             "NCCL communicator was aborted", "Socket Timeout")


def peer_lost(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is a collective failing because another rank is gone."""
    seen: list[BaseException] = [err]
    while seen:
        e = seen.pop()
        if isinstance(e, RuntimeError) and any(text in str(e) for text in PEER_LOST):
            return True
        seen += [x for x in (e.__cause__, e.__context__) if x is not None]
    return False


def rank_env(env=os.environ) -> dict:
    """RANK/WORLD_SIZE/LOCAL_RANK from torchrun's variables, else from ``srun``'s SLURM_* ones."""
    if "RANK" in env or "SLURM_PROCID" not in env:
        return {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in env}
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"], "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}


def check_rank_env(env=os.environ) -> int:
    """The world size of a process started as a rank (``WORLD_SIZE`` set), after checking the
    variables torch's env:// rendezvous reads: a stale or partial set (WORLD_SIZE left exported in a
    shell) is one line, not a traceback."""
    ranks = rank_env(env)
    launched = ("set by the launcher of a job's ranks (luban train --nproc, torchrun, srun); a WORLD_SIZE left "
                "in the environment makes this process one of them: unset it, and start ranks with --nproc")
    world = ranks.get("WORLD_SIZE", "1")
    if not (world.isascii() and world.isdigit() and 0 < int(world) <= MAX_WORLD):
        raise bad_value("WORLD_SIZE", world, f"an integer from 1 to {MAX_WORLD}, {launched}")
    if int(world) == 1:
        return 1
    for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if key not in {**env, **ranks}:
            raise LubanError(f"{key} = (unset): {launched}")
    rank, port = ranks["RANK"], env["MASTER_PORT"]
    if not (rank.isascii() and rank.isdigit() and int(rank) < int(world)):
        raise bad_value("RANK", rank, f"an integer from 0 to {int(world) - 1} (WORLD_SIZE = {world}), {launched}")
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise bad_value("MASTER_PORT", port, f"an integer from 1 to 65535, {launched}")
    return int(world)


def shutdown_distributed() -> None:
    """Destroy every process group before the interpreter exits: left to C++ destructors at exit,
    gloo's threads can be torn down while joinable (std::terminate, exit 134 — seen when ranks
    suspended before their first step)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def init_distributed(device) -> None:
    """Join the process group once: NCCL on CUDA, gloo otherwise (env:// rendezvous; a process
    that is no launched rank — ``WORLD_SIZE`` unset or 1 — forms a group of its own, which FSDP2
    needs for ``offload = params`` in one process)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(rank_env())
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if check_rank_env() == 1:  # one process (FSDP2's offload needs a group): nobody to meet
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    with _suspend_if_joining_stalls():
        dist.init_process_group(backend)


JOIN_GRACE_S = 5.0  # a healthy rendezvous ends within this of a signal: the trainer then suspends as usual


@contextlib.contextmanager
def _suspend_if_joining_stalls():
    """A suspend signal while this rank waits in the rendezvous for ranks that do not come (a node that
    never starts, a master address nobody serves) ends it with 75 ``JOIN_GRACE_S`` later: the
    rendezvous blocks in C++ for up to 30 minutes, and Python runs the signal's handler only after
    it. The C-level handler still writes the signal's number to the wake-up fd; a thread reads it.
    A rendezvous that completes within the grace leaves the signal to the trainer (all ranks agree)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read, write = os.pipe()
    os.set_blocking(read, False), os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    joined = threading.Event()

    def watch():
        reason = preempt.early_signal()  # came before the rendezvous began
        since = time.monotonic() if reason else None
        while not joined.wait(0.1):
            try:
                got = [signal.Signals(n).name for n in os.read(read, 64) if n in FORWARDED]
            except BlockingIOError:
                got = []
            if got and since is None:
                reason, since = got[0], time.monotonic()
            if since is not None and time.monotonic() - since > JOIN_GRACE_S:
                print(f"suspended on {reason} while waiting for the other ranks to join; exit {EXIT_SUSPENDED} "
                      "(nothing to save; run again with --resume auto)", flush=True)
                os._exit(EXIT_SUSPENDED)

    thread = threading.Thread(target=watch, name="luban-join", daemon=True)
    thread.start()
    try:
        yield
    finally:
        joined.set()
        thread.join()
        signal.set_wakeup_fd(previous)
        os.close(read), os.close(write)
