"""Refusals before any work, a hostile review of 2026-12-04: each of these was refused only after
work and writes — ``luban train --resume /typo`` made run.dir first; ``luban demo --set
parallel.tp=3`` trained its whole first half (a checkpoint written) before its second layout was
refused; ``luban demo --nnodes 2`` without ``--master-port`` ran the planner (55 s on a cold
machine) and wrote plan.json. Each is now one line, exit 2, in a second or two, nothing made."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_toml
from tests.train.conftest import luban


@pytest.mark.parametrize("command, message", [
    (["train", "c.toml", "--resume", "/nonexistent"], "--resume = '/nonexistent': no such checkpoint directory"),
    (["demo", "--set", "parallel.tp=3"], "(in the demo's second half, pp 2 x dp 2 on 4 ranks: leave the layout"),
    (["demo", "--nnodes", "2"], "--master-port = 0: a port from 1 to 65535, the same on every node"),
    (["train", "c.toml", "--nproc", "2", "--nnodes", "2", "--parallel", "auto"], "--master-port = 0: "),
])
def test_refused_before_anything_is_made(tmp_path, command, message):
    (tmp_path / "c.toml").write_text(tiny_toml(tmp_path / "run", {"steps": 2, "global_batch": 2, "eval_every": 0}))
    env_cache = {"LUBAN_CACHE": str(tmp_path / "cache")}
    import os

    proc = luban(*command, cwd=tmp_path, timeout=120, env={**os.environ, **env_cache})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["c.toml"]


def test_a_folder_named_in_bytes_that_are_not_utf8_is_named_so(tmp_path):
    """(2026-12-04) ``luban sample $'x\\xffrun'`` on an existing folder said "an existing folder"."""
    import os
    import subprocess
    import sys

    folder = os.fsencode(tmp_path) + b"/x\xffrun"
    os.mkdir(folder)
    proc = subprocess.run([sys.executable, "-m", "luban", "sample", folder], capture_output=True, timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.count("\n") == 1, err
    assert "an existing folder, named in UTF-8: this name holds bytes that are not UTF-8 text" in err, err


def test_run_system_is_checked_without_parallel_auto(tmp_path):
    """(2026-12-04) ``run.system = "nope"`` passed unless ``--parallel auto`` read it."""
    (tmp_path / "c.toml").write_text(tiny_toml(tmp_path / "run", {"steps": 2, "global_batch": 2, "eval_every": 0},
                                               run_keys={"system": "nope"}))
    proc = luban("train", "c.toml", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("luban: error: run.system = 'nope'"), proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]
