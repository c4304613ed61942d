"""Real processes, real signals, real pipes: helpers for the Ctrl-C and closed-stdout tests.

``start`` runs the real entry point (``python -m luban``, as the console script does) in its own
process group, as a shell runs a foreground job; ``ctrl_c`` sends SIGINT to that whole group, as
a terminal's Ctrl-C does (worker processes get it too), and returns the exit code, stderr and the
seconds the process took to end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

LUBAN = [sys.executable, "-m", "luban"]
ROOT = Path(__file__).resolve().parents[1]
# CI boxes here are shared and loaded (2 cores, several suites at once): the promise is one
# second; the tests allow this much for the scheduler to run the process at all
EXIT_BOUND_S = float(os.environ.get("LUBAN_TEST_EXIT_BOUND_S", "3.0"))


def env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


class Proc:
    """A running ``luban`` command; stderr (and optionally stdout) read while it runs."""

    def __init__(self, args, cwd=None, stdout=subprocess.PIPE, extra_env=None):
        self.proc = subprocess.Popen([*LUBAN, *map(str, args)], cwd=cwd, stdout=stdout, stderr=subprocess.PIPE,
                                     env=env(**(extra_env or {})), start_new_session=True)
        self.err: list[bytes] = []
        self.out: list[bytes] = []
        self.threads = [threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True)]
        if self.proc.stdout is not None:
            self.threads.append(threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True))
        for t in self.threads:
            t.start()

    @staticmethod
    def _read(stream, into):
        for line in iter(stream.readline, b""):
            into.append(line)

    def wait_for(self, predicate, timeout=120.0, what="condition"):
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode} before {what}: {self.stderr()}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"timed out waiting for {what}: {self.stderr()}")
            time.sleep(0.05)

    def ctrl_c(self, timeout=60.0) -> tuple[int, str, float]:
        sent = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running {timeout}s after Ctrl-C: {self.stderr()}") from None
        took = time.monotonic() - sent
        for t in self.threads:
            t.join(10)
        return code, self.stderr(), took

    def stderr(self) -> str:
        return b"".join(self.err).decode(errors="replace")

    def stdout(self) -> str:
        return b"".join(self.out).decode(errors="replace")

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def descendants(pid: int) -> list[int]:
    """Live processes whose parent chain leads to ``pid`` (from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


def group_alive(pgid: int) -> list[int]:
    """Processes still in process group ``pgid`` (zombies excluded)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == pgid and fields[0] != "Z":
                    alive.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                pass
    return alive


def assert_interrupted(code: int, err: str, took: float) -> None:
    """One line at most, exit 130, within the bound, no traceback."""
    assert code == 130, (code, err)
    assert "Traceback" not in err and err.count("\n") <= 1, err
    assert err in ("", "luban: interrupted\n"), err
    assert took < EXIT_BOUND_S, f"took {took:.2f}s to exit after Ctrl-C"


def closed_pipe_run(args, cwd=None, extra_env=None, timeout=180) -> subprocess.CompletedProcess:
    """Run with stdout a pipe whose reader is already gone: every write fails (EPIPE)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([*LUBAN, *map(str, args)], cwd=cwd, stdout=write, stderr=subprocess.PIPE,
                              env=env(**(extra_env or {})), timeout=timeout)
    finally:
        os.close(write)


def assert_quiet_pipe(proc: subprocess.CompletedProcess) -> None:
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode in (0, 141), (proc.returncode, err)
    assert err == "", err
