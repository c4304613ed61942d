"""Child processes for tests: output to a file, never to a pipe nobody reads; every wait bounded.

A child started with ``stdout=PIPE`` blocks as soon as it has written a pipe's worth (64 KiB)
that the test has not read, so a test that waits for it before reading hangs (CI did: a
2,368-step reference run behind an unread pipe). ``Child`` writes the child's output (stdout and
stderr) to a file instead, which the test can read at any moment; every wait takes a bound and,
past it, kills the child's process group and fails with the child's command and the tail of its
output. Use it as a context manager so that a failing test leaves nothing running.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TAIL = 3000  # characters of output a failure shows


class Child:
    def __init__(self, args, log: Path | None = None, env: dict | None = None, **popen):
        self.args = [str(a) for a in args]
        if log is None:
            fd, name = tempfile.mkstemp(prefix="child-", suffix=".log")
            os.close(fd)
            log = Path(name)
        self.log = Path(log)
        self._file = open(self.log, "ab")
        env = dict(os.environ if env is None else env)
        env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the file as they are printed
        popen.setdefault("start_new_session", True)  # its own process group: killed whole on failure
        self._group = bool(popen["start_new_session"])
        self.proc = subprocess.Popen(self.args, stdout=self._file, stderr=subprocess.STDOUT, env=env, **popen)

    # -- reading ------------------------------------------------------------------------------
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, n: int = TAIL) -> str:
        return self.output()[-n:]

    def _fail(self, why: str):
        self.kill()
        raise AssertionError(f"{' '.join(self.args)}: {why}\n--- output (tail) ---\n{self.tail()}")

    # -- waiting ------------------------------------------------------------------------------
    def wait(self, timeout: float) -> int:
        """The exit code; past ``timeout`` seconds the child is killed and the test fails."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._fail(f"still running after {timeout} s")

    def finish(self, timeout: float, expect: int | None = 0) -> str:
        """Wait (bounded) and return the output; with ``expect``, fail unless the exit code is that."""
        code = self.wait(timeout)
        if expect is not None and code != expect:
            raise AssertionError(f"{' '.join(self.args)}: exit {code}, expected {expect}\n"
                                 f"--- output (tail) ---\n{self.tail()}")
        return self.output()

    def wait_for(self, pattern: str, timeout: float, every: float = 0.05) -> re.Match:
        """The first match of the regex ``pattern`` (multiline) in the output; fails if the child
        exits without printing it or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern, re.MULTILINE)
        while True:
            exited = self.proc.poll() is not None  # read after: a line printed before exiting is seen
            match = regex.search(self.output())
            if match:
                return match
            if exited:
                self._fail(f"exited with {self.proc.returncode} before printing /{pattern}/")
            if time.monotonic() > deadline:
                self._fail(f"no /{pattern}/ within {timeout} s")
            time.sleep(every)

    # -- control ------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def send_signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL to the child's process group (what is left of it, after the child exited), or
        to the child alone if it was started in ours."""
        try:
            if self._group:
                os.killpg(self.proc.pid, signal.SIGKILL)
            elif self.proc.poll() is None:
                self.proc.kill()
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:  # unkillable (D state): do not hang the test on it
            pass

    def __enter__(self) -> "Child":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
        self._file.close()


def run(args, timeout: float, log: Path | None = None, expect: int | None = 0, **kw) -> str:
    """Run to completion (bounded), output via a file; returns the output."""
    with Child(args, log=log, **kw) as child:
        return child.finish(timeout, expect)


def wait_or_fail(proc: subprocess.Popen, timeout: float, output=lambda: "") -> int:
    """``proc.wait`` bounded for a process a test started some other way (e.g. ``launcher.spawn``):
    past ``timeout`` it is killed (its group too, if it leads one) and the test fails with
    ``output()`` (e.g. the tail of the log it writes)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            if proc.pid == os.getpgid(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        raise AssertionError(f"{proc.args}: still running after {timeout} s\n--- output (tail) ---\n"
                             f"{str(output())[-TAIL:]}") from None


def read_lines(proc: subprocess.Popen, n: int, timeout: float, output=lambda: "") -> list[bytes]:
    """The first ``n`` lines of ``proc.stdout`` (a pipe), read in a thread with a bound: a child that
    hangs without printing fails the test after ``timeout`` s (killed, with ``output()``) instead of
    blocking ``readline`` until pytest's own timeout. Fewer lines come back if the pipe ends first."""
    lines: list[bytes] = []

    def reader():
        while len(lines) < n:
            line = proc.stdout.readline()
            if not line:
                return
            lines.append(line)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        wait_or_fail(proc, 0, lambda: f"{len(lines)} of {n} lines read within {timeout} s: {lines!r}\n{output()}")
    return lines


def launch(argv, nproc: int, module: str, timeout: float = 840, log: Path | None = None) -> tuple[int, str]:
    """``luban.parallel.launch`` of ``python -m <module> <argv>`` on ``nproc`` ranks, in a child
    process with a bound (a hung collective fails the test with the ranks' output instead of
    hanging it until pytest's 900 s timeout); returns (the launch's exit code, the ranks' output)."""
    code = ("import sys; from luban.parallel.launch import launch; "
            f"sys.exit(launch({[str(a) for a in argv]!r}, nproc={nproc}, module={module!r}))")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    with Child([sys.executable, "-c", code], log=log, env=env) as child:
        rc = child.wait(timeout)
        return rc, child.output()
