"""The embedded default executor: each rank is a launcher process group on this machine.

``nodes`` virtual nodes (``node1``..) can be declared so one machine acts as a small cluster;
zones are assigned in contiguous blocks. Handles are JSON (launcher pids + run dir) and the
launcher writes exit files, so a restarted service picks its jobs up again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from luban import procs
from luban.cluster import launcher
from luban.cluster.executors import Launch, NodeInfo, Status, combine


_alive = procs.alive


def _is_launcher(pid: int, tag: str | None) -> bool:
    """``pid`` is still the launcher of the job tagged ``tag``: alive, and its command line names the
    tag. A handle's pid outlives its launcher (a restart may come long after the launcher died):
    a pid the system gave to another process since is neither the job running nor ours to signal."""
    if not _alive(pid):
        return False
    if tag is None:  # a handle written before handles carried the tag
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if not cmdline:  # a launcher just started is still in exec (its command line not set yet): cannot tell
        return True
    argv = cmdline.decode(errors="replace").split("\0")
    return "luban.cluster.launcher" in argv and "--tag" in argv and argv[argv.index("--tag") + 1] == tag


class LocalExecutor:
    runs_here = True  # jobs run on the service's machine: it can check their command up front (jobcheck)

    def __init__(self, nodes: int = 1, gpus: int = 0, zones: int = 1, node_group: str = "default",
                 prefix: str = "node"):
        self.nodes, self.gpus, self.zones, self.node_group, self.prefix = nodes, gpus, zones, node_group, prefix
        self.children: dict[int, subprocess.Popen] = {}

    def check(self) -> None:
        """Nothing to check: its launchers are this Python's."""

    def lingering(self, launch: Launch) -> bool:
        """A local start is never deferred."""
        return False

    def began(self, handle: str) -> float | None:
        """A local start never adopts an earlier try's copy (nothing asks)."""
        return None

    def cancel_tries(self, launch: Launch) -> None:
        """A local start never meets an outage: no earlier try of it is left anywhere."""

    def discover(self) -> list[NodeInfo]:
        return [NodeInfo(f"{self.prefix}{i + 1}", self.node_group, self.gpus,
                         {"zone": f"zone{i * self.zones // self.nodes + 1}"})
                for i in range(self.nodes)]

    def start(self, launch: Launch) -> str:
        pids = []
        Path(launch.run_dir).mkdir(parents=True, exist_ok=True)
        env_file = launcher.write_env(Path(launch.run_dir), launch.env)  # complete: the scheduler built it (job_env)
        for rank, node in enumerate(launch.nodes):
            argv = ["--run-dir", launch.run_dir, "--log", launch.log_pattern, "--rank", str(rank),
                    "--env-file", str(env_file),
                    "--tag", launch.name, *(["--user", launch.run_as] if launch.run_as else []),
                    *[a for d in launch.hide for a in ("--hide", d)],
                    *(["--max-log", str(launch.max_log)] if launch.max_log else []), "--", *launch.command]
            try:  # the launcher in /, with nothing of the job's (its workdir and environment are CMD's)
                proc = launcher.spawn(argv, env=launcher.launcher_env(LUBAN_NODE=node), start_new_session=True, cwd="/",
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            except BaseException:
                # the attempt fails (the scheduler ends it): the ranks already started must not run on
                # without it (a fork refused at the process limit, E2BIG, an interrupt)
                self._stop_started(json.dumps({"pids": pids, "run_dir": launch.run_dir, "tag": launch.name}))
                raise
            self.children[proc.pid] = proc
            pids.append(proc.pid)
        return json.dumps({"pids": pids, "run_dir": launch.run_dir, "tag": launch.name})

    def _stop_started(self, handle: str, timeout: float = 30.0) -> None:
        """Kill the launchers of a start that failed part way and wait (bounded) until they are gone."""
        self.kill(handle)
        deadline = time.monotonic() + timeout
        for _, pid, _ in self._ranks(handle):
            proc = self.children.pop(pid, None)
            if proc is not None:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)

    def find(self, launch: Launch) -> str | None:
        """Launchers are found by ``--tag <name>`` in their command line, ranks that already ended
        by their exit files; a launch with a rank that never started is killed and forgotten."""
        run_dir, pids = Path(launch.run_dir), {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if "luban.cluster.launcher" in argv and launch.name in argv and "--rank" in argv:
                if argv[argv.index("--tag") + 1] == launch.name and _alive(int(entry.name)):
                    pids[int(argv[argv.index("--rank") + 1])] = int(entry.name)
        ranks = range(len(launch.nodes))
        handle = json.dumps({"pids": [pids.get(r, -1) for r in ranks], "run_dir": launch.run_dir,
                             "tag": launch.name})
        if all(r in pids or launcher.exit_file(run_dir, r).exists() for r in ranks):
            return handle
        self.kill(handle)  # a partial start: one copy at most, and this one is incomplete
        return None

    def _ranks(self, handle: str):
        info = json.loads(handle)
        return [(rank, pid, Path(info["run_dir"])) for rank, pid in enumerate(info["pids"])]

    def _live(self, handle: str, pid: int) -> bool:
        return _is_launcher(pid, json.loads(handle).get("tag"))

    def poll(self, handle: str) -> Status:
        codes, running = [], False
        for rank, pid, run_dir in self._ranks(handle):
            if pid in self.children and self.children[pid].poll() is not None:
                self.children.pop(pid)  # reap; the exit file has the code
            path = launcher.exit_file(run_dir, rank)
            if path.exists():
                codes.append(int(path.read_text()))
            elif self._live(handle, pid):
                running = True
            elif path.exists():  # it wrote its exit file and ended between the two looks above (a job
                # that succeeded was failed as "lost" under load: tests/cluster/test_quota_concurrency.py)
                codes.append(int(path.read_text()))
            else:  # the launcher died without a word (kill -9): nothing of its job may run on
                self._sweep(handle)
                return Status(done=True, exit_code=None, lost=True)
        if running and any(c not in (0, 75) for c in codes):
            self.kill(handle)  # one rank failed: the others cannot finish
        if running:
            return Status(done=False)
        return Status(done=True, exit_code=combine(codes), ended_at=launcher.ended_at(run_dir, len(codes)))

    def suspend(self, handle: str) -> None:
        for _, pid, _ in self._ranks(handle):
            if not self._live(handle, pid):
                continue  # gone (poll ends it), or its pid now another process's
            try:
                os.killpg(pid, signal.SIGUSR1)  # the launcher forwards it to the job's group
            except ProcessLookupError:
                pass

    def kill(self, handle: str) -> None:
        """SIGTERM to each launcher: it kills every process of its node's part of the job (cgroup,
        process group, tag) and writes its exit file once none is left; the part of a launcher
        that is already gone is swept from here."""
        for rank, pid, _ in self._ranks(handle):
            if self._live(handle, pid):
                try:
                    os.kill(pid, signal.SIGTERM)
                    continue
                except ProcessLookupError:
                    pass
            self._sweep(handle, rank)

    def _sweep(self, handle: str, rank: int | None = None) -> list[int]:
        """Kill what is left of the job's processes on node ``rank`` (all nodes: None)."""
        tag, left = json.loads(handle).get("tag"), []
        for r, _, run_dir in self._ranks(handle):
            if tag and rank in (None, r):
                path = launcher.pgid_file(run_dir, r)
                left += procs.kill_job(launcher.node_tag(tag, r), (int(path.read_text()),) if path.exists() else ())
        return left
