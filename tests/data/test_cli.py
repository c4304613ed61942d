"""``luban data build | verify | info`` end to end, as a user runs them (subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def luban(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "luban", "data", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("luban: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_build_info_verify_then_corruption(tmp_path, write_docs):
    text = write_docs(tmp_path / "text")
    out = tmp_path / "ds"
    built = luban("build", text, "--out", out, "--shard-size-mb", "0.01", "--chunk-tokens", "256",
                  "--val-fraction", "0.2", "--seed", "4")
    assert built.returncode == 0, built.stderr
    assert "24 files" in built.stdout and "train" in built.stdout
    info = luban("info", out, "--json")
    manifest = json.loads(info.stdout)
    assert manifest["seed"] == 4 and manifest["splits"]["val"]["documents"] == 5
    assert "tokenizer byte (vocab 257, eos 256)" in luban("info", out).stdout
    verified = luban("verify", out)
    assert verified.returncode == 0 and "verified" in verified.stdout

    shard = out / manifest["splits"]["train"]["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[64 + 2 * 256 * 2 + 7] ^= 1  # a token byte in chunk 2
    shard.write_bytes(bytes(data))
    assert_one_line_error(luban("verify", out), f"{shard}: CRC mismatch in chunk 2 at byte offset "
                          f"{64 + 2 * 256 * 2}")
    shard.write_bytes(bytes(data[:100]))
    assert_one_line_error(luban("verify", out), f"{shard}: truncated: 100 bytes",
                          "at byte offset 100")


def test_default_corpus_with_bpe(tmp_path):
    out = tmp_path / "ds"
    built = luban("build", "--out", out, "--tokenizer", "bpe", "--vocab-size", "400",
                  "--max-bytes", "150000")
    assert built.returncode == 0, built.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "default-corpus"
    assert manifest["tokenizer"]["kind"] == "bpe" and (out / "tokenizer.json").is_file()
    assert luban("verify", out).returncode == 0


@pytest.mark.parametrize("args,fragments", [
    (["--vocab-size", "lots", "--tokenizer", "bpe"], ["--vocab-size = 'lots'"]),
    (["--tokenizer", "sentencepiece"], ["--tokenizer = 'sentencepiece'", "'byte', 'bpe'"]),
    (["--val-fraction", "1.5"], ["--val-fraction = 1.5", "[0, 1)"]),
    (["--shard-size-mb", "-1"], ["--shard-size-mb = -1.0"]),
    (["--chunk-tokens", "0"], ["--chunk-tokens = 0: an integer from 1"]),
    (["--chunk-tokens", "1e3"], ["--chunk-tokens = '1e3': an integer from 1 to 16777216"]),
    (["--chunk-tokens", "1073741824"], ["--chunk-tokens = 1073741824: an integer from 1 to 16777216"]),
    (["no/such/file.txt"], ["INPUTS = 'no/such/file.txt'"]),
    ([""], ["INPUTS = '': a file or folder path, not an empty string"]),  # was the working folder ('.')
    (["  "], ["INPUTS = '  ': a file or folder path, not an empty string"]),
    (["/proc/cpuinfo"], ["INPUTS = '/proc/cpuinfo'", "its size says 0"]),  # --max-bytes read its size: 0
])
def test_bad_build_input_is_one_line_exit_2(tmp_path, args, fragments):
    assert_one_line_error(luban("build", "--out", tmp_path / "ds", *args), *fragments)
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_a_file_named_twice_is_one_document(tmp_path):
    text = tmp_path / "t"
    text.mkdir()
    (text / "a.txt").write_text("hello world\n")
    (text / "b.txt").write_text("goodbye\n")
    out = luban("build", text / "a.txt", text / "a.txt", text, "--val-fraction", "0", "--out", tmp_path / "ds")
    assert out.returncode == 0, out.stderr
    source = json.loads((tmp_path / "ds" / "manifest.json").read_text())["source"]
    assert (source["files"], source["bytes"]) == (2, 20)


def test_verify_and_info_of_a_non_dataset(tmp_path):
    assert_one_line_error(luban("verify", tmp_path / "nope"), "DIR = ", "nope")  # the argument's name
    assert_one_line_error(luban("info", tmp_path / "nope"), "DIR = ", "nope")
    assert_one_line_error(luban("info", tmp_path), "manifest.json: missing")


@pytest.mark.parametrize("action", ["verify", "info"])
def test_an_empty_dataset_path_is_not_the_current_folder(small_dataset, action):
    """`luban data verify ''` verified (and `info ''` described) the current folder: a hostile sweep, 2026-11-27."""
    proc = luban(action, "", cwd=small_dataset)
    assert proc.returncode == 2 and proc.stderr == "luban: error: DIR = '': a dataset folder\n", proc.stderr


@pytest.mark.parametrize("action", ["verify", "info"])
def test_a_manifest_that_is_a_named_pipe_is_refused_not_waited_on(tmp_path, action):
    """``luban data verify``/``info`` (and training, which reads the manifest the same way) waited
    forever on a manifest.json that is a named pipe (a hostile sweep, 2026-11-27)."""
    import os

    (tmp_path / "ds").mkdir()
    os.mkfifo(tmp_path / "ds" / "manifest.json")
    assert_one_line_error(luban(action, tmp_path / "ds"), "manifest.json: not a regular file")


@pytest.mark.parametrize("action", ["build", "verify", "info"])
def test_help(action):
    proc = luban(action, "--help")
    assert proc.returncode == 0 and "usage: luban data " + action in proc.stdout


def test_a_dataset_inside_another_dataset_is_refused(tmp_path):
    """A dataset built into a folder of another one made the outer one unrebuildable ("holds 'sub', which
    luban did not write"); the inner build is refused instead, nothing written."""
    text = tmp_path / "a.txt"
    text.write_text("hello world\n" * 8)
    assert luban("build", text, "--out", tmp_path / "ds", "--val-fraction", "0").returncode == 0
    assert_one_line_error(luban("build", text, "--out", tmp_path / "ds" / "sub" / "inner"),
                          f"--out = '{tmp_path / 'ds' / 'sub' / 'inner'}': is inside '{tmp_path / 'ds'}', "
                          "luban's folder for a dataset")
    assert not (tmp_path / "ds" / "sub").exists()
    assert luban("build", text, "--out", tmp_path / "ds", "--val-fraction", "0").returncode == 0  # rebuilds
