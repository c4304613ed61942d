"""TokenLoader: windows, determinism, dp-independence, resume, prefetch thread, errors."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

from luban.data.build import build_dataset
from luban.data.loader import TokenLoader, TokenStream, epoch_order, val_batches
from luban.data.manifest import load_manifest, open_split
from luban.errors import LubanError

torch.set_num_threads(1)
S, B = 64, 32


def take(loader, steps):
    return [next(loader) for _ in range(steps)]


def run(dataset, steps, dp_size=1, prefetch=2, **kw):
    """The global batches of ``steps`` steps, rank batches concatenated in rank order."""
    per_rank = []
    for rank in range(dp_size):
        with TokenLoader(dataset, seq_len=S, global_batch=B, dp_rank=rank, dp_size=dp_size,
                         prefetch=prefetch, **kw) as loader:
            per_rank.append(take(loader, steps))
    return [tuple(torch.cat([r[k][i] for r in per_rank]) for i in (0, 1)) for k in range(steps)]


def assert_same(a, b):
    assert len(a) == len(b)
    for (x1, y1), (x2, y2) in zip(a, b):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_batches_are_shifted_windows_in_the_documented_order(small_dataset):
    stream = TokenStream(open_split(small_dataset, load_manifest(small_dataset), "train"))
    with TokenLoader(small_dataset, seq_len=S, global_batch=B, seed=5, prefetch=0) as loader:
        n = loader.samples_per_epoch
        assert n == (stream.tokens - 1) // S
        tokens, labels = next(loader)
    assert tokens.shape == labels.shape == (B, S) and tokens.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], labels[:, :-1])
    for row, sample in zip(tokens, epoch_order(5, 0, n)[:B]):
        np.testing.assert_array_equal(row.numpy(), stream.read(sample * S, sample * S + S))


def test_an_epoch_visits_every_sample_once(small_dataset):
    with TokenLoader(small_dataset, seq_len=S, global_batch=1, prefetch=0) as loader:
        n = loader.samples_per_epoch
        seen = sorted(tuple(next(loader)[0][0].tolist()) for _ in range(n))
        assert loader.epoch == 1
    stream = TokenStream(open_split(small_dataset, load_manifest(small_dataset), "train"))
    assert seen == sorted(tuple(stream.read(i * S, i * S + S).tolist()) for i in range(n))


def test_deterministic_and_seed_dependent(small_dataset):
    a, b = run(small_dataset, 3, seed=1), run(small_dataset, 3, seed=np.int64(1), prefetch=0)
    assert_same(a, b)
    c = run(small_dataset, 3, seed=2)
    assert not torch.equal(a[0][0], c[0][0])


def test_dp_degree_does_not_change_the_global_sequence(small_dataset):
    steps = 30  # more than two epochs of ~12.9 steps each
    reference = run(small_dataset, steps, dp_size=1)
    for dp_size in (2, 4):
        assert_same(run(small_dataset, steps, dp_size=dp_size), reference)


@pytest.mark.parametrize("stop_at", [5, 12, 13, 27])  # mid-epoch and around epoch boundaries
@pytest.mark.parametrize("resume_dp", [1, 4])
def test_resume_continues_exactly(small_dataset, stop_at, resume_dp):
    reference = run(small_dataset, 30)
    with TokenLoader(small_dataset, seq_len=S, global_batch=B) as first:
        take(first, stop_at)
        state = first.state_dict()
    assert state["consumed_samples"] == stop_at * B
    loaders = [TokenLoader(small_dataset, seq_len=S, global_batch=B, dp_rank=r,
                           dp_size=resume_dp) for r in range(resume_dp)]
    for loader in loaders:
        loader.load_state_dict(state)
    resumed = [tuple(torch.cat(parts) for parts in zip(*[next(l) for l in loaders]))
               for _ in range(30 - stop_at)]
    for loader in loaders:
        loader.close()
    assert_same(resumed, reference[stop_at:])


def test_load_state_dict_while_prefetching_restarts_the_thread(small_dataset):
    reference = run(small_dataset, 6)
    with TokenLoader(small_dataset, seq_len=S, global_batch=B, prefetch=3) as loader:
        take(loader, 4)
        loader.load_state_dict({"consumed_samples": B})
        assert_same(take(loader, 5), reference[1:])


def test_mismatched_state_dict_is_rejected(small_dataset):
    with TokenLoader(small_dataset, seq_len=S, global_batch=B, seed=1) as loader:
        state = loader.state_dict()
    with TokenLoader(small_dataset, seq_len=S, global_batch=B, seed=2) as other:
        with pytest.raises(LubanError, match=r"state_dict\['seed'\] = 1: must equal .* 2"):
            other.load_state_dict(state)
        with pytest.raises(LubanError, match="consumed_samples'\\] = -3"):
            other.load_state_dict({"consumed_samples": -3})


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("luban-prefetch")]


def test_close_stops_the_prefetch_thread_even_with_a_full_queue(small_dataset):
    loader = TokenLoader(small_dataset, seq_len=S, global_batch=B, prefetch=2)
    next(loader)
    assert len(prefetch_threads()) == 1
    loader.close()
    loader.close()  # idempotent
    assert prefetch_threads() == []
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)


def test_a_forgotten_loader_ends_its_thread(small_dataset):
    loader = TokenLoader(small_dataset, seq_len=S, global_batch=B, prefetch=2)
    next(loader)
    (thread,) = prefetch_threads()
    del loader
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_thread_errors_reach_the_caller(dataset_copy):
    shard = dataset_copy / "train-00001.bin"
    data = bytearray(shard.read_bytes())
    data[64 + 2 * 128 * 3 + 1] ^= 0xFF  # chunk 3 of the second train shard
    shard.write_bytes(bytes(data))
    loader = TokenLoader(dataset_copy, seq_len=S, global_batch=B, prefetch=2)
    with pytest.raises(LubanError, match=f"{shard}: CRC mismatch in chunk 3 at byte offset 832"):
        take(loader, 2 * loader.samples_per_epoch // B)
    assert prefetch_threads() == []  # the failed thread was joined
    loader.close()


def test_val_batches_are_fixed(small_dataset):
    first = list(val_batches(small_dataset, seq_len=S, global_batch=8, num_batches=3))
    assert len(first) == 3 and first[0][0].shape == (8, S)
    assert_same(first, list(val_batches(small_dataset, S, 8, 3)))
    halves = [list(val_batches(small_dataset, S, 8, 3, dp_rank=r, dp_size=2)) for r in (0, 1)]
    assert_same([tuple(torch.cat([h[k][i] for h in halves]) for i in (0, 1)) for k in range(3)],
                first)
    train = next(iter(TokenLoader(small_dataset, seq_len=S, global_batch=8, prefetch=0)))
    assert not torch.equal(train[0], first[0][0])


@pytest.mark.parametrize("kwargs,message", [
    ({"global_batch": 30, "dp_size": 4}, "global_batch = 30: a multiple of dp_size = 4"),
    ({"dp_rank": 2, "dp_size": 2}, r"dp_rank = 2: an integer in \[0, dp_size = 2\)"),
    ({"seq_len": 10**6}, "seq_len = 1000000: at most 26492: split 'train' of .* has only"),
    ({"seq_len": 0}, "seq_len = 0: an integer >= 1"),
    ({"split": "test"}, r"split = 'test': one of \['train', 'val'\]"),
    ({"split": ["train"]}, r"split = \['train'\]: one of \['train', 'val'\]"),  # was a TypeError
    ({"prefetch": -1}, "prefetch = -1: an integer >= 0"),
    ({"global_batch": 8.0}, "global_batch = 8.0: an integer >= 1"),
])
def test_bad_loader_arguments(small_dataset, kwargs, message):
    args = {"seq_len": S, "global_batch": B, **kwargs}
    with pytest.raises(LubanError, match=message):
        TokenLoader(small_dataset, **args)


def test_empty_split_is_named(tmp_path, write_docs):
    build_dataset([write_docs(tmp_path / "text", n_docs=1)], tmp_path / "ds")
    with pytest.raises(LubanError, match="split = 'val': has 0 tokens in .*ds; rebuild"):
        TokenLoader(tmp_path / "ds", split="val", seq_len=S, global_batch=B)


def test_missing_or_incomplete_dataset_dir(tmp_path):
    with pytest.raises(LubanError, match="dataset_dir = '.*nowhere': no such directory"):
        TokenLoader(tmp_path / "nowhere", seq_len=S, global_batch=B)
    with pytest.raises(LubanError, match="manifest.json: missing"):
        TokenLoader(tmp_path, seq_len=S, global_batch=B)


def test_token_stream_concatenates_shards(small_dataset):
    readers = open_split(small_dataset, load_manifest(small_dataset), "train")
    whole = np.concatenate([r.read(0, r.tokens) for r in readers])
    stream = TokenStream(readers)
    assert len(readers) > 2 and stream.tokens == len(whole)
    np.testing.assert_array_equal(stream.read(0, stream.tokens), whole)
    edge = readers[0].tokens + readers[1].tokens
    np.testing.assert_array_equal(stream.read(edge - 5, edge + 7), whole[edge - 5 : edge + 7])
    np.testing.assert_array_equal(stream.read(3, 3 + readers[0].tokens + readers[1].tokens + 9),
                                  whole[3 : 3 + readers[0].tokens + readers[1].tokens + 9])
