"""Regression tests for the hostile review (2026-11-28) of the loader: resume, prefetch thread, token ids.
Each test but the first failed (or hung, bounded here) before its fix; its docstring says what was wrong and
what is true now."""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
import torch

import luban.data.loader as loader_module
from luban.data import shards
from luban.data.loader import TokenLoader
from luban.data.manifest import load_manifest, open_dataset, write_manifest
from luban.data.shards import ShardReader, ShardWriter
from luban.errors import LubanError

torch.set_num_threads(1)
S, B = 64, 8
WAIT_S = 30  # the bound on every wait on a thread here (each ends in well under a second when correct)


def _batches(dataset, steps, start=0, dp_size=1, prefetch=2):
    """Global batches (ranks' tokens concatenated) of ``steps`` steps from ``consumed_samples = start``."""
    per_rank = []
    for rank in range(dp_size):
        with TokenLoader(dataset, seq_len=S, global_batch=B, dp_rank=rank, dp_size=dp_size,
                         prefetch=prefetch) as loader:
            loader.load_state_dict({"consumed_samples": start})
            per_rank.append([next(loader)[0] for _ in range(steps)])
    return [torch.cat([r[k] for r in per_rank]) for k in range(steps)]


def _in_thread(call):
    """Run ``call`` in a daemon thread; returns the thread and a dict that gets its result or exception."""
    out = {}

    def body():
        try:
            out["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            out["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


def _joined(thread, what):
    thread.join(WAIT_S)
    assert not thread.is_alive(), f"{what}: still waiting after {WAIT_S} s (hung)"


# -- 0. the promise itself, at every step boundary (passed before this review; kept as its guard) ---------------
def test_resume_at_every_step_boundary_across_dp_changes_is_the_uninterrupted_run(small_dataset):
    """Stopping after any step (mid-epoch, at and across the epoch wrap) with dp 1, 2 or 4 and resuming with
    another dp degree gives the next batches of the run that never stopped."""
    with TokenLoader(small_dataset, seq_len=S, global_batch=B) as loader:
        steps = loader.samples_per_epoch // B + 3  # past the first epoch's end
    reference = _batches(small_dataset, steps + 2)
    for k in range(steps):
        for before, after in ((1, 2), (2, 4), (4, 1)):
            with TokenLoader(small_dataset, seq_len=S, global_batch=B, dp_rank=0, dp_size=before) as first:
                first.load_state_dict({"consumed_samples": 0})
                for _ in range(k):
                    next(first)
                state = first.state_dict()
            assert state["consumed_samples"] == k * B
            resumed = _batches(small_dataset, 2, state["consumed_samples"], dp_size=after,
                               prefetch=0 if k % 2 else 2)
            for got, want in zip(resumed, reference[k:k + 2]):
                assert torch.equal(got, want), (k, before, after)


# -- 1. a batch taken from the queue but never returned was skipped ----------------------------------------------
class _InterruptedQueue(queue.Queue):
    """A queue whose second ``get`` is interrupted (``KeyboardInterrupt``) after it took the batch: where
    Ctrl-C lands when it comes during ``Queue.get``'s own Python code after ``_get()`` (its ``notify``)."""

    gets = 0

    def get(self, *args, **kwargs):
        item = super().get(*args, **kwargs)
        type(self).gets += 1
        if type(self).gets == 2:
            raise KeyboardInterrupt
        return item


def test_an_interrupted_next_neither_skips_a_batch_nor_desynchronises_state_dict(small_dataset, monkeypatch):
    """Was: a ``KeyboardInterrupt`` in ``next()`` after ``Queue.get`` had taken batch 1 (but before it was
    counted) lost it: the next ``next()`` returned batch 2 while ``consumed_samples`` said 1, so every later
    batch was one ahead of ``state_dict()`` and a checkpoint resumed one batch back (batches 1 never seen, and
    the last one trained twice). Now each queued batch carries the sample it starts at, and one that is not
    the batch at ``consumed_samples`` restarts the thread there."""
    reference = _batches(small_dataset, 5, prefetch=0)
    monkeypatch.setattr(loader_module.queue, "Queue", _InterruptedQueue)
    with TokenLoader(small_dataset, seq_len=S, global_batch=B, prefetch=2) as loader:
        got = [next(loader)[0]]
        with pytest.raises(KeyboardInterrupt):
            next(loader)
        assert loader.consumed_samples == B
        got += [next(loader)[0] for _ in range(4)]
        assert loader.state_dict()["consumed_samples"] == 5 * B
    for step, (a, b) in enumerate(zip(got, reference)):
        assert torch.equal(a, b), f"step {step}: not the batch of the uninterrupted run"


# -- 2. closing a loader while a next() waited hung that next() forever -----------------------------------------
def test_closing_a_loader_ends_a_next_waiting_for_its_batch(small_dataset, monkeypatch):
    """Was: a ``next()`` waiting on an empty queue (``Queue.get()``, no timeout) when the loader was closed --
    by another thread, or by a SIGTERM handler running in the waiting thread -- waited forever: ``close()``
    stopped the thread before it put the batch. Now the wait looks at the loader every ``PREFETCH_POLL_S``
    and raises ``RuntimeError("TokenLoader is closed")``."""
    entered, gate = threading.Event(), threading.Event()
    make = loader_module._BatchMaker.__call__

    def gated(self, step_start):
        entered.set()
        gate.wait(WAIT_S)
        return make(self, step_start)

    monkeypatch.setattr(loader_module._BatchMaker, "__call__", gated)
    loader = TokenLoader(small_dataset, seq_len=S, global_batch=B, prefetch=1)
    consumer, out = _in_thread(lambda: next(loader))
    assert entered.wait(WAIT_S), "the prefetch thread never started a batch"
    closer, _ = _in_thread(loader.close)
    gate.set()  # the batch being made ends; close() has set stop, so it is never put
    _joined(closer, "close()")
    _joined(consumer, "next() on a loader closed while it waited")
    assert isinstance(out.get("error"), RuntimeError) and "closed" in str(out["error"]), out
    assert not [t for t in threading.enumerate() if t.name.startswith("luban-prefetch")]


def test_a_prefetch_thread_that_ends_without_a_batch_is_an_error_not_a_hang(small_dataset, monkeypatch):
    """Was: a prefetch thread that ended without putting a batch (an error outside the batch it makes, which
    only ``threading.excepthook`` printed) left ``next()`` waiting forever. Now ``next()`` raises, and the
    next call starts another thread."""
    monkeypatch.setattr(loader_module, "_prefetch", lambda *args: None)
    with TokenLoader(small_dataset, seq_len=S, global_batch=B, prefetch=2) as loader:
        consumer, out = _in_thread(lambda: next(loader))
        _joined(consumer, "next() with a prefetch thread that ended")
        assert isinstance(out.get("error"), RuntimeError), out
        assert "ended without a batch" in str(out["error"])
        monkeypatch.undo()
        assert torch.equal(next(loader)[0], _batches(small_dataset, 1, prefetch=0)[0])


# -- 3. token ids outside the vocabulary reached the model -------------------------------------------------------
def _replace_shard(dataset, tokens, dtype, index=0):
    """Train shard ``index`` of ``dataset`` rewritten to hold ``tokens`` as ``dtype`` (consistent CRCs), and the
    manifest re-signed to match: a hostile dataset, not a damaged one."""
    manifest = load_manifest(dataset)
    entry = manifest["splits"]["train"]["shards"][index]
    with ShardWriter(dataset / entry["file"], dtype, chunk_tokens=manifest["chunk_tokens"]) as writer:
        writer.add_document(np.asarray(tokens, dtype=dtype))
        info = writer.close()
    entry.update(tokens=info.tokens, documents=info.documents, bytes=info.bytes, header_crc32=info.header_crc32)
    for key in ("tokens", "documents"):
        manifest["splits"]["train"][key] = sum(s[key] for s in manifest["splits"]["train"]["shards"])
    write_manifest(dataset, {k: v for k, v in manifest.items() if k != "checksum"})
    return dataset / entry["file"], manifest


def _every_sample(dataset):
    with TokenLoader(dataset, seq_len=S, global_batch=1, prefetch=2) as loader:
        return max(int(next(loader)[0].max()) for _ in range(loader.samples_per_epoch + 1))


def test_a_token_id_outside_the_vocabulary_is_refused_at_its_chunks_first_read(dataset_copy, monkeypatch):
    """Was: a uint16 shard holding id 60000 under a 257-token (byte) vocabulary, CRCs and manifest consistent,
    was trained on: the loader returned 60000 (an index past the embedding: a device-side assert on a GPU,
    an IndexError traceback on a CPU). Only `luban data verify` scanned the ids. Now the reader checks each
    chunk's ids against the manifest's vocabulary when it checks the chunk's CRC (once), in the loader and
    in ``verify`` (also a chunk larger than ``VERIFY_BYTES``, checked in pieces)."""
    reader = ShardReader(dataset_copy / "train-00000.bin")
    tokens = reader.read(0, reader.tokens)
    tokens[300] = 60_000
    path, manifest = _replace_shard(dataset_copy, tokens, np.uint16)
    assert manifest["tokenizer"]["vocab_size"] == 257
    chunk = 300 // manifest["chunk_tokens"]
    message = (f"{path}: token id 60000 is outside the tokenizer's vocabulary (257 ids) in chunk {chunk} "
               f"(rebuild the dataset with `luban data build`) at byte offset {64 + 2 * 300}")
    with pytest.raises(LubanError) as err:
        _every_sample(dataset_copy)
    assert str(err.value) == message
    for verify_bytes in (shards.VERIFY_BYTES, 64):  # whole chunks; a chunk in pieces of 32 tokens
        monkeypatch.setattr(shards, "VERIFY_BYTES", verify_bytes)
        readers = open_dataset(dataset_copy)[1]["train"]
        with pytest.raises(LubanError) as err:
            readers[0].verify()
        assert str(err.value) == message


def test_a_uint32_shard_under_a_uint16_manifest_is_refused_at_open(dataset_copy):
    """Was: a uint32 shard in a dataset whose manifest says uint16 (a 257-token vocabulary) was opened and read:
    the loader returned its id 4000000000. Now ``open_split`` checks every shard's dtype is the manifest's."""
    reader = ShardReader(dataset_copy / "train-00000.bin")
    tokens = reader.read(0, reader.tokens).astype(np.uint32)
    tokens[5] = 4_000_000_000
    path, _ = _replace_shard(dataset_copy, tokens, np.uint32)
    with pytest.raises(LubanError) as err:
        TokenLoader(dataset_copy, seq_len=S, global_batch=B)
    assert str(err.value) == (f"{path}: uint32 tokens, but manifest.json says uint16 (a 257-token vocabulary); "
                              "rebuild the dataset")


def test_next_after_an_interrupted_load_state_dict_neither_hangs_nor_skips(small_dataset, monkeypatch):
    """Was: Ctrl-C while ``load_state_dict`` joined the prefetch thread left the stopped thread in place: the
    following ``next()`` calls returned the batches it had queued, then waited forever for one it would never
    make. Now they return the batches at ``consumed_samples`` (the position before the interrupted call) and
    a stopped thread is replaced."""
    reference = _batches(small_dataset, 6, prefetch=0)
    join = threading.Thread.join

    def interrupted(self, timeout=None):
        raise KeyboardInterrupt

    with TokenLoader(small_dataset, seq_len=S, global_batch=B, prefetch=2) as loader:
        got = [next(loader)[0]]
        monkeypatch.setattr(threading.Thread, "join", interrupted)
        with pytest.raises(KeyboardInterrupt):
            loader.load_state_dict({"consumed_samples": 0})
        monkeypatch.setattr(threading.Thread, "join", join)
        consumer, out = _in_thread(lambda: [next(loader)[0] for _ in range(5)])
        _joined(consumer, "next() after an interrupted load_state_dict")
    assert "error" not in out, out
    got += out["value"]
    for step, (a, b) in enumerate(zip(got, reference)):
        assert torch.equal(a, b), f"step {step}: not the batch of the uninterrupted run"


def test_next_after_an_interrupted_thread_start_returns_the_first_batch(small_dataset, monkeypatch):
    """Was: Ctrl-C in ``next()`` while it started the prefetch thread (before ``start()`` ran) left a thread
    that never ran: the next ``next()`` waited forever on its queue, and ``close()`` raised "cannot join
    thread before it is started". Now a thread that never started is started again, and the batch is the
    one at ``consumed_samples``; ``close()`` does not join it."""
    start = threading.Thread.start

    def interrupted(self):
        raise KeyboardInterrupt

    with TokenLoader(small_dataset, seq_len=S, global_batch=B, prefetch=2) as loader:
        monkeypatch.setattr(threading.Thread, "start", interrupted)
        with pytest.raises(KeyboardInterrupt):
            next(loader)
        monkeypatch.setattr(threading.Thread, "start", start)
    # (the ``with`` closed it: no RuntimeError)

    with TokenLoader(small_dataset, seq_len=S, global_batch=B, prefetch=2) as loader:
        monkeypatch.setattr(threading.Thread, "start", interrupted)
        with pytest.raises(KeyboardInterrupt):
            next(loader)
        monkeypatch.setattr(threading.Thread, "start", start)
        consumer, out = _in_thread(lambda: next(loader)[0])
        _joined(consumer, "next() after an interrupted thread start")
    assert "error" not in out, out
    assert torch.equal(out["value"], _batches(small_dataset, 1, prefetch=0)[0])
