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
import sys
from pathlib import Path

from luban.cluster import launcher
from luban.cluster.executors import Launch, NodeInfo, Status, combine


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class LocalExecutor:
    def __init__(self, nodes: int = 1, gpus: int = 0, zones: int = 1, node_group: str = "default",
                 prefix: str = "node"):
        self.nodes, self.gpus, self.zones, self.node_group, self.prefix = nodes, gpus, zones, node_group, prefix
        self.children: dict[int, subprocess.Popen] = {}

    def discover(self) -> list[NodeInfo]:
        return [NodeInfo(f"{self.prefix}{i + 1}", self.node_group, self.gpus,
                         {"zone": f"zone{i * self.zones // self.nodes + 1}"})
                for i in range(self.nodes)]

    def start(self, launch: Launch) -> str:
        pids = []
        for rank, node in enumerate(launch.nodes):
            cmd = [sys.executable, "-m", "luban.cluster.launcher", "--run-dir", launch.run_dir,
                   "--log", launch.log_pattern, "--rank", str(rank), "--", *launch.command]
            env = dict(os.environ, **launch.env, LUBAN_NODE=node)
            proc = subprocess.Popen(cmd, env=env, start_new_session=True, cwd=launch.workdir or None,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.children[proc.pid] = proc
            pids.append(proc.pid)
        return json.dumps({"pids": pids, "run_dir": launch.run_dir})

    def _ranks(self, handle: str):
        info = json.loads(handle)
        return [(rank, pid, Path(info["run_dir"])) for rank, pid in enumerate(info["pids"])]

    def poll(self, handle: str) -> Status:
        codes, running = [], False
        for rank, pid, run_dir in self._ranks(handle):
            if pid in self.children and self.children[pid].poll() is not None:
                self.children.pop(pid)  # reap; the exit file has the code
            path = launcher.exit_file(run_dir, rank)
            if path.exists():
                codes.append(int(path.read_text()))
            elif _alive(pid):
                running = True
            else:
                return Status(done=True, exit_code=None, lost=True)
        if running and any(c not in (0, 75) for c in codes):
            self.kill(handle)  # one rank failed: the others cannot finish
        return Status(done=not running, exit_code=None if running else combine(codes))

    def suspend(self, handle: str) -> None:
        for _, pid, _ in self._ranks(handle):
            try:
                os.killpg(pid, signal.SIGUSR1)  # the launcher forwards it to the job's group
            except ProcessLookupError:
                pass

    def kill(self, handle: str) -> None:
        for rank, pid, run_dir in self._ranks(handle):
            path = launcher.pgid_file(run_dir, rank)
            for group in ([int(path.read_text())] if path.exists() else []) + [pid]:
                try:
                    os.killpg(group, signal.SIGKILL if group != pid else signal.SIGTERM)
                except ProcessLookupError:
                    pass
