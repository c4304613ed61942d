"""Sample-order versions: version 2 (Feistel + cycle-walking) is a permutation of [0, N) for every N, computed
per position in O(1) memory whatever N; version 1 (the materialised permutation) stays bit-exact for the runs
and checkpoints that use it; a checkpoint keeps its version on resume, one of an unknown version is refused."""

from __future__ import annotations

import json
import tracemalloc
import zlib

import numpy as np
import pytest
import torch

import luban.data.loader as loader_module
from luban.config import load_config
from luban.data.loader import TokenLoader
from luban.data.order import (ORDER_RULES, ORDER_VERSION, UNVERSIONED_ORDER, epoch_order, feistel_order,
                              permutation_order)
from luban.errors import LubanError
from luban.train import checkpoint
from tests.train.conftest import luban, tiny_overrides

torch.set_num_threads(1)
S, B = 64, 8
BIG_N = 3_660_000_000  # samples of a 15T-token epoch at seq 4096: version 1 held 29 GB a rank for it


def test_version_1_is_the_permutation_runs_started_with():
    assert (ORDER_VERSION, UNVERSIONED_ORDER, sorted(ORDER_RULES)) == (2, 1, [1, 2])
    for seed, epoch, n in ((0, 0, 1), (5, 0, 407), (7, 3, 1000), (2**40, 12, 65_537)):
        want = np.random.default_rng([seed, epoch]).permutation(n)
        np.testing.assert_array_equal(epoch_order(seed, epoch, n, version=1), want)
        np.testing.assert_array_equal(permutation_order(seed, epoch, n)(np.arange(n)[::-1]), want[::-1])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 17, 1000, 2**16, 2**16 + 1])
def test_every_version_is_a_bijection_of_small_n(n):
    for version in ORDER_RULES:
        for seed, epoch in ((0, 0), (1, 0), (0, 1), (123456789, 98765)):
            order = epoch_order(seed, epoch, n, version)
            assert order.dtype == np.int64 and np.array_equal(np.sort(order), np.arange(n)), (version, seed, epoch)
    order = epoch_order(3, 4, n)
    np.testing.assert_array_equal(feistel_order(3, 4, n, inverse=True)(order), np.arange(n))


@pytest.mark.parametrize("n", [BIG_N, 2**32 + 1, 2**62 + 1])
def test_large_n_maps_a_sample_inside_and_one_to_one_in_constant_memory(n):
    positions = np.unique(np.concatenate([np.arange(4096), np.arange(n - 4096, n),
                                          np.random.default_rng(0).integers(0, n, 4096)]))
    tracemalloc.start()
    try:
        order = feistel_order(9, 2, n)
        got = order(positions)
        back = feistel_order(9, 2, n, inverse=True)(got)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.min() >= 0 and got.max() < n and len(np.unique(got)) == len(positions)
    np.testing.assert_array_equal(back, positions)
    assert peak < 4 << 20, f"{peak} bytes traced for {len(positions)} positions of an epoch of {n}"


def test_tracemalloc_sees_what_version_1_materialises():
    """The measurement above is meaningful: numpy's arrays are traced, and version 1 of a mere 2**20 samples
    allocates 8 bytes a sample (at BIG_N: 29 GB)."""
    tracemalloc.start()
    try:
        permutation_order(0, 0, 2**20)(np.arange(8))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak >= 8 * 2**20


def test_version_2_shuffles_well_enough():
    """A shuffle, not a cipher: neighbouring positions land far apart, the first positions of an epoch cover the
    samples evenly, and epochs and seeds give unrelated orders."""
    n = 10**6
    first = feistel_order(0, 0, n)(np.arange(20_000))
    gaps = np.abs(np.diff(first))
    assert gaps.mean() > n / 4 and (gaps < n // 1000).mean() < 0.01  # random: mean n/3, 0.2 % below n/1000
    counts = np.bincount(first * 10 // n, minlength=10)
    assert counts.min() > 1700 and counts.max() < 2300  # 2000 each, sd 42
    for other in (feistel_order(0, 1, n), feistel_order(1, 0, n)):
        assert (other(np.arange(20_000)) == first).mean() < 0.001
    assert (epoch_order(0, 0, 1000) == np.arange(1000)).sum() < 10  # fixed points: about 1


class _VirtualStream:
    """A token stream of ``tokens`` tokens that are their own positions (no data behind it)."""

    def __init__(self, tokens: int):
        self.tokens = tokens

    def read(self, start: int, stop: int) -> np.ndarray:
        return np.arange(start, stop, dtype=np.int64)

    def close(self) -> None:
        pass


def test_a_loader_over_a_15t_token_epoch_needs_no_memory_per_sample(small_dataset, monkeypatch):
    """A ``TokenLoader`` over BIG_N virtual samples of 4096 tokens gives its first batch and one 7 epochs on,
    across the epoch boundary, on the prefetch thread, tracing well under a batch's worth of memory per batch:
    nothing of size N is built (version 1 would hold 29 GB)."""
    seq = 4096
    monkeypatch.setattr(loader_module, "TokenStream", lambda readers: _VirtualStream(BIG_N * seq + 1))
    far = 8 * BIG_N - 3  # the last 3 samples of epoch 7, then 5 of epoch 8
    tracemalloc.start()
    try:
        with TokenLoader(small_dataset, seq_len=seq, global_batch=2 * B, dp_rank=1, dp_size=2,
                         prefetch=2) as loader:
            assert loader.samples_per_epoch == BIG_N and loader.order_version == 2
            first = next(loader)[0]
            loader.load_state_dict({"consumed_samples": far - B})  # rank 1 takes [far, far + 8)
            late = next(loader)[0]
            state = loader.state_dict()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak} bytes traced"  # measured 1.3 MB: a few batches of 8 x 4097 int64
    assert state == {"consumed_samples": far + B, "seed": 0, "seq_len": seq, "split": "train",
                     "samples_per_epoch": BIG_N, "order_version": 2}
    np.testing.assert_array_equal(first[:, 0].numpy() // seq, feistel_order(0, 0, BIG_N)(np.arange(B, 2 * B)))
    want = np.concatenate([feistel_order(0, 7, BIG_N)(np.arange(BIG_N - 3, BIG_N)),
                           feistel_order(0, 8, BIG_N)(np.arange(5))])
    np.testing.assert_array_equal(late[:, 0].numpy() // seq, want)
    assert torch.equal(late[:, 1:] - late[:, :-1], torch.ones(B, seq - 1, dtype=torch.int64))


# -- resume: each run keeps its order ---------------------------------------------------------------------------
def _global(dataset, steps, state=None, dp_size=1, **kw):
    """Global batches (ranks' tokens concatenated) of ``steps`` steps, each rank loaded with ``state``."""
    per_rank = []
    for rank in range(dp_size):
        with TokenLoader(dataset, seq_len=S, global_batch=B, dp_rank=rank, dp_size=dp_size, **kw) as loader:
            if state is not None:
                loader.load_state_dict(state)
            per_rank.append([next(loader)[0] for _ in range(steps)])
    return [torch.cat([r[k] for r in per_rank]) for k in range(steps)]


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("version", [1, 2])
def test_a_state_resumes_in_its_own_order_on_any_loader(small_dataset, version):
    with TokenLoader(small_dataset, seq_len=S, global_batch=B, order_version=version) as loader:
        steps = loader.samples_per_epoch // B + 3  # across the epoch boundary
        reference = [next(loader)[0] for _ in range(steps)]
    with TokenLoader(small_dataset, seq_len=S, global_batch=B, order_version=version, prefetch=0) as first:
        for _ in range(5):
            next(first)
        state = first.state_dict()
    assert state["order_version"] == version
    for dp_size in (1, 2):  # a new loader (of the current version) takes the state's order
        assert _equal(_global(small_dataset, steps - 5, state, dp_size), reference[5:])
    assert _equal(_global(small_dataset, 3, {"consumed_samples": 5 * B}, order_version=version),
                  reference[5:8])  # a bare position: the loader's own order
    assert not _equal(_global(small_dataset, 3, {**state, "order_version": 3 - version}), reference[5:8])


def test_version_1_loader_serves_the_permutation(small_dataset):
    stream = loader_module.TokenStream(
        loader_module.open_split(small_dataset, loader_module.load_manifest(small_dataset), "train"))
    with TokenLoader(small_dataset, seq_len=S, global_batch=B, seed=5, order_version=1) as loader:
        n = loader.samples_per_epoch
        batches = [next(loader)[0] for _ in range(n // B + 2)]
    ids = np.concatenate([np.random.default_rng([5, e]).permutation(n) for e in (0, 1)])
    for k, batch in enumerate(batches):
        for row, sample in zip(batch, ids[k * B : (k + 1) * B]):
            np.testing.assert_array_equal(row.numpy(), stream.read(sample * S, sample * S + S))


def test_changing_order_while_prefetching_restarts_the_thread(small_dataset):
    old = _global(small_dataset, 6, order_version=1)
    with TokenLoader(small_dataset, seq_len=S, global_batch=B, prefetch=3) as loader:
        for _ in range(3):
            next(loader)
        loader.load_state_dict({"consumed_samples": B, "order_version": 1})
        assert loader.order_version == 1
        assert _equal([next(loader)[0] for _ in range(5)], old[1:])


@pytest.mark.parametrize("bad", [0, 3, "2", 2.0, True, None])
def test_an_unknown_order_version_is_refused(small_dataset, bad):
    allowed = r" = .*: a sample-order version this luban knows \(1, 2\); saved by another luban"
    with TokenLoader(small_dataset, seq_len=S, global_batch=B) as loader:
        with pytest.raises(LubanError, match=r"^loader state_dict\['order_version'\]" + allowed):
            loader.load_state_dict({"consumed_samples": 0, "order_version": bad})
        assert (loader.order_version, loader.consumed_samples) == (2, 0)
    if bad is not None:  # (None: the current version)
        with pytest.raises(LubanError, match="^order_version" + allowed):
            TokenLoader(small_dataset, seq_len=S, global_batch=B, order_version=bad)


# -- checkpoints: meta.json's loader.order_version --------------------------------------------------------------
def _sets(overrides):
    return sum((["--set", o] for o in overrides), [])


def _overrides(dataset, run):
    return tiny_overrides(dataset, run, **{"train.steps": 4, "train.eval_every": 0})


@pytest.fixture(scope="module")
def saved(small_dataset, tmp_path_factory):
    """A tiny run's checkpoint after 2 steps (global batch 4: 8 samples consumed), made by this luban."""
    root = tmp_path_factory.mktemp("order")
    luban("train", *_sets(tiny_overrides(small_dataset, root / "run", **{"train.steps": 2, "train.eval_every": 0})),
          check=0)
    return root / "run" / "checkpoints" / "step_0000002"


def _edited(saved, tmp_path, version):
    """A copy of ``saved`` whose meta.json has loader.order_version ``version`` (None: no key, as a checkpoint
    saved before order versions), its manifest re-signed."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in saved.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["loader"].pop("order_version")
    if version is not None:
        meta["loader"]["order_version"] = version
    (ckpt / "meta.json").write_text(json.dumps(meta))
    files = {f.name: {"bytes": f.stat().st_size, "crc32": zlib.crc32(f.read_bytes()) & 0xFFFFFFFF}
             for f in sorted(ckpt.iterdir()) if f.name != "manifest.json"}
    (ckpt / "manifest.json").write_text(json.dumps({"files": files}))
    assert checkpoint.verify(ckpt) is None
    return ckpt


@pytest.mark.parametrize("version", [None, 1, 2])
def test_a_checkpoint_resumes_in_the_order_it_was_saved_in(saved, small_dataset, tmp_path, version):
    from luban.train.trainer import Trainer

    loader_state = json.loads((saved / "meta.json").read_text())["loader"]
    assert loader_state["order_version"] == ORDER_VERSION and loader_state["consumed_samples"] == 8
    ckpt = saved if version == 2 else _edited(saved, tmp_path, version)
    trainer = Trainer(load_config(None, _overrides(small_dataset, tmp_path / "run2")))
    try:
        trainer.resume(str(ckpt))
        want = UNVERSIONED_ORDER if version is None else version
        assert (trainer.loader.order_version, trainer.loader.consumed_samples) == (want, 8)
        got = next(trainer.loader)
    finally:
        trainer.loader.close()
    with TokenLoader(small_dataset, seq_len=loader_state["seq_len"], global_batch=4, seed=loader_state["seed"],
                     order_version=want, prefetch=0) as straight:
        for _ in range(2):
            next(straight)
        assert torch.equal(got[0], next(straight)[0])


def test_a_checkpoint_of_an_unknown_order_is_refused_in_one_line(saved, small_dataset, tmp_path):
    ckpt = _edited(saved, tmp_path, 3)
    assert checkpoint.meta_problem(json.loads((ckpt / "meta.json").read_text())) is None  # sample, export: fine
    proc = luban("train", "--resume", ckpt, *_sets(_overrides(small_dataset, tmp_path / "run2")))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line == (f"luban: error: --resume = {str(ckpt)!r}: meta.json loader.order_version = 3: a sample-order "
                    "version this luban knows (1, 2); saved by another luban: resume it with that one"), line
