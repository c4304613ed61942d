"""`luban train --nproc N` end to end: suspend/resume under a 3-D layout, resume on other layouts.

The engine-level matrix (tests/parallel) checks every layout's numerics; these check the
whole loop on top: the launcher forwards SIGUSR1, all ranks agree on the step and save it,
and a checkpoint written by one layout continues under another with the same optimizer
state, learning-rate step and global sample sequence.
"""

import shutil
import signal
import sys

import pytest

from tests.child import Child
from luban.config import load_config
from luban.errors import EXIT_SUSPENDED
from luban.train.trainer import Trainer

from .conftest import assert_bitwise_equal, final_weights, luban, tiny_overrides

SGD = {"train.optimizer": '"sgd"', "train.lr": 0.05, "train.min_lr": 0.005, "train.momentum": 0.9,
       "model.preset": '"tiny-llama"', "model.layers": 4, "train.global_batch": 8, "train.eval_every": 0}


def _layout(**kw):
    return {f"parallel.{k}": (str(v).lower() if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) else v)
            for k, v in kw.items()}


def _args(sets):
    return sum((["--set", s] for s in sets), [])


@pytest.mark.multirank
def test_suspend_and_resume_under_3d_layout_is_bitwise_exact(tiny, tmp_path):
    layout = _layout(pp=2, dp=2, tp=2, zero=1, micro_batch=2)
    luban("train", "--nproc", 8, *_args(tiny("straight", **SGD, **layout)), check=0, timeout=900)
    args = ["train", "--nproc", "8", "--resume", "auto", *_args(tiny("suspended", **SGD, **layout))]
    with Child([sys.executable, "-m", "luban", *args], log=tmp_path / "suspended.log") as proc:
        proc.wait_for(r"^step 3/", 600)
        proc.send_signal(signal.SIGUSR1)
        proc.finish(600, expect=EXIT_SUSPENDED)
    saved = sorted(p.name for p in (tmp_path / "suspended" / "checkpoints").iterdir())
    assert len(saved) == 1 and saved[0] != "step_0000008"  # one step, saved by all 8 ranks together
    assert len(list((tmp_path / "suspended" / "checkpoints" / saved[0]).glob("rng_rank*.pt"))) == 8
    luban(*args, check=0, timeout=900)
    assert_bitwise_equal(final_weights(tmp_path / "straight"), final_weights(tmp_path / "suspended"))


@pytest.fixture(scope="module")
def straight_sgd(small_dataset, tmp_path_factory):
    """The single-process run both resume-on-another-layout cases continue (the same config for
    both: trained once, in this process)."""
    run = tmp_path_factory.mktemp("e2e") / "straight"
    Trainer(load_config(None, tiny_overrides(small_dataset, run, **SGD))).train()
    return final_weights(run)


@pytest.mark.multirank
@pytest.mark.parametrize("save, load", [
    (dict(nproc=2, dp=2, zero=1), dict(nproc=4, pp=2, tp=2, micro_batch=2)),  # world size 2 -> 4, no-pp -> pp
    (dict(nproc=2, pp=2, micro_batch=2), dict(nproc=1)),                     # pp -> single process
], ids=["dp2-zero1-to-pp2-tp2", "pp2-to-single"])
def test_resume_on_another_layout_continues_the_same_run(tiny, tmp_path, straight_sgd, save, load):
    nproc_save, nproc_load = save.pop("nproc"), load.pop("nproc")
    first = tiny("x", **SGD, **_layout(**save), **{"train.checkpoint_every": 4})
    luban("train", "--nproc", nproc_save, *_args(first), check=0, timeout=900)
    ckpts = tmp_path / "x" / "checkpoints"
    shutil.rmtree(ckpts / "step_0000008")  # continue from step 4 on the other layout
    second = tiny("x", **SGD, **_layout(**load))
    proc = luban("train", "--nproc", nproc_load, "--resume", "auto", *_args(second), check=0, timeout=900)
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout
    ref, got = straight_sgd, final_weights(tmp_path / "x")
    assert ref.keys() == got.keys()
    worst = max((ref[k] - got[k]).abs().max().item() for k in ref)
    assert worst < 1e-5, worst
