"""Shared fixtures: a small dataset built from generated text, and the text generator."""

from __future__ import annotations

import shutil

import pytest

from luban.data.build import build_dataset

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu ünïcødé 🙂".split()


def write_docs(folder, n_docs: int = 24, words: int = 120):
    """``n_docs`` deterministic small text files (one document each) under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        text = " ".join(WORDS[(i * 7 + j * j) % len(WORDS)] for j in range(words + 13 * i))
        (folder / f"doc{i:03d}.txt").write_text(f"# document {i}\n{text}\n", encoding="utf-8")
    return folder


@pytest.fixture(name="write_docs")
def write_docs_fixture():
    """The ``write_docs`` helper, for tests that need their own input folder."""
    return write_docs


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory):
    """Generated text, byte tokens, several shards of small CRC chunks. Do not modify."""
    root = tmp_path_factory.mktemp("small")
    out = root / "ds"
    build_dataset([write_docs(root / "text")], out, shard_size_mb=0.01, chunk_tokens=128,
                  val_fraction=0.25, seed=3)
    return out


@pytest.fixture
def dataset_copy(small_dataset, tmp_path):
    """A private copy of ``small_dataset`` that a test may corrupt."""
    return shutil.copytree(small_dataset, tmp_path / "ds")
