"""The Slurm executor: luban decides, Slurm runs.

Nodes come from ``scontrol show node`` (node group = first partition, zone = a ``zone*``
feature; a State on which Slurm allocates no new job, drained or down, makes the node unavailable
in luban: ``node_unavailable``). A job attempt is one ``sbatch --nodelist=... --exclusive
--no-requeue`` whose batch script ``srun``s one launcher per node (rank = SLURM_NODEID); suspend is
``scancel --signal=USR1`` (srun hands it to the launchers, which forward it to the job), kill is
``scancel``, whose SIGTERM makes each launcher kill every process of the job (``luban.procs``)
before it exits; the state is read back with ``scontrol show job``, and the launchers' exit files
(when the state directory is shared) give each rank's exit code. A job Slurm holds before it started
(``scontrol hold``: Reason ``JobHeldAdmin``/``JobHeldUser``) is reported ``held`` (the scheduler
cancels it and holds the attempt in luban instead).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from luban import procs
from luban.cluster import launcher
from luban.cluster.executors import Launch, NodeInfo, StartDeferred, Status, Unavailable, combine
from luban.errors import bad_value, escaped

COMMANDS = ("sbatch", "squeue", "scontrol", "scancel")  # what this executor runs (slurm-wlm's client)
TIMEOUT_S = 60  # seconds one Slurm command may take (a slow or hung slurmctld)
FORGOTTEN = "Invalid job id"  # scontrol's answer for a job slurmctld no longer knows (MinJobAge), not an outage
# what Slurm's commands print when they cannot reach slurmctld (down, restarting, overloaded, network):
# an outage, not an answer about the job (slurm/src/common/slurm_errno.c, errno strings)
UNREACHABLE = ("unable to contact slurm controller", "socket timed out", "connection refused", "connection timed out",
               "zero bytes were transmitted", "communication connection failure", "backup controller in standby",
               "transport endpoint is not connected", "resource temporarily unavailable", "slurm_receive_msg",
               "no route to host", "network is unreachable")
RUNNING = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
           "STAGE_OUT", "STOPPED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"}
CANCELLED = "sbatch.cancelled"  # in a run dir: a failed try's scancel --name was taken (its retry waits for it)
SLURM_CLIENT_ENV = ("SLURM_CONF",)  # the service's, for sbatch: where slurm.conf is (slurm-wlm's only one)
SCRIPT = "job.sbatch"  # in a run dir: the batch script of the attempt's latest try (there: a try was made)
# a pending job's Reason when it is held (`scontrol hold` by an admin / `scontrol hold` or `sbatch -H` by its
# user; slurm/src/common/slurm_protocol_defs.c, job_state_reason_string): it will not start until released
HELD = {"JobHeldAdmin": "admin", "JobHeldUser": "user"}
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
         "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT"}
# A node's State in ``scontrol show node``: a base state and "+"-joined flags (scontrol(1), NODES, State:
# 22.05 prints IDLE+DRAIN, MIXED+DRAIN, IDLE+NOT_RESPONDING); older versions, like sinfo, mark some flags
# with a suffix instead (sinfo(1), NODE STATE CODES: DOWN*, IDLE~). The states and flags on which Slurm
# allocates no new job, in luban's words (a DRAIN flag reads drained or, with jobs on the node, draining):
NO_NEW_JOBS = {"DOWN": "down", "DRAINED": "drained", "DRAINING": "draining", "FAIL": "failing",
               "FAILING": "failing", "FUTURE": "future (not configured yet)", "UNKNOWN": "unknown (not registered yet)",
               "ERROR": "error", "INVAL": "invalid registration", "INVALID_REG": "invalid registration",
               "NOT_RESPONDING": "not responding", "NO_RESPOND": "not responding",
               "MAINT": "in a maintenance reservation", "MAINTENANCE": "in a maintenance reservation",
               "RESERVED": "in an advanced reservation",  # not generally available: luban's sbatch names none
               "PERFCTRS": "network performance counters in use", "NPC": "network performance counters in use",
               "POWER_DOWN": "pending power down", "POWERING_DOWN": "powering down", "REBOOT_ISSUED": "rebooting"}
# ... and the suffixes that say one of them. Not among them: POWERED_DOWN (~, power saving: Slurm's
# ResumeProgram powers the node up "to complete work allocated to" it, slurm.schedmd.com/power_save.html),
# POWERING_UP (#), REBOOT_REQUESTED (@: rebooted once idle, jobs start meanwhile; reboot ASAP adds DRAIN),
# PLANNED (-), COMPLETING, CLOUD: Slurm allocates those nodes
NO_NEW_JOBS_SUFFIX = {"*": "not responding", "%": "powering down", "!": "pending power down",
                      "$": "in a maintenance reservation", "^": "rebooting"}
SUFFIXES = "*~#!%$@^-"  # every state suffix sinfo(1) lists
BUSY = {"ALLOCATED", "MIXED", "COMPLETING"}  # a drained node with one of these has jobs on it: draining
# what scontrol prints of a node after every field luban reads (src/api/node_info.c: Reason, then Comment,
# Extra, InstanceId, InstanceType, ReservationName): free text an admin or a health check wrote, which
# may hold "State=IDLE" or "NodeName=x" and is never read as the node's own fields (node_fields)
FREE_TEXT = re.compile(r"\s(?:Reason|Comment|Extra|InstanceId|InstanceType|ReservationName)=")
REASON = re.compile(r"(?:^|\s)Reason=(.*?)\s*(?=" + FREE_TEXT.pattern + "|$)")  # the whole Reason, "=" and all


def fields(line: str) -> dict[str, str]:
    """``Key=Value Key=Value`` (scontrol -o) into a dict; values may not contain spaces. scontrol
    prints each field once, the free text (a job's WorkDir, Command, Comment; a node's Reason) after
    the fields luban reads, so a key's first value is its own: a job's workdir "/x JobState=COMPLETED"
    is not its state."""
    out = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep:
            out.setdefault(key, value)
    return out


def node_fields(line: str) -> dict[str, str]:
    """``fields`` of a node's ``scontrol show node -o`` line, read before its free text (``FREE_TEXT``:
    a Reason "swapped State=IDLE" is not the node's State)."""
    return fields(FREE_TEXT.split(line, 1)[0])


def node_unavailable(state: str, reason: str = "") -> str | None:
    """Why Slurm allocates no new job on a node whose ``State`` is ``state`` (``scontrol show node``),
    in one line with Slurm's ``Reason`` (``slurm: drained (disk swap [root@...])``); None where it
    does (IDLE, MIXED, ALLOCATED, IDLE+POWERED_DOWN, no State at all). A flag luban does not know
    leaves the node usable: Slurm adds informational ones (CLOUD, DYNAMIC_NORM, ...)."""
    tokens = [token for token in state.upper().split("+") if token]
    names = [token.rstrip(SUFFIXES) for token in tokens]
    busy = bool(BUSY & set(names))
    words = []
    for token, name in zip(tokens, names):
        found = [("draining" if busy else "drained") if name == "DRAIN" else NO_NEW_JOBS.get(name)]
        found += [NO_NEW_JOBS_SUFFIX.get(mark) for mark in token[len(name):]]
        words += [word for word in found if word and word not in words]
    if not words:
        return None
    return f"slurm: {', '.join(words)}" + (f" ({escaped(' '.join(reason.split())[:200])})" if reason.strip() else "")


def node_reason(line: str) -> str:
    """The ``Reason`` of a node's ``scontrol show node -o`` line ("" where it has none): free text,
    spaces and "=" and all (``Reason=disk swap, ticket=42 [root@2026-12-02T01:03:36]``), up to the
    free text scontrol prints after it (``FREE_TEXT``), which ``fields`` cuts."""
    found = REASON.search(line)
    return found.group(1) if found and found.group(1) != "(null)" else ""


class NotInstalled(Unavailable):
    """A Slurm command is not on PATH. ``check`` refuses to start a service without them; one that
    goes missing later (an upgrade of slurm-wlm, a PATH or mount that changed) is an outage like a
    silent slurmctld: jobs keep their state, starts wait and are retried, nothing fails for it."""


class SlurmExecutor:
    def __init__(self, partition: str | None = None, state_dir: str = ".", python: str = sys.executable):
        self.partition, self.state_dir, self.python = partition, state_dir, python

    @staticmethod
    def check() -> None:
        """Before a service starts: every Slurm command it runs is on PATH (one line naming those that
        are not), so a missing client is said once at start-up, not met by the first job."""
        missing = [name for name in COMMANDS if shutil.which(name) is None]
        if missing:
            raise bad_value("--executor", "slurm", f"needs {', '.join(COMMANDS)} on PATH; not found: "
                                                   f"{', '.join(missing)} (install slurm-wlm's client, or use "
                                                   "--executor local)")

    def _run(self, *args: str, env: dict[str, str] | None = None) -> str:
        """A Slurm command's output; a failure is one line: ``Unavailable`` when the command timed
        out, could not reach slurmctld or is not installed (``NotInstalled``), RuntimeError else."""
        # the service's PATH finds the command, never the job's: ``env`` (sbatch's) is the job's, and a
        # job's own PATH (a conda env, env_only) must not decide where sbatch is, nor make it missing
        command = shutil.which(args[0])
        try:
            if command is None:
                raise FileNotFoundError(args[0])
            result = subprocess.run([command, *args[1:]], capture_output=True, text=True, timeout=TIMEOUT_S,
                                    env=env, errors="replace")
        except FileNotFoundError:
            raise NotInstalled(f"{args[0]} not found: install slurm-wlm (client) or use --executor local") from None
        except subprocess.TimeoutExpired:
            raise Unavailable(f"{args[0]} did not answer within {TIMEOUT_S}s (slurmctld slow or down?)") from None
        if result.returncode != 0:
            why = " ".join(result.stderr.split())[:300]
            message = f"{' '.join(args[:3])} failed ({result.returncode}): {why}"
            if any(marker in why.lower() for marker in UNREACHABLE):
                raise Unavailable(message)
            raise RuntimeError(message)
        return result.stdout

    def discover(self) -> list[NodeInfo]:
        nodes = []
        for line in self._run("scontrol", "show", "node", "-o").splitlines():
            f = node_fields(line)
            partitions = (f.get("Partitions") or "default").split(",")
            if "NodeName" not in f or (self.partition and self.partition not in partitions):
                continue
            features = [x for x in (f.get("AvailableFeatures") or "").split(",") if x and x != "(null)"]
            zone = next((x for x in features if x.startswith("zone")), "default")
            gpus = sum(int(g.split(":")[-1].split("(")[0]) for g in (f.get("Gres") or "").split(",")
                       if g.startswith("gpu") and g.split(":")[-1].split("(")[0].isdigit())
            nodes.append(NodeInfo(f["NodeName"], self.partition or partitions[0], gpus,
                                  {"zone": zone, "features": features}, f.get("NodeAddr") or f["NodeName"],
                                  unavailable=node_unavailable(f.get("State", ""), node_reason(line))))
        return nodes

    def start(self, launch: Launch) -> str:
        run_dir = Path(launch.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        env_file = launcher.write_env(run_dir, launch.env)  # complete: the scheduler built it (job_env)
        rank = [self.python, *launcher.LAUNCHER_PYTHON, "luban.cluster.launcher", "--run-dir", str(run_dir), "--log",
                launch.log_pattern, "--env-file", str(env_file), "--tag", launch.name, *(["--user", launch.run_as] if launch.run_as else []),
                *[a for d in launch.hide for a in ("--hide", d)],
                *(["--max-log", str(launch.max_log)] if launch.max_log else []),
                "--", *launch.command]
        script = run_dir / SCRIPT
        # what a copy of this try is: its nodes and its token (a hash); a retry adopts only its own copy
        token = hashlib.sha256(launch.env.get("LUBAN_CLUSTER_TOKEN", "").encode()).hexdigest()
        try_line = f"# luban try: nodes={','.join(launch.nodes)} token={token}"
        if script.exists():  # an earlier try of this attempt met an outage: it may have submitted a copy
            earlier = self._earlier_try(launch, run_dir, script, try_line)
            if earlier is not None:
                return earlier
        srun = shutil.which("srun") or "srun"  # where the service finds it (nodes install Slurm alike), not the job's PATH
        script.write_text("#!/bin/bash\n# luban job %d\n%s\nexec %s --kill-on-bad-exit=0 --ntasks-per-node=1 "
                          "--nodes=%d --ntasks=%d %s\n" % (launch.job_id, try_line, shlex.quote(srun), len(launch.nodes),
                                                          len(launch.nodes), shlex.join(rank)))
        args = ["sbatch", "--parsable", f"--job-name={launch.name}", f"--nodelist={','.join(launch.nodes)}",
                f"--nodes={len(launch.nodes)}", "--exclusive", "--no-requeue", "--export=ALL",
                f"--output={run_dir}/slurm-%j.out", f"--chdir={run_dir}"]
        if self.partition:
            args.append(f"--partition={self.partition}")
        # sbatch, the batch script and the launchers get nothing of the job's (they run as the service's
        # account, root where jobs run as per-user accounts: a job's BASH_ENV, LD_PRELOAD or workdir ran
        # there); the job's environment and workdir are its command's (launcher --env-file)
        env = launcher.launcher_env(**{k: v for k, v in os.environ.items() if k in SLURM_CLIENT_ENV})
        try:
            out = self._run(*args, str(script), env=env)
        except NotInstalled:
            raise  # nothing was submitted: the start waits for sbatch (an outage), nothing to cancel
        except RuntimeError:  # a timeout may still have submitted it: whether the attempt fails (an error)
            if self._cancel_by_name(launch.name):  # or waits (Unavailable), nothing of this try may run
                (run_dir / CANCELLED).touch()  # its retry waits for what it may have started to end
            raise
        slurm_id = out.strip().split(";")[0]
        if not slurm_id.isdigit():  # not --parsable's "ID[;cluster]": a job we could not follow must not run
            self._cancel_by_name(launch.name)
            raise RuntimeError(f"sbatch printed {out.strip()[:100]!r}, not a job id")
        return json.dumps({"slurm_id": slurm_id, "run_dir": str(run_dir), "ranks": len(launch.nodes),
                           "tag": launch.name})

    def _earlier_try(self, launch: Launch, run_dir: Path, script: Path, try_line: str) -> str | None:
        """Before starting an attempt again after an outage, what its earlier try left: a copy its
        timed-out sbatch submitted and nothing cancelled is this attempt — adopted (its handle), live
        or ended (all exit files); a copy still listed otherwise (cancelled, ending) is waited for
        (``StartDeferred``: this attempt alone waits); else its exit and pgid files are
        removed and None says: submit. A live copy made for other nodes or with another token (the
        retry was placed elsewhere, or the service restarted and gave the attempt a new token) is
        not this try: it is cancelled and waited for (``StartDeferred``)."""
        cancelled = (run_dir / CANCELLED).exists()
        listed = self._listed(launch.name, "%i %T")
        handle = {"run_dir": str(run_dir), "ranks": len(launch.nodes), "tag": launch.name}
        earlier = [line for line in script.read_text(errors="replace").splitlines() if line.startswith("# luban try:")]
        if listed and not cancelled and earlier and earlier[0] != try_line:
            if self._cancel_by_name(launch.name):
                (run_dir / CANCELLED).touch()
            raise StartDeferred(f"an earlier try of {launch.name} (other nodes or token) is being cancelled")
        if listed:
            if not cancelled and listed[1:2] and listed[1] in RUNNING - {"COMPLETING", "SIGNALING", "STAGE_OUT"}:
                return json.dumps({"slurm_id": listed[0], **handle})
            raise StartDeferred(f"an earlier try of {launch.name} is still ending in Slurm")
        exits = [launcher.exit_file(run_dir, rank) for rank in range(len(launch.nodes))]
        if not cancelled and all(path.exists() for path in exits):
            return json.dumps({"slurm_id": "", **handle})  # it ran to its end meanwhile
        for rank, path in enumerate(exits):
            path.unlink(missing_ok=True)
            launcher.pgid_file(run_dir, rank).unlink(missing_ok=True)
        (run_dir / CANCELLED).unlink(missing_ok=True)
        return None

    def cancel_tries(self, launch: Launch) -> None:
        """Cancel what earlier tries of this attempt submitted (``scancel --name``: a copy a timed-out
        ``sbatch`` submitted after all, which nothing could cancel then), for a queued attempt that is
        not starting now (held, or no longer admitted): nothing of it may run in Slurm meanwhile. Its
        next start waits for the copy to leave Slurm and adopts nothing of it (``CANCELLED``). Nothing
        to do where no try wrote a batch script; ``Unavailable`` while slurmctld cannot be reached."""
        run_dir = Path(launch.run_dir)
        if not (run_dir / SCRIPT).exists():
            return
        self._run("scancel", f"--name={launch.name}")
        (run_dir / CANCELLED).touch()

    def _listed(self, name: str, fields: str = "%i") -> list[str]:
        """``squeue -n NAME``: the fields of the Slurm jobs of that name (an attempt's tag), in order."""
        return self._run("squeue", "-h", "-n", name, "-o", fields).split()

    def _cancel_by_name(self, name: str) -> bool:
        """``scancel --name``: True when Slurm took it (nothing of the name will run)."""
        try:
            self._run("scancel", f"--name={name}")
            return True
        except RuntimeError:
            return False  # slurmctld unreachable: the retry (_earlier_try) or find() after a restart decides

    def poll(self, handle: str) -> Status:
        """The attempt's state: ``scontrol show job``, and the launchers' exit files once Slurm has
        ended it (or forgotten it). What cannot be asked or read leaves the job as it was
        (``done=False``) and says why in one line: ``unavailable`` while slurmctld cannot be reached
        or ``scontrol`` is missing, ``problem`` for output without a known ``JobState``. An ended job
        whose launchers wrote no exit files and whose ``ExitCode`` cannot be read ends as lost, the
        ``problem`` saying what was printed."""
        info = json.loads(handle)
        run_dir = Path(info["run_dir"])
        files = [launcher.exit_file(run_dir, r) for r in range(info["ranks"])]
        unavailable = problem = None
        try:
            out = self._run("scontrol", "show", "job", "-o", info["slurm_id"]) if info["slurm_id"] else ""
            f = fields(out) if out else {}
            if info["slurm_id"] and not f.get("JobState"):
                problem = f"scontrol show job {info['slurm_id']} printed no JobState ({' '.join(out.split())[:100]!r})"
        except Unavailable as err:  # slurmctld down, slow or unreachable, scontrol missing: the job is as
            unavailable, f = str(err), {}  # it was, not lost (declaring it lost ended it while Slurm ran it on)
        except RuntimeError as err:
            if FORGOTTEN not in str(err):  # scontrol failing otherwise: cannot tell
                problem = str(err)
            f = {}  # forgotten by slurmctld (MinJobAge): fall back to the launchers' exit files
        state = f.get("JobState", "")
        if state in RUNNING:
            held = f.get("Reason") if state == "PENDING" and f.get("Reason") in HELD else None
            return Status(done=False, started=state not in ("PENDING", "CONFIGURING"), held=held,
                          held_by_admin=HELD.get(held) == "admin")
        if all(p.exists() for p in files):
            return Status(done=True, exit_code=combine([int(p.read_text()) for p in files]),
                          ended_at=launcher.ended_at(run_dir, len(files)), unavailable=unavailable)
        if unavailable or problem:
            return Status(done=False, unavailable=unavailable, problem=problem)
        if state and state not in ENDED:  # a state this code does not know: it may still run
            return Status(done=False, problem=f"Slurm job {info['slurm_id']} is in JobState={state[:40]!r}, "
                                              "which luban does not know")
        for rank in range(info["ranks"] if info.get("tag") else 0):  # launchers died without exit files:
            procs.kill_job(launcher.node_tag(info["tag"], rank))  # sweep here (elsewhere: proctrack/cgroup)
        if not state:
            return Status(done=True, lost=True)
        exit_code = f.get("ExitCode", "0:0")
        parsed = re.fullmatch(r"(\d{1,3}):(\d{1,3})", exit_code)
        if parsed is None:
            return Status(done=True, lost=True, problem=f"Slurm job {info['slurm_id']} ended ({state}) with an "
                                                        f"unreadable ExitCode={exit_code[:40]!r}")
        code, sig = int(parsed.group(1)), int(parsed.group(2))
        code = code or (128 + sig if sig else (0 if state == "COMPLETED" else 1))
        return Status(done=True, exit_code=code)

    def lingering(self, launch: Launch) -> bool:
        """``squeue -n``: a copy of the attempt (its tag) is still listed."""
        return bool(self._listed(launch.name))

    def began(self, handle: str) -> float | None:
        """The oldest of the launchers' pgid files' times (each written when its rank started the job)."""
        info = json.loads(handle)
        return launcher.started_at(Path(info["run_dir"]), info["ranks"])

    def find(self, launch: Launch) -> str | None:
        """squeue is the truth: a Slurm job named after the launch (its tag) is adopted; one that
        already ended is read back from its launchers' exit files."""
        ids = self._listed(launch.name)
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
