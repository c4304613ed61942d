"""Building datasets: manifest, documents, split, default corpus, crash safety."""

from __future__ import annotations

import json

import numpy as np
import pytest

import luban.data.build as build
from luban import owned
from luban.data.build import build_dataset, ensure_default_dataset, split_documents
from luban.data.corpus import collect_files, default_corpus_files, stdlib_dir
from luban.data.manifest import load_manifest, open_dataset
from luban.data.shards import ShardWriter
from luban.data.tokenizer import load_tokenizer
from luban.errors import LubanError


def test_manifest_matches_the_shards(small_dataset):
    manifest = json.loads((small_dataset / "manifest.json").read_text())
    assert manifest["format"] == "luban-tokens" and manifest["format_version"] == 2  # the shards' format version
    assert manifest["dtype"] == "uint16" and manifest["chunk_tokens"] == 128
    assert manifest["tokenizer"] == {"kind": "byte", "vocab_size": 257, "eos_id": 256,
                                     "file": None}
    assert manifest["source"]["files"] == 24
    _, splits = open_dataset(small_dataset)
    for name, split in manifest["splits"].items():
        assert len(split["shards"]) >= 2  # shard_size_mb=0.01 rolls over
        assert split["tokens"] == sum(r.tokens for r in splits[name])
        assert split["documents"] == sum(r.documents for r in splits[name])
        for entry in split["shards"]:
            assert (small_dataset / entry["file"]).stat().st_size == entry["bytes"]
    assert manifest["splits"]["val"]["documents"] == 6  # 25% of 24


def test_documents_are_the_input_files_each_ending_with_eos(small_dataset):
    manifest = load_manifest(small_dataset)
    is_val = split_documents(24, 0.25, seed=3)
    files = collect_files([small_dataset.parent / "text"])
    tok = load_tokenizer(small_dataset)
    _, splits = open_dataset(small_dataset)
    for name, want_val in (("train", False), ("val", True)):
        docs = [r.document(i) for r in splits[name] for i in range(r.documents)]
        expected = [f.read_text(encoding="utf-8") for f, v in zip(files, is_val) if v == want_val]
        assert [tok.decode(d.tolist()) for d in docs] == expected
        assert all(d[-1] == tok.eos_id and tok.eos_id not in d[:-1] for d in docs)
    assert manifest["splits"]["val"]["documents"] == int(is_val.sum())


def test_split_is_deterministic_and_by_fraction():
    mask = split_documents(1000, 0.1, seed=7)
    assert mask.sum() == 100
    np.testing.assert_array_equal(mask, split_documents(1000, 0.1, seed=7))
    assert not np.array_equal(mask, split_documents(1000, 0.1, seed=8))
    assert split_documents(10, 0.001, 0).sum() == 1  # at least one val document
    assert split_documents(2, 0.9, 0).sum() == 1  # at least one train document
    assert split_documents(10, 0.0, 0).sum() == 0


def test_default_corpus_is_sorted_capped_stdlib_source():
    files = default_corpus_files(max_bytes=300_000)
    root = stdlib_dir()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    assert not any(part in ("site-packages", "test") for r in rel for part in r.split("/"))
    assert sum(f.stat().st_size for f in files) <= 300_000
    more = default_corpus_files(max_bytes=600_000)
    assert more[: len(files)] == files and len(more) > len(files)
    with pytest.raises(LubanError, match="--max-bytes = 10: at least the size of the first"):
        default_corpus_files(max_bytes=10)


def test_ensure_default_dataset_builds_once_and_repairs(tmp_path, monkeypatch):
    out = ensure_default_dataset(tmp_path / "d", max_bytes=200_000)
    manifest = load_manifest(out)
    assert manifest["source"]["kind"] == "default-corpus"
    shard = out / manifest["splits"]["train"]["shards"][0]["file"]
    stamp = shard.stat().st_mtime_ns

    calls = []
    monkeypatch.setattr(build, "build_dataset", lambda *a, **k: calls.append(a))
    ensure_default_dataset(out, max_bytes=200_000)
    assert calls == [] and shard.stat().st_mtime_ns == stamp  # valid: not rebuilt
    monkeypatch.undo()

    data = bytearray(shard.read_bytes())
    data[20] ^= 1  # header corruption makes it invalid
    shard.write_bytes(bytes(data))
    ensure_default_dataset(out, max_bytes=200_000)
    open_dataset(out)  # rebuilt and valid again
    ensure_default_dataset(out, max_bytes=150_000)
    assert load_manifest(out)["source"]["max_bytes"] == 150_000


def test_rebuild_removes_stale_shards(tmp_path, write_docs):
    text = write_docs(tmp_path / "text")
    build_dataset(str(text), tmp_path / "ds", shard_size_mb=0.005, val_fraction=0)  # one path
    many = sorted(p.name for p in (tmp_path / "ds").glob("*.bin"))
    build_dataset([text], tmp_path / "ds", val_fraction=0)
    assert len(many) > 1
    assert sorted(p.name for p in (tmp_path / "ds").glob("*.bin")) == ["train-00000.bin"]


def test_crashed_rebuild_keeps_the_old_dataset(tmp_path, write_docs, monkeypatch):
    text = write_docs(tmp_path / "text")
    old = build_dataset([text], tmp_path / "ds")
    original = ShardWriter.add_document
    calls = []

    def crash_on_fifth(self, tokens):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt  # as if the build were killed
        original(self, tokens)

    monkeypatch.setattr(ShardWriter, "add_document", crash_on_fifth)
    with pytest.raises(KeyboardInterrupt):
        build_dataset([text], tmp_path / "ds", seed=1)
    assert load_manifest(tmp_path / "ds") == old  # the build is a transaction: old or new, never neither
    assert not list((tmp_path / "ds").glob(".*.tmp-*")) and not list(tmp_path.glob(".ds.*"))


def test_a_build_removes_only_its_own_dead_staging(tmp_path, write_docs):
    """A dead build's stage (marked, or empty) is swept; a user's folder that only looks like one
    by name is kept with its files (a hostile sweep, 2026-11-27: both were deleted)."""
    text = write_docs(tmp_path / "text")
    theirs = [tmp_path / ".ds.building-999999", tmp_path / ".ds.building-abc", tmp_path / ".ds.old-999999"]
    for folder in theirs:
        folder.mkdir()
        (folder / "important.txt").write_text("mine")
    dead = tmp_path / ".ds.building-999998"  # a killed build's stage: luban's marker in it
    dead.mkdir()
    owned.mark(dead, "dataset")
    (tmp_path / ".ds.building-999997").mkdir()  # killed between its mkdir and its marker
    (tmp_path / ".ds.building-999996").mkdir()  # killed while writing its marker
    (tmp_path / ".ds.building-999996" / ".luban.tmp-999996").write_text('{"luban": "da')
    build_dataset([text], tmp_path / "ds")
    assert all((f / "important.txt").read_text() == "mine" for f in theirs)
    assert not any((tmp_path / f".ds.building-{pid}").exists() for pid in (999998, 999997, 999996))


@pytest.mark.parametrize("kwargs,message", [
    ({"tokenizer": "wordpiece"}, "--tokenizer = 'wordpiece': one of 'byte', 'bpe'"),
    ({"vocab_size": 1000}, "--vocab-size = 1000: only with --tokenizer bpe"),
    ({"val_fraction": 1.0}, r"--val-fraction = 1.0: a finite number in \[0, 1\)"),
    ({"shard_size_mb": 0}, r"--shard-size-mb = 0: a finite number in \(0, 16384\]"),
    ({"seed": -1}, "--seed = -1: an integer from 0 to "),
    ({"chunk_tokens": 0}, "--chunk-tokens = 0: an integer from 1 to 16777216"),
    ({"chunk_tokens": 1 << 30}, "--chunk-tokens = 1073741824: an integer from 1 to 16777216"),
])
def test_bad_build_options(tmp_path, write_docs, kwargs, message):
    with pytest.raises(LubanError, match=message):
        build_dataset([write_docs(tmp_path / "t", n_docs=2)], tmp_path / "ds", **kwargs)


def test_missing_input_is_named(tmp_path):
    with pytest.raises(LubanError, match="INPUTS = '.*nope': an existing text file or folder"):
        build_dataset([tmp_path / "nope"], tmp_path / "ds")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LubanError, match="no files found"):
        build_dataset([tmp_path / "empty"], tmp_path / "ds")


def test_a_full_disk_during_a_build_is_one_line_and_exit_74(tmp_path, write_docs):
    """Writes refused by the storage (here EFBIG past a file-size limit, as a full disk would refuse
    them; CPython ignores SIGXFSZ) end the build with one line and exit 74, the old dataset kept
    and no stage left (was a traceback, exit 1)."""
    import resource
    import subprocess
    import sys

    text = write_docs(tmp_path / "text", n_docs=200, words=400)
    old = build_dataset([write_docs(tmp_path / "small", n_docs=2)], tmp_path / "ds", val_fraction=0)

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    out = subprocess.run([sys.executable, "-m", "luban", "data", "build", str(text), "--out", str(tmp_path / "ds"),
                          "--shard-size-mb", "1"], capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 74 and len(lines) == 1, out.stderr
    assert lines[0].startswith("luban: error: --out = ") and "could not be written (File too large)" in lines[0]
    assert load_manifest(tmp_path / "ds") == old and not list(tmp_path.glob(".ds.*"))
