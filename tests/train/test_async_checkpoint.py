"""Asynchronous checkpoints (``[train] async_checkpoint``): the background write produces the
same checkpoint as a synchronous save, bit for bit, even while training moves on; a kill -9
during the write leaves the previous checkpoint the newest valid one; SIGUSR1 during the write
waits for it and exits 75 with a valid checkpoint; two ranks work (ZeRO 1, ZeRO 3, the
offloaded optimizer), and so does the MoE router bias. The writer is held mid-write (after the
DCP files, before the manifest) by the test hook ``LUBAN_TEST_HOLD_CHECKPOINT_WRITE``;
the copy to host memory is delayed by ``LUBAN_TEST_SLOW_CHECKPOINT_STAGING`` so that it runs
while the next step's forward/backward does, and the optimizer step must wait for it (a copy
taken after the step would differ from the sync save; the wait shows in the reported stall)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.child import Child, launch
from luban.errors import EXIT_SUSPENDED
from luban.train import checkpoint

from .conftest import assert_bitwise_equal, final_weights, luban, tiny_overrides

BASE = {"train.steps": 6, "train.checkpoint_every": 2, "train.eval_every": 0}
DELAY = 1.0  # seconds the background copy sleeps first: the next step's forward/backward runs meanwhile
SLOW = {checkpoint.STAGE_DELAY_ENV: str(DELAY)}


def _args(sets):
    return sum((["--set", s] for s in sets), [])


def _contents(ckpt: Path, tmp: Path) -> dict:
    """A checkpoint's tensors (DCP files read back into one dict), RNG states and meta (minus paths)."""
    out = tmp / f"{ckpt.parent.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    for rng in sorted(ckpt.glob("rng_rank*.pt")):
        for k, v in torch.load(rng, weights_only=True).items():
            flat[f"{rng.name}.{k}"] = v
    meta = json.loads((ckpt / "meta.json").read_text())
    flat["meta"] = {k: meta[k] for k in ("step", "loader", "world_size")}
    return flat


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _held(hold: Path, proc: Child, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (hold / "held").exists():
        assert proc.poll() is None, f"exit {proc.returncode} before the write was held\n{proc.tail()}"
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the write was not held within {timeout} s\n{proc.tail()}")
        time.sleep(0.05)


def _popen(args, hold: Path, step: int, **extra_env) -> Child:
    env = {**os.environ, checkpoint.HOLD_ENV: str(hold), checkpoint.HOLD_STEP_ENV: str(step), **extra_env}
    return Child([sys.executable, "-m", "luban", *args], log=hold / "train.log", env=env)


MOE = {"model.experts": 4, "model.router": '"sigmoid"', "model.router_bias_rate": 0.05}
LONG = {**BASE, "train.steps": 40, "train.checkpoint_every": 4}  # the SIGUSR1 test's run


def _sync_runs(small_dataset, root: Path, nproc: int, runs: dict[str, dict]) -> dict[str, Path]:
    """Synchronous-save runs of ``runs`` (name: ``--set`` keys on top of ``BASE``), trained one
    after the other in one spawn of ``nproc`` gloo ranks (``tests.train.resume_ranks``: the
    trainer ``luban train`` runs) instead of one ``luban train`` each. The runs under test (async,
    killed, signalled) stay ``luban train``."""
    dirs = {name: root / name for name in runs}
    cases = [{"name": name, "straight": tiny_overrides(small_dataset, dirs[name],
                                                       **{**BASE, **keys, "train.async_checkpoint": "false"})}
             for name, keys in runs.items()]
    (root / "cases.json").write_text(json.dumps(cases))
    code, output = launch([root / "cases.json"], nproc, "tests.train.resume_ranks", timeout=600,
                          log=root / "ranks.log")
    assert code == 0, output[-5000:]
    return dirs


@pytest.fixture(scope="module")
def sync_refs(small_dataset, tmp_path_factory) -> dict[str, Path]:
    """The one-process references, trained once for the module: ``base`` (``BASE``: the async
    save's reference checkpoint by checkpoint, and the killed-and-resumed run's final weights;
    async or not, training is the same, which the first test checks), ``moe`` (the router-bias
    test's sync run) and ``long`` (the SIGUSR1 test's straight run)."""
    return _sync_runs(small_dataset, tmp_path_factory.mktemp("sync1"), 1, {"base": {}, "moe": MOE, "long": LONG})


def test_async_save_equals_sync_save_while_training_moves_on(tiny, tmp_path, sync_refs):
    hold = tmp_path / "hold"
    hold.mkdir()
    proc = _popen(["train", *_args(tiny("async", **BASE))], hold, step=2, **SLOW)
    _held(hold, proc)  # step 2's write is held; training goes on to step 4 (and waits there for it)
    (hold / "release").write_text("")
    with proc:
        proc.finish(300)
    for step in ("step_0000002", "step_0000004", "step_0000006"):
        sync, asy = sync_refs["base"] / "checkpoints" / step, tmp_path / "async" / "checkpoints" / step
        assert checkpoint.verify(asy) is None
        _assert_same(_contents(sync, tmp_path), _contents(asy, tmp_path))
    records = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").open()]
    saves = [r["checkpoint"] for r in records if "checkpoint" in r]
    assert [s["step"] for s in saves] == [2, 4, 6]
    assert [s["async"] for s in saves] == [True, True, False]  # the last save blocks: end of training
    assert all(s["stall_s"] >= 0 and s["write_s"] > 0 for s in saves)
    _assert_stall_counts_the_wait(records)


def _assert_stall_counts_the_wait(records: list[dict]) -> None:
    """The copy of step s's save started DELAY s after the save returned, so step s+1 either
    computed (data + forward/backward) or waited at its optimizer step, counted in the stall."""
    steps = {r["step"]: r for r in records if "loss" in r}
    for save in (r["checkpoint"] for r in records if "checkpoint" in r and r["checkpoint"]["async"]):
        following = steps[save["step"] + 1]
        busy = following["time_data_s"] + following["time_fwd_bwd_s"]
        assert save["stall_s"] + busy >= 0.9 * DELAY, (save, following)
        # the wait is there: timed inside the next step's optimizer time (until 2026-12-02 this allowed the
        # capture 1 s, which a loaded machine exceeded: 1.99 s stalled, 0.94 s in the optimizer step)
        assert 0 <= save["wait_s"] <= save["stall_s"] and following["time_optimizer_s"] >= save["wait_s"], (save, following)


def _sync_vs_async(tiny, tmp_path, sets: dict, nproc: int = 1, sync_run: Path | None = None) -> None:
    """A sync run and an async run whose copies overlap the next step: the same checkpoints.
    ``sync_run``: the sync run, trained already (else trained here by ``luban train``)."""
    runs = (("async", "true"),) if sync_run else (("sync", "false"), ("async", "true"))
    for name, on in runs:
        luban("train", "--nproc", nproc, *_args(tiny(name, **BASE, **sets, **{"train.async_checkpoint": on})),
              check=0, timeout=600, env={**os.environ, **SLOW})
    for step in ("step_0000002", "step_0000004", "step_0000006"):
        sync, asy = (sync_run or tmp_path / "sync") / "checkpoints" / step, tmp_path / "async" / "checkpoints" / step
        assert checkpoint.verify(asy) is None and len(list(asy.glob("rng_rank*.pt"))) == nproc
        _assert_same(_contents(sync, tmp_path), _contents(asy, tmp_path))
    records = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").open()]
    saves = [r["checkpoint"] for r in records if "checkpoint" in r]
    assert [s["async"] for s in saves] == [True, True, False]
    _assert_stall_counts_the_wait(records)


def test_moe_router_bias_async_equals_sync(tiny, tmp_path, sync_refs):
    """The sigmoid router's bias (a buffer in the checkpoint) changes after the optimizer step, too."""
    _sync_vs_async(tiny, tmp_path, MOE, sync_run=sync_refs["moe"])


def test_kill_9_during_a_background_write_leaves_the_previous_checkpoint(tiny, tmp_path, sync_refs):
    hold = tmp_path / "hold"
    hold.mkdir()
    proc = _popen(["train", *_args(tiny("run", **BASE))], hold, step=4)
    with proc:
        _held(hold, proc)
        proc.kill()
    root = tmp_path / "run" / "checkpoints"
    assert (root / ".tmp-step_0000004").is_dir()  # DCP files written, no manifest, never renamed
    assert checkpoint.latest_valid(root) == root / "step_0000002"
    luban("train", "--resume", "auto", *_args(tiny("run", **BASE)), check=0)
    assert_bitwise_equal(final_weights(sync_refs["base"]), final_weights(tmp_path / "run"))  # BASE straight through


def test_sigusr1_during_a_background_write_waits_for_it_and_exits_75(tiny, tmp_path, sync_refs):
    hold = tmp_path / "hold"
    hold.mkdir()
    sets = tiny("run", **LONG)
    proc = _popen(["train", "--resume", "auto", *_args(sets)], hold, step=4)
    with proc:
        _held(hold, proc)
        proc.send_signal(signal.SIGUSR1)
        (hold / "release").write_text("")
        proc.finish(300, expect=EXIT_SUSPENDED)
    root = tmp_path / "run" / "checkpoints"
    newest = checkpoint.latest_valid(root)
    assert newest is not None and int(newest.name.split("_")[1]) > 4
    assert checkpoint.verify(root / "step_0000004") is None and not list(root.glob(".tmp-*"))
    luban("train", "--resume", "auto", *_args(sets), check=0)
    assert_bitwise_equal(final_weights(sync_refs["long"]), final_weights(tmp_path / "run"))  # LONG straight through


TWO_RANKS = {"zero1": {"parallel.dp": 2, "parallel.zero": 1}, "zero3": {"parallel.dp": 2, "parallel.zero": 3},
             "zero1-offload-optimizer": {"parallel.dp": 2, "parallel.zero": 1, "parallel.offload": '"optimizer"'},
             "ep2-moe": {"parallel.dp": 2, "parallel.ep": 2, "model.experts": 4, "model.router": '"sigmoid"'},
             "pp2": {"parallel.pp": 2, "parallel.micro_batch": 1}}


@pytest.fixture(scope="module")
def two_rank_sync(small_dataset, tmp_path_factory) -> dict[str, Path]:
    """The synchronous reference run of every ``TWO_RANKS`` layout, all in one 2-rank spawn."""
    return _sync_runs(small_dataset, tmp_path_factory.mktemp("sync2"), 2, TWO_RANKS)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(TWO_RANKS))
def test_two_ranks_async_equals_sync(tiny, tmp_path, two_rank_sync, layout):
    _sync_vs_async(tiny, tmp_path, TWO_RANKS[layout], nproc=2, sync_run=two_rank_sync[layout])
