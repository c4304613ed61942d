"""Ctrl-C and closed pipes on real processes (issue 24): a probe and a BPE data build stop within
a second and leave nothing behind, a closed stdout ends a command quietly, and a sweep over the
sub-commands that run long enough to be interrupted. The platform's commands (logs -f, stop,
jobs, serve) are in tests/cluster/test_interrupts.py; ``luban train`` keeps its own protocol
(SIGINT: checkpoint, exit 75; tests/train/test_signals.py)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.interrupt_helpers import (LUBAN, Proc, assert_interrupted, assert_quiet_pipe, closed_pipe_run,
                                     descendants, env, group_alive)

PLAN = ["plan", "estimate", "--model", "gpt2-124m", "--system", "dgx-a100-80g", "--gpus", "8", "--global-batch", "8"]


def _settled(pgid: int, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := group_alive(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def test_ctrl_c_on_probe_stops_its_workers_and_writes_nothing(tmp_path):
    out = tmp_path / "profile.toml"
    probe = Proc(["plan", "probe", "--out", out])
    probe.wait_for(lambda: descendants(probe.proc.pid), 300, "the probe's worker processes")
    time.sleep(1.0)  # the workers are importing torch or measuring
    assert_interrupted(*probe.ctrl_c())
    assert not _settled(probe.proc.pid), "worker processes outlived the probe"
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_on_a_bpe_build_inside_the_tokenizer_keeps_the_old_dataset(tmp_path):
    """Interrupted while Rust encodes a batch (seconds without returning to Python): the stage is
    removed and the previous dataset is untouched."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("old dataset\n" * 100)
    ds = tmp_path / "ds"
    subprocess.run([*LUBAN, "data", "build", "--out", ds, docs], env=env(), check=True, capture_output=True,
                   timeout=300)
    before = {p.name: p.read_bytes() for p in ds.iterdir()}
    build = Proc(["data", "build", "--tokenizer", "bpe", "--max-bytes", "30000000", "--out", ds])
    stage = lambda: [p for p in tmp_path.iterdir() if p.name.startswith(".ds.building-")]  # noqa: E731
    build.wait_for(lambda: any((s / "tokenizer.json").exists() for s in stage()), 300,
                   "the BPE tokenizer trained, encoding begun")
    assert_interrupted(*build.ctrl_c())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "ds"]
    assert {p.name: p.read_bytes() for p in ds.iterdir()} == before


def test_closed_stdout_is_quiet(small_dataset, tmp_path):
    """Every write into a pipe whose reader is gone: exit 141 (or 0), nothing on stderr."""
    for args in (["data", "info", small_dataset], ["data", "info", small_dataset, "--json"],
                 ["data", "verify", small_dataset], PLAN, ["--help"]):
        assert_quiet_pipe(closed_pipe_run(args))
    shell = subprocess.run(["sh", "-c", " ".join(LUBAN) + f" data info {small_dataset} | head -2"],
                           capture_output=True, text=True, env=env(), timeout=120)
    assert shell.returncode == 0 and shell.stderr == "" and len(shell.stdout.splitlines()) == 2, shell


@pytest.fixture
def silent_server():
    """A port that accepts connections and never answers: a client waits on it."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


# sub-commands that can be interrupted mid-run; WHEN: seconds after start, or "output". Each long one is
# sized to run several times WHEN on a quiet 2-core VM (2026-11-26: plan validate 5.5 s, plan search 7.1 s,
# cluster simulate 34 s, cluster trace 24 s, data build 6.1 s), so the sweep interrupts it rather than
# skipping it; before, search (0.4 s) and the byte-level build (0.3 s) finished first, and trace asked for
# 2,000,000 jobs, over its limit, and exited 2 at once
SWEEP = {
    "plan validate": (["plan", "validate"], 1.0),
    "plan search": (["plan", "search", "--model", "deepseek-v3", "--system", "dgx-h100", "--gpus", "16384",
                     "--global-batch", "16384"], 0.5),
    "plan estimate": (PLAN, 0.0),
    "cluster simulate": (["cluster", "simulate", "--jobs", "100000"], 1.0),
    "cluster trace": (["cluster", "trace", "--jobs", "1000000", "-o", "{tmp}/t.jsonl"], 1.0),
    "data build": (["data", "build", "--tokenizer", "bpe", "--max-bytes", "30000000", "--out", "{tmp}/ds"], 1.0),
    "data verify": (["data", "verify", "{dataset}"], 0.0),
    "jobs": (["jobs"], 1.0),
    "logs": (["logs", "1"], 1.0),
    "submit": (["submit", "--", "true"], 1.0),
    "admin user list": (["admin", "user", "list"], 1.0),
}


@pytest.mark.parametrize("name", list(SWEEP))
def test_ctrl_c_sweep(name, tmp_path, small_dataset, silent_server):
    """Interrupted while running (start-up, computing, or waiting on a server that never answers):
    one line at most, exit 130, quickly, no traceback and no file left in the working folder but
    what existed. A command that had already finished keeps its own exit code and output."""
    args, when = SWEEP[name]
    args = [a.format(tmp=tmp_path, dataset=small_dataset) if isinstance(a, str) else a for a in args]
    proc = Proc(args, cwd=tmp_path, extra_env={"LUBAN_CLUSTER_URL": silent_server, "LUBAN_CLUSTER_TOKEN": "x"})
    # from the moment luban answers Ctrl-C: its watchdog thread runs (before that the interpreter is
    # still starting: site, encodings; nothing of luban's can answer there)
    proc.wait_for(lambda: len(list(Path(f"/proc/{proc.proc.pid}/task").iterdir())) > 1, 300, "luban's start")
    if when == "output":
        proc.wait_for(lambda: proc.out, 300, "the first line of output")
    else:
        time.sleep(when)
    if proc.proc.poll() is not None:
        pytest.skip(f"{name} finished in under {when} s here (exit {proc.proc.returncode})")
    code, err, took = proc.ctrl_c()
    if code == 0 and err == "":  # it had decided its exit code as the signal came: that code stands
        pytest.skip(f"{name} finished as Ctrl-C came")
    assert_interrupted(code, err, took)
    assert not _settled(proc.proc.pid)
    assert list(tmp_path.iterdir()) == []
