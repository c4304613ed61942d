"""The Slurm executor: luban decides, Slurm runs.

Nodes come from ``scontrol show node`` (node group = first partition, zone = a ``zone*``
feature). A job attempt is one ``sbatch --nodelist=... --exclusive --no-requeue`` whose batch
script ``srun``s one launcher per node (rank = SLURM_NODEID); suspend is
``scancel --signal=USR1`` (srun hands it to the launchers, which forward it to the job), kill is
``scancel``, whose SIGTERM makes each launcher kill every process of the job (``luban.procs``)
before it exits; the state is read back with ``scontrol show job``, and the launchers' exit files
(when the state directory is shared) give each rank's exit code.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from luban import procs
from luban.cluster import launcher
from luban.cluster.executors import Launch, NodeInfo, Status, combine
from luban.errors import LubanError

TIMEOUT_S = 60  # seconds one Slurm command may take (a slow or hung slurmctld)
FORGOTTEN = "Invalid job id"  # scontrol's answer for a job slurmctld no longer knows (MinJobAge), not an outage
RUNNING = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
           "STAGE_OUT"}


def fields(line: str) -> dict[str, str]:
    """``Key=Value Key=Value`` (scontrol -o) into a dict; values may not contain spaces."""
    out = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep:
            out[key] = value
    return out


class SlurmExecutor:
    def __init__(self, partition: str | None = None, state_dir: str = ".", python: str = sys.executable):
        self.partition, self.state_dir, self.python = partition, state_dir, python

    def _run(self, *args: str, env: dict[str, str] | None = None) -> str:
        """A Slurm command's output; one line (RuntimeError, LubanError when it is not installed)
        for a failure, a timeout included."""
        try:
            result = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
                                    errors="replace")
        except FileNotFoundError:
            raise LubanError(f"{args[0]} not found: install slurm-wlm (client) or use --executor local") from None
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{args[0]} did not answer within {TIMEOUT_S}s (slurmctld slow or down?)") from None
        if result.returncode != 0:
            why = " ".join(result.stderr.split())[:300]
            raise RuntimeError(f"{' '.join(args[:3])} failed ({result.returncode}): {why}")
        return result.stdout

    def discover(self) -> list[NodeInfo]:
        nodes = []
        for line in self._run("scontrol", "show", "node", "-o").splitlines():
            f = fields(line)
            partitions = (f.get("Partitions") or "default").split(",")
            if "NodeName" not in f or (self.partition and self.partition not in partitions):
                continue
            features = [x for x in (f.get("AvailableFeatures") or "").split(",") if x and x != "(null)"]
            zone = next((x for x in features if x.startswith("zone")), "default")
            gpus = sum(int(g.split(":")[-1].split("(")[0]) for g in (f.get("Gres") or "").split(",")
                       if g.startswith("gpu") and g.split(":")[-1].split("(")[0].isdigit())
            nodes.append(NodeInfo(f["NodeName"], self.partition or partitions[0], gpus,
                                  {"zone": zone, "features": features}, f.get("NodeAddr") or f["NodeName"]))
        return nodes

    def start(self, launch: Launch) -> str:
        run_dir = Path(launch.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        rank = [self.python, "-m", "luban.cluster.launcher", "--run-dir", str(run_dir), "--log",
                launch.log_pattern, "--tag", launch.name, *(["--user", launch.run_as] if launch.run_as else []),
                *[a for d in launch.hide for a in ("--hide", d)],
                *(["--max-log", str(launch.max_log)] if launch.max_log else []),
                "--", *launch.command]
        script = run_dir / "job.sbatch"
        script.write_text("#!/bin/bash\n# luban job %d\nexec srun --kill-on-bad-exit=0 --ntasks-per-node=1 "
                          "--nodes=%d --ntasks=%d %s\n" % (launch.job_id, len(launch.nodes), len(launch.nodes),
                                                          shlex.join(rank)))
        args = ["sbatch", "--parsable", f"--job-name={launch.name}", f"--nodelist={','.join(launch.nodes)}",
                f"--nodes={len(launch.nodes)}", "--exclusive", "--no-requeue", "--export=ALL",
                f"--output={run_dir}/slurm-%j.out", f"--chdir={launch.workdir or run_dir}"]
        if self.partition:
            args.append(f"--partition={self.partition}")
        env = dict(launch.env)  # complete: the scheduler built it (job_env)
        try:
            out = self._run(*args, str(script), env=env)
        except RuntimeError:  # a timeout may still have submitted it: the attempt fails, so nothing of it may run
            self._cancel_by_name(launch.name)
            raise
        slurm_id = out.strip().split(";")[0]
        if not slurm_id.isdigit():  # not --parsable's "ID[;cluster]": a job we could not follow must not run
            self._cancel_by_name(launch.name)
            raise RuntimeError(f"sbatch printed {out.strip()[:100]!r}, not a job id")
        return json.dumps({"slurm_id": slurm_id, "run_dir": str(run_dir), "ranks": len(launch.nodes),
                           "tag": launch.name})

    def _cancel_by_name(self, name: str) -> None:
        try:
            self._run("scancel", f"--name={name}")
        except (RuntimeError, LubanError):
            pass  # nothing to cancel, or slurmctld unreachable: find() by the tag after a restart

    def poll(self, handle: str) -> Status:
        info = json.loads(handle)
        run_dir = Path(info["run_dir"])
        files = [launcher.exit_file(run_dir, r) for r in range(info["ranks"])]
        try:
            f = fields(self._run("scontrol", "show", "job", "-o", info["slurm_id"])) if info["slurm_id"] else {}
        except RuntimeError as err:
            if FORGOTTEN not in str(err) and not all(p.exists() for p in files):
                # slurmctld down, slow or printing errors: the job is as it was, not lost (declaring it
                # lost ended the attempt while Slurm ran it on, and swept its processes on this host)
                return Status(done=False)
            f = {}  # forgotten by slurmctld (MinJobAge): fall back to the launchers' exit files
        state = f.get("JobState", "")
        if state in RUNNING:
            return Status(done=False, started=state not in ("PENDING", "CONFIGURING"))
        if all(p.exists() for p in files):
            return Status(done=True, exit_code=combine([int(p.read_text()) for p in files]),
                          ended_at=launcher.ended_at(run_dir, len(files)))
        for rank in range(info["ranks"] if info.get("tag") else 0):  # launchers died without exit files:
            procs.kill_job(launcher.node_tag(info["tag"], rank))  # sweep here (elsewhere: proctrack/cgroup)
        if not state:
            return Status(done=True, lost=True)
        code, _, sig = f.get("ExitCode", "0:0").partition(":")
        code = int(code) or (128 + int(sig or 0) if int(sig or 0) else (0 if state == "COMPLETED" else 1))
        return Status(done=True, exit_code=code)

    def find(self, launch: Launch) -> str | None:
        """squeue is the truth: a Slurm job named after the launch (its tag) is adopted; one that
        already ended is read back from its launchers' exit files."""
        ids = self._run("squeue", "-h", "-n", launch.name, "-o", "%i").split()
        run_dir = Path(launch.run_dir)
        done = all(launcher.exit_file(run_dir, r).exists() for r in range(len(launch.nodes)))
        if not ids and not done:
            return None
        return json.dumps({"slurm_id": ids[0] if ids else "", "run_dir": launch.run_dir,
                           "ranks": len(launch.nodes), "tag": launch.name})

    def suspend(self, handle: str) -> None:
        self._run("scancel", "--signal=USR1", json.loads(handle)["slurm_id"])

    def kill(self, handle: str) -> None:
        self._run("scancel", json.loads(handle)["slurm_id"])
