"""`luban data verify` / `info` on edited manifests, a hostile review of 2026-12-04.

Each case edits a built dataset's ``manifest.json`` and gives it a valid checksum (anyone can: it
is a SHA-256 of the content, not a signature), so only the structural checks stand between it
and the reader:

- JSON nested ~990 levels passed ``json.loads`` and overflowed the stack in the checksum's
  ``json.dumps``: a RecursionError traceback, exit 1 (``verify``, ``info``, ``luban train``).
- A shard's ``bytes`` of 10**400 was an OverflowError traceback in ``info``.
- A split's total as a float (``9407.0``; ``true`` for 1) passed (``==`` the sum): ``info`` was a
  traceback, ``verify`` said "verified".
- ``tokenizer.file`` was never checked for a byte tokenizer, and ``verify`` printed it: escape
  sequences from a dataset someone else wrote reached the terminal.
- The manifest's ``chunk_tokens`` was never compared with the shards' (which readers use).
- A rebuild into a folder inside its own input warned about skipping its own ``--out``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from luban.cli import main
from luban.data.build import build_dataset
from luban.data.manifest import content_checksum

ROOT = Path(__file__).resolve().parents[2]


def edited(small_dataset: Path, dest: Path, change) -> Path:
    shutil.copytree(small_dataset, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest.pop("checksum")
    change(manifest)
    manifest["checksum"] = content_checksum(manifest)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


def run_both(folder: Path, capsys) -> list[tuple[int, str]]:
    results = []
    for command in ("verify", "info"):
        code = main(["data", command, str(folder)])
        results.append((code, capsys.readouterr().err))
    return results


def _set(path: str, value):
    def change(manifest):
        *keys, last = path.split(".")
        node = manifest
        for key in keys:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value
    return change


@pytest.mark.parametrize("path, value, message", [
    ("splits.train.shards.0.bytes", 10**400, "an integer from 0 to 9223372036854775807"),
    ("splits.train.shards.0.tokens", 1 << 63, "an integer from 0 to 9223372036854775807"),
    ("source.bytes", 10**30, "source.bytes = "),
    ("splits.train.tokens", "FLOAT", "the sum over its shards"),
    ("splits.train.documents", "FLOAT", "the sum over its shards"),
    ("tokenizer.file", "\x1b]0;PWNED\x07\x1b[31mRED", r"tokenizer.file = '\x1b]0;PWNED\x07\x1b[31mRED': null (no file) "
                                                      "for a byte tokenizer"),
    ("tokenizer.sha256", "0" * 64, "(bpe only)"),
])
def test_an_edited_manifest_is_one_line_in_verify_and_info(small_dataset, tmp_path, capsys, path, value, message):
    if value == "FLOAT":
        manifest = json.loads((small_dataset / "manifest.json").read_text())
        value = float(manifest["splits"]["train"][path.rsplit(".", 1)[1]])
    folder = edited(small_dataset, tmp_path / "ds", _set(path, value))
    for code, err in run_both(folder, capsys):
        assert code == 2 and err.startswith("luban: error: ") and err.count("\n") == 1, err
        assert message in err and "\x1b" not in err, err


def test_chunk_tokens_mismatch_is_found_by_verify(small_dataset, tmp_path, capsys):
    """(``info`` reads the manifest alone, not the shards.)"""
    folder = edited(small_dataset, tmp_path / "ds", _set("chunk_tokens", 12345))
    assert main(["data", "verify", str(folder)]) == 2
    assert "{'chunk_tokens': 128} disagrees with manifest.json ({'chunk_tokens': 12345})" in capsys.readouterr().err


@pytest.mark.parametrize("depth", [17, 980, 990])
def test_a_deeply_nested_manifest_is_one_line(tmp_path, depth):
    """In a process of its own, as a user runs it: how deep json.loads gets depends on the stack."""
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "manifest.json").write_text(
        '{"format": "luban-tokens", "format_version": 2, "dtype": "uint16", "tokenizer": {}, "splits": {}, '
        f'"checksum": "0", "x": {"[" * depth}{"]" * depth}}}')
    for command in ("verify", "info"):
        proc = subprocess.run([sys.executable, "-m", "luban", "data", command, str(folder)], capture_output=True,
                              text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
        assert proc.stderr.startswith(f"luban: error: {folder / 'manifest.json'}: "), proc.stderr


def test_a_rebuild_inside_its_input_does_not_warn_about_its_own_out(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("some text\n" * 50)
    for _ in range(2):
        build_dataset([tmp_path / "in"], tmp_path / "in" / "ds")
        assert "warning" not in capsys.readouterr().err
    (tmp_path / "in" / "other").mkdir()  # another dataset there is still skipped with the warning
    build_dataset([tmp_path / "in" / "a.txt"], tmp_path / "in" / "other")
    capsys.readouterr()
    build_dataset([tmp_path / "in"], tmp_path / "in" / "ds")
    assert "1 folder(s) that luban wrote" in capsys.readouterr().err
