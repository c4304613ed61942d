"""``luban data build``: tokenise documents into a few large packed shards per split.

Each input file is one document, tokenised and ended with the tokenizer's EOS id. Documents
are assigned to the validation split by a seeded permutation (``split_documents``), then
streamed into ``train-NNNNN.bin`` / ``val-NNNNN.bin`` shards of about ``shard_size_mb`` each
(a document is never split across shards). Shards are committed atomically one by one; the
manifest is written last, after the old one was deleted first, so a crashed build never
leaves a directory that looks like a valid dataset.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np

from luban.data.atomic import TEMP_GLOB
from luban.data.corpus import (DEFAULT_MAX_BYTES, cap_files, collect_files,
                               default_corpus_files, read_text, stdlib_dir)
from luban.data.manifest import FORMAT, MANIFEST, open_dataset, write_manifest
from luban.data.shards import (DEFAULT_CHUNK_TOKENS, FORMAT_VERSION, ShardWriter,
                               dtype_for_vocab)
from luban.data.tokenizer import BPE_FILE, BpeTokenizer, ByteTokenizer
from luban.errors import LubanError, bad_value

SPLITS = ("train", "val")
DEFAULT_SHARD_MB = 256.0
DEFAULT_VAL_FRACTION = 0.01
DEFAULT_BPE_VOCAB = 4096
_ENCODE_BATCH_BYTES = 8 << 20


def split_documents(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of the validation documents.

    ``round(val_fraction * n_docs)`` documents, at least one when ``val_fraction > 0`` and at
    most ``n_docs - 1``, chosen as the first entries of ``default_rng(seed).permutation``.
    """
    n_val = round(val_fraction * n_docs)
    if val_fraction > 0:
        n_val = min(max(n_val, 1), n_docs - 1)
    is_val = np.zeros(n_docs, dtype=bool)
    is_val[np.random.default_rng(seed).permutation(n_docs)[:n_val]] = True
    return is_val


class _SplitWriter:
    """Rolls one split's documents over ``split-00000.bin``, ``split-00001.bin``, ..."""

    def __init__(self, out_dir: Path, split: str, dtype, shard_bytes: int, chunk_tokens: int):
        self.out_dir, self.split, self.dtype = out_dir, split, dtype
        self.shard_bytes, self.chunk_tokens = shard_bytes, chunk_tokens
        self.shards: list[dict] = []
        self._writer: ShardWriter | None = None

    def add_document(self, ids: np.ndarray) -> None:
        if self._writer is None:
            path = self.out_dir / f"{self.split}-{len(self.shards):05d}.bin"
            self._writer = ShardWriter(path, self.dtype, self.chunk_tokens)
        self._writer.add_document(ids)
        if self._writer.tokens * self.dtype.itemsize >= self.shard_bytes:
            self._commit()

    def _commit(self) -> None:
        self.shards.append(asdict(self._writer.close()))
        self._writer = None

    def close(self) -> dict:
        if self._writer is not None:
            self._commit()
        return {"tokens": sum(s["tokens"] for s in self.shards),
                "documents": sum(s["documents"] for s in self.shards), "shards": self.shards}

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()


def _check_options(tokenizer, vocab_size, shard_size_mb, val_fraction, seed,
                   chunk_tokens) -> None:
    if tokenizer not in ("byte", "bpe"):
        raise bad_value("--tokenizer", tokenizer, "one of 'byte', 'bpe'")
    if vocab_size is not None and tokenizer != "bpe":
        raise bad_value("--vocab-size", vocab_size, "only with --tokenizer bpe (byte has 257)")
    if not shard_size_mb > 0:
        raise bad_value("--shard-size-mb", shard_size_mb, "a number > 0")
    if not 0 <= val_fraction < 1:
        raise bad_value("--val-fraction", val_fraction, "a fraction in [0, 1)")
    if seed < 0:
        raise bad_value("--seed", seed, "an integer >= 0")
    if not 1 <= chunk_tokens < 1 << 32:
        raise bad_value("--chunk-tokens", chunk_tokens, "an integer from 1 to 2**32 - 1")


def _clear_previous(out_dir: Path) -> None:
    """Delete the old manifest first (the dataset is invalid from now on), temps, tokenizer."""
    (out_dir / MANIFEST).unlink(missing_ok=True)
    (out_dir / BPE_FILE).unlink(missing_ok=True)
    for temp in out_dir.glob(TEMP_GLOB):
        temp.unlink(missing_ok=True)


def _remove_stale_shards(out_dir: Path, splits: dict) -> None:
    keep = {s["file"] for split in splits.values() for s in split["shards"]}
    for split in SPLITS:
        for path in out_dir.glob(f"{split}-*.bin"):
            if path.name not in keep:
                path.unlink()


def build_dataset(inputs=None, out_dir=".", *, tokenizer: str = "byte",
                  vocab_size: int | None = None, shard_size_mb: float = DEFAULT_SHARD_MB,
                  val_fraction: float = DEFAULT_VAL_FRACTION, seed: int = 0,
                  max_bytes: int | None = None,
                  chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> dict:
    """Tokenise ``inputs`` (files/folders; None or empty: the default corpus) into ``out_dir``.

    ``max_bytes`` caps the input (default: ``DEFAULT_MAX_BYTES`` for the default corpus,
    unlimited for explicit inputs). Returns the manifest that was written.
    """
    _check_options(tokenizer, vocab_size, shard_size_mb, val_fraction, seed, chunk_tokens)
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if inputs:
        files = cap_files(collect_files(inputs), max_bytes)
        source = {"kind": "files", "max_bytes": max_bytes}
    else:
        max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
        files = default_corpus_files(max_bytes)
        source = {"kind": "default-corpus", "root": str(stdlib_dir()), "max_bytes": max_bytes}
    source.update(files=len(files), bytes=sum(f.stat().st_size for f in files))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _clear_previous(out_dir)

    is_val = split_documents(len(files), val_fraction, seed)
    if tokenizer == "bpe":
        train_texts = (read_text(f) for f, val in zip(files, is_val) if not val)
        tok = BpeTokenizer.train(train_texts, vocab_size or DEFAULT_BPE_VOCAB)
        tok.save(out_dir / BPE_FILE)
    else:
        tok = ByteTokenizer()
    dtype = dtype_for_vocab(tok.vocab_size)
    shard_bytes = int(shard_size_mb * (1 << 20))
    writers = {s: _SplitWriter(out_dir, s, dtype, shard_bytes, chunk_tokens) for s in SPLITS}
    try:
        for batch in _batches(files):
            texts = [read_text(files[i]) for i in batch]
            for i, ids in zip(batch, tok.encode_batch(texts)):
                writers["val" if is_val[i] else "train"].add_document(np.append(ids, tok.eos_id))
        splits = {s: w.close() for s, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    _remove_stale_shards(out_dir, splits)
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "dtype": dtype.name,
        "chunk_tokens": chunk_tokens, "tokenizer": tok.manifest_entry(), "source": source,
        "val_fraction": val_fraction, "seed": seed, "splits": splits,
    }
    write_manifest(out_dir, manifest)
    return manifest


def _batches(files: list[Path]):
    """Yield lists of file indices of about ``_ENCODE_BATCH_BYTES`` each (for encode_batch)."""
    batch, size = [], 0
    for i, path in enumerate(files):
        batch.append(i)
        size += path.stat().st_size
        if size >= _ENCODE_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def ensure_default_dataset(out_dir, tokenizer: str = "byte",
                           max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Build the default corpus into ``out_dir`` unless a valid build of it is already there.

    "Valid" means the manifest loads, names the same tokenizer kind and corpus cap, and every
    shard passes the open-time checks (size, header and index CRCs). Concurrent callers (for
    example several ranks) serialise on a lock file, so only one of them builds.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            manifest, _ = open_dataset(out_dir)
            source = manifest.get("source", {})
            if (manifest["tokenizer"]["kind"] == tokenizer and source.get("kind") == "default-corpus"
                    and source.get("max_bytes") == max_bytes):
                return out_dir
        except LubanError:
            pass
        build_dataset(None, out_dir, tokenizer=tokenizer, max_bytes=max_bytes)
    return out_dir
