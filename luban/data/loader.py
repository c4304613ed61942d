"""Deterministic, resumable, dp-independent batches of token windows, prefetched in a thread.

Sample ``i`` of an epoch is the window of ``seq_len + 1`` tokens starting at token
``i * seq_len`` of the split's token stream (its shards concatenated in manifest order), so an
epoch has ``(tokens - 1) // seq_len`` samples. The order is a pure function of
``(order version, seed, global sample index g)``: position ``g % N`` of epoch ``e = g // N`` holds sample
``ORDER_RULES[version](seed, e, N)(g % N)`` (``luban.data.order``). Version 2, that of a new run, is a keyed
Feistel permutation cycle-walked into ``[0, N)``, computed per position: O(1) memory and time a sample
whatever ``N``. Version 1, ``default_rng([seed, e]).permutation(N)`` built whole (8 bytes a sample: 29 GB a
rank at 3.66e9 samples), is kept for the runs that started on it: ``state_dict()`` records the version, and
``load_state_dict`` continues the one it names. Global step ``k`` consumes global
samples ``[k*B, (k+1)*B)`` and dp rank ``r`` takes the contiguous slice
``[r*B/dp, (r+1)*B/dp)`` of it, so the global sequence does not depend on the number of ranks
and a run resumed from ``consumed_samples`` with another dp degree continues it exactly
(the Megatron-LM ``consumed_samples`` convention). Reading verifies each CRC chunk, and that its
ids are below the manifest's vocabulary, on first touch (see ``luban.data.shards``). ``next()``
returns the batch at ``consumed_samples`` whatever interrupted an earlier call, and never waits
on a prefetch thread that is stopped or gone (``TokenLoader._next_prefetched``).
"""

from __future__ import annotations

import queue
import resource
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from luban.data.manifest import load_manifest, open_split
from luban.data.order import ORDER_ALLOWED, ORDER_RULES, ORDER_VERSION, known_order
from luban.data.order import epoch_order  # noqa: F401 - documented here too (docs/data.md)
from luban.data.shards import ShardReader
from luban.errors import bad_value


# Shards one stream keeps open (each holds a file descriptor), the least recently read given back
# first. A 15T-token corpus in 256 MiB shards has 120,000 shards, and the soft RLIMIT_NOFILE is often
# 1,024 (systemd's and many distributions' default): a stream keeps at most this many open, and at
# most 1/FD_SHARE_PER_STREAM of the soft limit, leaving the rest to the other stream, sockets, NCCL
# and checkpoints.
MAX_OPEN_SHARDS = 1024
FD_SHARE_PER_STREAM = 8
# How long the prefetch thread waits on a full queue, and the caller on an empty one, before it looks again
# at whether it should stop (the thread: ``close``; the caller: a loader closed by another thread or a
# signal handler, or a thread that ended): a wait never outlives the loader. 50 ms: a stop is seen at once
# on a human scale, and a wait that ends with a batch returns as soon as it is put (no polling delay).
PREFETCH_POLL_S = 0.05


def max_open_shards() -> int:
    """A stream's bound on open shards: ``MAX_OPEN_SHARDS``, or 1/``FD_SHARE_PER_STREAM`` of the
    process's soft open-file limit where that is smaller (at least 1)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN_SHARDS
    return max(1, min(MAX_OPEN_SHARDS, soft // FD_SHARE_PER_STREAM))


class TokenStream:
    """The tokens of several shards read as one contiguous array."""

    def __init__(self, readers: list[ShardReader], max_open: int | None = None):
        self.readers, self.max_open = readers, max_open or max_open_shards()
        self.starts = np.cumsum([0] + [r.tokens for r in readers])
        self.tokens = int(self.starts[-1])
        self._open: OrderedDict[int, None] = OrderedDict()  # shard indices, least recently read first
        self._lock = threading.Lock()

    def read(self, start: int, stop: int) -> np.ndarray:
        parts = []
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        with self._lock:
            while start < stop:
                end = min(stop, int(self.starts[shard + 1]))
                base = int(self.starts[shard])
                parts.append(self._reader(shard).read(start - base, end - base))
                start, shard = end, shard + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def close(self) -> None:
        """Give back every shard's descriptor (a read after this opens the shard again)."""
        with self._lock:
            for shard in self._open:
                self.readers[shard].close()
            self._open.clear()

    def _reader(self, shard: int) -> ShardReader:
        self._open[shard] = None
        self._open.move_to_end(shard)
        while len(self._open) > self.max_open:
            self.readers[self._open.popitem(last=False)[0]].close()
        return self.readers[shard]


class _BatchMaker:
    """Builds one dp rank's batch for a global step; shared by the caller and the thread. Its settings are
    fixed: a loader that changes its order version makes another (a thread still running keeps its own)."""

    def __init__(self, stream: TokenStream, seq_len: int, seed: int, rank_slice: slice, order_version: int):
        self.stream, self.seq_len, self.seed, self.rank_slice = stream, seq_len, seed, rank_slice
        self.order_version = order_version
        self.samples_per_epoch = (stream.tokens - 1) // seq_len
        self._order = None  # (epoch, its order): version 1 builds the epoch's permutation once

    def sample_ids(self, first: int, count: int) -> np.ndarray:
        """Dataset sample indices of global samples ``[first, first + count)``, one call of the order rule
        per epoch they span."""
        n, out = self.samples_per_epoch, np.empty(count, dtype=np.int64)
        g, end = first, first + count
        while g < end:
            epoch = g // n
            stop = min(end, (epoch + 1) * n)
            cached = self._order  # (read once: the caller and a thread may both be here)
            if cached is None or cached[0] != epoch:
                cached = self._order = (epoch, ORDER_RULES[self.order_version](self.seed, epoch, n))
            out[g - first : stop - first] = cached[1](np.arange(g - epoch * n, stop - epoch * n))
            g = stop
        return out

    def __call__(self, step_start: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.rank_slice
        ids = self.sample_ids(step_start + r.start, r.stop - r.start)
        s = self.seq_len
        windows = np.stack([self.stream.read(i * s, i * s + s + 1) for i in ids]).astype(np.int64)
        return (torch.from_numpy(np.ascontiguousarray(windows[:, :-1])),
                torch.from_numpy(np.ascontiguousarray(windows[:, 1:])))


def _integer(key: str, value, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (numpy integers accepted), else a ``LubanError``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise bad_value(key, value, f"an integer >= {minimum}")
    return int(value)


class _Failure:
    """An exception raised in the prefetch thread, carried to the caller."""

    def __init__(self, exc: BaseException):
        self.exc = exc


def _prefetch(make: _BatchMaker, start: int, step: int, out: queue.Queue,
              stop: threading.Event) -> None:
    """Thread body: put ``(step_start, batch)`` for steps ``start, start+step, ...`` until ``stop`` is set.
    Each batch goes with the sample it starts at, so the caller takes only the batch at its
    ``consumed_samples`` (``TokenLoader._next_prefetched``)."""
    while not stop.is_set():
        try:
            item = make(start)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            item = _Failure(exc)
        tagged, start = (start, item), start + step
        while not stop.is_set():
            try:
                out.put(tagged, timeout=PREFETCH_POLL_S)
                break
            except queue.Full:
                continue
        if isinstance(item, _Failure):
            return


class TokenLoader:
    """Iterator of ``(tokens, labels)`` LongTensors of shape ``[global_batch // dp_size, seq_len]``.

    ``prefetch`` batches are prepared ahead in a background thread (0: synchronous). Call
    ``close()`` (or use ``with``) to stop the thread. An exception in the thread (e.g. a CRC
    mismatch) is raised by the ``next()`` that would have returned that batch. ``order_version``: the
    sample-order rule (``luban.data.order.ORDER_RULES``; None: ``ORDER_VERSION``, that of a new run).
    """

    def __init__(self, dataset_dir, split: str = "train", seq_len: int = 1024,
                 global_batch: int = 8, seed: int = 0, dp_rank: int = 0, dp_size: int = 1,
                 prefetch: int = 2, order_version: int | None = None, seq_key: str = "seq_len"):
        seq_len, global_batch, dp_size = (_integer(k, v, 1) for k, v in (
            ("seq_len", seq_len), ("global_batch", global_batch), ("dp_size", dp_size)))
        seed, prefetch = _integer("seed", seed, 0), _integer("prefetch", prefetch, 0)
        order_version = ORDER_VERSION if order_version is None else order_version
        if not known_order(order_version):
            raise bad_value("order_version", order_version, ORDER_ALLOWED)
        if global_batch % dp_size:
            raise bad_value("global_batch", global_batch,
                            f"a multiple of dp_size = {dp_size} (each rank takes an equal slice)")
        dp_rank = _integer("dp_rank", dp_rank, 0)
        if dp_rank >= dp_size:
            raise bad_value("dp_rank", dp_rank, f"an integer in [0, dp_size = {dp_size})")
        self.dataset_dir = Path(dataset_dir)
        self.split, self.seq_len, self.global_batch, self.seed = split, seq_len, global_batch, seed
        self.prefetch = prefetch
        stream = TokenStream(open_split(dataset_dir, load_manifest(dataset_dir), split))
        if stream.tokens < 2:
            raise bad_value("split", split, f"has {stream.tokens} tokens in {self.dataset_dir}; "
                            "rebuild with more documents or another --val-fraction")
        if stream.tokens < seq_len + 1:
            raise bad_value(seq_key, seq_len,
                            f"at most {stream.tokens - 1}: split {split!r} of {self.dataset_dir} "
                            f"has only {stream.tokens} tokens")
        local = global_batch // dp_size
        self._make = _BatchMaker(stream, seq_len, seed, slice(dp_rank * local, (dp_rank + 1) * local),
                                 int(order_version))
        self.samples_per_epoch = self._make.samples_per_epoch
        self.consumed_samples = 0
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._closed = False

    @property
    def order_version(self) -> int:
        """The sample-order rule this loader follows (``luban.data.order.ORDER_RULES``)."""
        return self._make.order_version

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.samples_per_epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._closed:
            raise RuntimeError("TokenLoader is closed")
        if self.prefetch == 0:
            batch = self._make(self.consumed_samples)
        else:
            batch = self._next_prefetched()
        self.consumed_samples += self.global_batch
        return batch

    def _next_prefetched(self):
        """The batch at ``consumed_samples`` from the thread (started here at that sample if none runs).

        The wait is bounded: a loader closed meanwhile (by another thread, or a signal handler in this one)
        raises instead of waiting for a batch that will never come, and so does a thread that ended without
        putting one (an error outside the batch it makes). A batch that is not the one at ``consumed_samples``
        (one taken from the queue but never returned: a ``KeyboardInterrupt`` landed after ``Queue.get`` took
        it and before it was counted; or queued by a thread a ``load_state_dict`` interrupted in its join had
        stopped) restarts the thread at ``consumed_samples``, so what ``next()`` returns always follows
        ``state_dict()``."""
        while True:
            if self._closed:
                raise RuntimeError("TokenLoader is closed")
            if self._thread is None:
                self._stop = threading.Event()
                self._queue = queue.Queue(maxsize=self.prefetch)
                self._thread = threading.Thread(
                    target=_prefetch, name=f"luban-prefetch-{self.split}", daemon=True,
                    args=(self._make, self.consumed_samples, self.global_batch, self._queue,
                          self._stop))
                self._thread.start()
                weakref.finalize(self, self._stop.set)  # a forgotten loader still ends its thread
            thread, waiting, stop = self._thread, self._queue, self._stop
            try:
                start, item = waiting.get(timeout=PREFETCH_POLL_S)
            except queue.Empty:
                if thread.is_alive() or not waiting.empty():
                    continue
                if self._thread is thread:
                    self._thread = self._queue = None
                # stopped (repositioned elsewhere, or a stop interrupted) or never started (``start()``
                # interrupted): start one again at ``consumed_samples``
                if stop.is_set() or thread.ident is None:
                    continue
                raise RuntimeError(f"the prefetch thread {thread.name} ended without a batch (its exception, "
                                   "if any, is printed above); the next call starts another") from None
            if start != self.consumed_samples:
                self._stop_thread()
                continue
            if isinstance(item, _Failure):
                self._stop_thread()  # the next call retries the same batch from a fresh thread
                raise item.exc
            return item

    def _stop_thread(self) -> None:
        thread, stop = self._thread, self._stop
        if thread is None:
            return
        stop.set()
        if thread.ident is not None:  # (one never started, its ``start()`` interrupted, cannot be joined)
            thread.join()
        if self._thread is thread:  # (a waiting ``next()`` in another thread may have let it go already)
            self._thread = self._queue = None

    def state_dict(self) -> dict:
        """What a checkpoint must store to resume the exact sample sequence."""
        return {"consumed_samples": self.consumed_samples, "seed": self.seed,
                "seq_len": self.seq_len, "split": self.split,
                "samples_per_epoch": self.samples_per_epoch, "order_version": self.order_version}

    def load_state_dict(self, state: dict) -> None:
        """Continue after ``state["consumed_samples"]`` (any dp degree or global batch), in the order
        ``state["order_version"]`` names; without that key (a bare position) in this loader's order. A state
        saved before order versions is version 1 (``UNVERSIONED_ORDER``): the checkpoint reader says so
        (``Trainer.resume``)."""
        if not isinstance(state, dict):  # a checkpoint's meta.json "loader", damaged or hand-edited
            raise bad_value("loader state_dict", state, "a table with consumed_samples (a checkpoint's loader position)")
        for key in ("seed", "seq_len", "split", "samples_per_epoch"):
            if key in state and state[key] != getattr(self, key):
                raise bad_value(f"loader state_dict[{key!r}]", state[key],
                                f"must equal this loader's {getattr(self, key)!r} to resume "
                                "the same sample sequence")
        consumed = _integer("loader state_dict['consumed_samples']",
                            state.get("consumed_samples"), 0)
        version = state.get("order_version", self.order_version)
        if not known_order(version):
            raise bad_value("loader state_dict['order_version']", version, ORDER_ALLOWED)
        self._stop_thread()
        if int(version) != self.order_version:
            m = self._make
            self._make = _BatchMaker(m.stream, m.seq_len, m.seed, m.rank_slice, int(version))
        self.consumed_samples = consumed

    def close(self) -> None:
        """Stop and join the prefetch thread and give back the shards' descriptors; idempotent. A ``next()``
        waiting for a batch meanwhile (in another thread) raises ``RuntimeError``, as any after this."""
        self._closed = True
        self._stop_thread()
        self._make.stream.close()

    def __enter__(self) -> TokenLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def val_batches(dataset_dir, seq_len: int, global_batch: int, num_batches: int,
                dp_rank: int = 0, dp_size: int = 1,
                order_version: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The same ``num_batches`` validation batches on every call (seed 0, from the start), in the
    order ``order_version`` (a run's: its training loader's; None: ``ORDER_VERSION``).

    If the val split has fewer than ``num_batches * global_batch`` samples, the sequence
    wraps into the next (differently shuffled) epoch.
    """
    num_batches = _integer("num_batches", num_batches, 0)
    with TokenLoader(dataset_dir, split="val", seq_len=seq_len, global_batch=global_batch,
                     seed=0, dp_rank=dp_rank, dp_size=dp_size, prefetch=0,
                     order_version=order_version) as loader:
        for _ in range(num_batches):
            yield next(loader)
