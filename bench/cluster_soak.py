"""Soak the platform under chaos: M jobs, N random kills of the service and of jobs' processes.

Each job is a checkpointing counter (SIGUSR1 -> save, exit 75; resumes from its chain's state)
that appends start/suspend/done lines to a ledger. While the jobs run, a chaos loop kill -9s the
service (and restarts it on the same state) or a random job process or launcher, HIGH jobs
arrive to preempt LOW ones, and a watcher samples every 0.25 s:

- run twice: two attempts of one chain alive at once (processes found by LUBAN_CHAIN_ID), or one
  attempt started twice (two "start" lines for one job id);
- quota: any (owner, node group, priority) holding more nodes than its quota (GET /api/quota);
- at the end, lost: a submitted chain that never reached succeeded/failed/stopped, and orphans:
  live processes of these jobs (LUBAN_JOB_TAG) after every chain ended.

Usage: python bench/cluster_soak.py [--jobs 40] [--kills 12] [--seed 0] [--run-jobs-as namespace|service]
[--out FILE.json] (namespace, the default: each job in the namespaces that hide the service's state,
as a non-root service runs them; service: unisolated, as the service's account).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from luban import procs  # noqa: E402
from luban.cluster.client import Client  # noqa: E402

JOB = r"""
import os, signal, sys, time
ledger, state_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
chain, job = os.environ["LUBAN_CHAIN_ID"], os.environ["LUBAN_JOB_ID"]
def log(event):
    with open(ledger, "a") as f:
        f.write(f"{time.time():.3f} {chain} {job} {os.getpid()} {event}\n")
path = os.path.join(state_dir, chain)
step = int(open(path).read()) if os.path.exists(path) else 0
asked = []
signal.signal(signal.SIGUSR1, lambda *a: asked.append(1))
log(f"start {step}")
def save():
    with open(path + ".tmp", "w") as f:
        f.write(str(step))
    os.replace(path + ".tmp", path)
while step < steps:
    if asked:
        save(); log(f"suspend {step}"); sys.exit(75)
    time.sleep(0.1)
    step += 1
save()
log("done")
"""
FINAL = ("succeeded", "failed", "stopped")


def env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)


def live_job_processes(url: str) -> list[tuple[int, dict]]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and procs.alive(int(entry.name)):
            env = env_of(int(entry.name))
            if env.get("LUBAN_CLUSTER_URL") == url and procs.TAG_VAR in env:
                out.append((int(entry.name), env))
    return out


class Service:
    def __init__(self, state: Path, port: int, nodes: int, run_jobs_as: str):
        self.state, self.port, self.nodes, self.run_jobs_as = state, port, nodes, run_jobs_as
        self.url, self.proc = f"http://127.0.0.1:{port}", None

    def start(self) -> None:
        log = open(self.state.parent / "service.log", "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "luban", "cluster", "serve", "--state", str(self.state),
                                      "--port", str(self.port), "--nodes", str(self.nodes), "--tick", "0.2",
                                      "--suspend-timeout", "20", "--run-jobs-as", self.run_jobs_as],
                                     stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/api/whoami", timeout=1).status_code == 401:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        log.flush()
        tail = (self.state.parent / "service.log").read_text().strip().splitlines()[-5:]
        raise SystemExit("service did not start:\n  " + "\n  ".join(tail))

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-jobs-as", choices=["namespace", "service"], default="namespace")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.run_jobs_as == "namespace" and os.geteuid() == 0:  # the service refuses it (every job would run as root)
        parser.error("--run-jobs-as namespace needs a service that is not root: run this as an unprivileged "
                     "account, or pass --run-jobs-as service (unisolated)")
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="luban-soak-"))
    (work / "chains").mkdir()
    script, ledger = work / "job.py", work / "ledger"
    script.write_text(JOB)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    svc = Service(work / "state", port, args.nodes, args.run_jobs_as)
    svc.start()
    admin = Client(svc.url, (svc.state / "admin.token").read_text().strip(), retry_for=120)
    users = {}
    for name in ("ann", "ben", "cat"):
        users[name] = Client(svc.url, admin.add_user(name)["token"], retry_for=120)
        admin.set_quota(f"user:{name}", "LOW", 2)
        admin.set_quota(f"user:{name}", "HIGH", 1)

    violations = {"run_twice": [], "quota": []}
    stop_watch = threading.Event()

    def watch():
        while not stop_watch.is_set():
            chains: dict[str, set[str]] = {}
            for _, env in live_job_processes(svc.url):
                chains.setdefault(env.get("LUBAN_CHAIN_ID", "?"), set()).add(env.get("LUBAN_JOB_ID", "?"))
            violations["run_twice"] += [(c, sorted(j)) for c, j in chains.items() if len(j) > 1]
            try:
                for q in httpx.get(svc.url + "/api/quota", timeout=2, headers=admin.http.headers).json():
                    if q["used"] > q["nodes"]:
                        violations["quota"].append(q)
            except (httpx.HTTPError, ValueError, TypeError):
                pass  # the service is down right now
            time.sleep(0.25)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.time()
    submitted = []
    for i in range(args.jobs):
        user = rng.choice(list(users))
        level = "HIGH" if rng.random() < 0.2 else "LOW"
        spec = {"name": f"soak{i}", "command": sys.executable,
                "args": [str(script), str(ledger), str(work / "chains"), str(rng.randint(20, 80))],
                "priority": level, "nodes": 1}
        submitted.append(users[user].submit(spec)["id"])
        time.sleep(rng.uniform(0.0, 0.3))
    kills = {"service": 0, "job": 0, "launcher": 0}
    actions = (["service", "job", "launcher"] * args.kills)[:args.kills]
    rng.shuffle(actions)
    for what in actions:
        time.sleep(rng.uniform(1.0, 3.0))
        if what == "service":
            svc.kill9()
            time.sleep(rng.uniform(0.2, 1.5))
            svc.start()
            kills["service"] += 1
            continue
        running = live_job_processes(svc.url)
        if what == "job" and running:
            os.kill(rng.choice(running)[0], signal.SIGKILL)
            kills["job"] += 1
        elif what == "launcher":
            launchers = [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()
                         and b"luban.cluster.launcher" in Path(f"/proc/{e.name}/cmdline").read_bytes()
                         and str(svc.state).encode() in Path(f"/proc/{e.name}/cmdline").read_bytes()]
            if launchers:
                os.kill(rng.choice(launchers), signal.SIGKILL)
                kills["launcher"] += 1
    deadline = time.time() + 600
    while time.time() < deadline:
        states = [admin.latest(j)["state"] for j in submitted]
        if all(s in FINAL for s in states):
            break
        time.sleep(1.0)
    elapsed = time.time() - t0
    stop_watch.set()
    watcher.join()
    time.sleep(1.0)
    orphans = live_job_processes(svc.url)
    finals = [admin.latest(j) for j in submitted]
    starts = [line.split() for line in ledger.read_text().splitlines() if " start " in line]
    per_attempt: dict[str, int] = {}
    for _, _, job, _, _, _ in starts:
        per_attempt[job] = per_attempt.get(job, 0) + 1
    attempts = admin.jobs(all_attempts=True, limit=0)  # every attempt (the default is the newest 100)
    svc.stop()
    report = {
        "jobs": args.jobs, "kills": kills, "seconds": round(elapsed, 1), "nodes": args.nodes, "run_jobs_as": args.run_jobs_as,
        "attempts": len(attempts), "suspended_attempts": sum(a["state"] == "suspended" for a in attempts),
        "outcomes": {s: sum(f["state"] == s for f in finals) for s in FINAL},
        "lost": sum(f["state"] not in FINAL for f in finals),
        "run_twice": len(violations["run_twice"]) + sum(n > 1 for n in per_attempt.values()),
        "orphans": len(orphans), "quota_exceeded": len(violations["quota"]),
        "detail": {"run_twice": violations["run_twice"][:5], "quota": violations["quota"][:5],
                   "orphans": [p for p, _ in orphans][:5]},
    }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    for pid, _ in orphans:
        os.kill(pid, signal.SIGKILL)
    return 0 if report["lost"] == report["run_twice"] == report["orphans"] == report["quota_exceeded"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
