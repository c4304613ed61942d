"""Data builds are transactions and manifests are checked (issue: nothing lost, no tracebacks)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from luban.data.build import build_dataset
from luban.data.manifest import load_manifest, write_manifest

ROOT = Path(__file__).resolve().parents[2]


def luban_data(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "luban", "data", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("args,message", [
    (["--tokenizer", "bpe", "--vocab-size", "10"], "--vocab-size = 10: an integer from 258"),
    (["--shard-size-mb", "nan"], "--shard-size-mb = nan"),
    (["--val-fraction", "inf"], "--val-fraction = inf"),
])
def test_bad_arguments_change_nothing(tmp_path, write_docs, args, message):
    text = write_docs(tmp_path / "text", n_docs=6)
    build_dataset([text], tmp_path / "keep")
    before = snapshot(tmp_path / "keep")
    out = luban_data("build", text, "--out", tmp_path / "keep", *args)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert snapshot(tmp_path / "keep") == before


def test_foreign_folders_are_refused_untouched(tmp_path, write_docs):
    text = write_docs(tmp_path / "text", n_docs=4)
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("mine")
    before = snapshot(home)
    out = luban_data("build", text, "--out", home)
    assert out.returncode == 2 and "'thesis.tex', which luban did not write" in out.stderr
    assert snapshot(home) == before
    out = luban_data("build", text, "--out", "", cwd=home)
    assert out.returncode == 2 and "--out = ''" in out.stderr and snapshot(home) == before
    (tmp_path / "afile").write_text("x")
    assert luban_data("build", text, "--out", tmp_path / "afile").returncode == 2


def test_kill_at_any_moment_of_a_rebuild_leaves_old_or_new(tmp_path, write_docs):
    text = write_docs(tmp_path / "text", n_docs=60, words=400)
    out = tmp_path / "ds"
    old = build_dataset([text], out, tokenizer="bpe", vocab_size=300, seed=1)
    rng = random.Random(0)
    outcomes = set()
    for attempt in range(5):
        proc = subprocess.Popen([sys.executable, "-m", "luban", "data", "build", str(text), "--out", str(out),
                                 "--tokenizer", "bpe", "--vocab-size", "300", "--seed", str(2 + attempt)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 3.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
        manifest = load_manifest(out)  # always a complete dataset at the path...
        assert luban_data("verify", out).returncode == 0  # ...that verifies
        outcomes.add("old" if manifest == old else "new")
        old = manifest
    assert build_dataset([text], out, seed=9)["seed"] == 9  # and the next build cleans up and works
    assert not list(tmp_path.glob(".ds.*"))


def _tamper(dataset: Path, change) -> None:
    manifest = json.loads((dataset / "manifest.json").read_text())
    change(manifest)
    write_manifest(dataset, manifest)  # re-checksummed: a consistent-looking but wrong manifest


@pytest.mark.parametrize("case,change,message", [
    ("dropped", lambda m: m["splits"]["train"]["shards"].pop(), "the sum over its shards"),
    ("swapped", lambda m: m["splits"]["train"]["shards"].reverse(), "shards are named in order"),
    ("totals", lambda m: m["splits"]["train"].update(tokens=1), "the sum over its shards"),
    ("outside", lambda m: m["splits"]["train"]["shards"][0].update(file="../../etc/passwd"), "in order inside"),
    ("splits", lambda m: m.update(splits=[1, 2]), "a mapping of train/val"),
    ("count", lambda m: m["splits"]["val"]["shards"][0].update(bytes="many"), "an integer from 0 to 9223372036854775807"),
    # accepted, and trained on, before (a hostile sweep, 2026-11-27)
    ("dtype", lambda m: m.update(dtype="float64"), "dtype = 'float64': 'uint16', the token type of a 257-token"),
    ("chunk", lambda m: m.update(chunk_tokens=0), "chunk_tokens = 0: an integer from 1 to"),
    ("vocab", lambda m: m["tokenizer"].update(vocab_size=-1), "tokenizer.vocab_size = -1: an integer from 2"),
    ("eos", lambda m: m["tokenizer"].update(eos_id=257), "tokenizer.eos_id = 257: an integer from 0 to 256"),
    ("kind", lambda m: m["tokenizer"].update(kind="wordpiece"), "a table with kind 'byte' or 'bpe'"),
])
def test_a_wrong_manifest_is_named_exactly(tmp_path, write_docs, case, change, message):
    text = write_docs(tmp_path / "text", n_docs=30, words=300)
    build_dataset([text], tmp_path / "ds", shard_size_mb=0.002, val_fraction=0.3)
    _tamper(tmp_path / "ds", change)
    out = luban_data("verify", tmp_path / "ds")
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_edited_manifest_and_shard_replaced_by_a_folder(tmp_path, write_docs):
    text = write_docs(tmp_path / "text", n_docs=8)
    build_dataset([text], tmp_path / "ds")
    path = tmp_path / "ds" / "manifest.json"
    path.write_text(path.read_text().replace('"seed": 0', '"seed": 1'))
    out = luban_data("verify", tmp_path / "ds")
    assert out.returncode == 2 and "content checksum mismatch" in out.stderr
    build_dataset([text], tmp_path / "ds2")
    shard = tmp_path / "ds2" / "train-00000.bin"
    shard.unlink()
    shard.mkdir()
    out = luban_data("verify", tmp_path / "ds2")
    assert out.returncode == 2 and "not a regular file" in out.stderr and "Traceback" not in out.stderr
