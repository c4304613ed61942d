"""Checks that tell the truth (issue 24 item 4): the memory check runs before anything is
allocated and names the bytes; the CPU MFU peak is one per run and MFU is sanity-capped."""

import json
import resource

import pytest

from luban.config import load_config
from luban.errors import LubanError

HUGE = ["model.layers=64", "model.hidden=16384", "model.heads=128"]  # ~206 B parameters: TiB of state


def _no_engine(*args, **kwargs):
    raise AssertionError("build_engine was called: the memory check must refuse before anything is allocated")


def test_a_model_that_cannot_fit_is_refused_before_the_engine_is_built(tiny, monkeypatch):
    from luban.train import trainer as trainer_module

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(trainer_module, "build_engine", _no_engine)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = load_config(None, [*tiny(), *HUGE, "model.seq_len=128"])
    with pytest.raises(LubanError) as err:
        trainer_module.Trainer(cfg)
    line = str(err.value)
    assert "\n" not in line and line.startswith("memory: ")
    assert "GiB of host memory" in line and "GiB is available" in line, line
    needed = float(line.split(" GiB of host memory")[0].rsplit(" ", 1)[1])
    assert needed > 3000  # 64 x 12 x 16384^2 fp32 weights, gradients and two Adam states alone: ~3 TiB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 200 * 1024  # KiB: nothing was allocated


def test_multi_rank_launch_is_refused_in_the_launcher_naming_bytes_per_rank(tiny, monkeypatch, capsys):
    from luban import cli
    from luban.parallel import launch

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(launch, "launch", _no_engine)  # no rank may start
    sets = sum((["--set", s] for s in [*tiny(), *HUGE, "model.seq_len=128", "parallel.dp=2",
                                       "parallel.zero=3"]), [])
    assert cli.main(["train", "--nproc", "2", *sets]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("luban: error: memory: "), err
    assert "GiB per rank x 2 rank(s) on this node" in err[0]


def test_a_model_that_fits_is_not_refused(tiny):
    from luban.train.memcheck import check_fits, rank_bytes

    cfg = load_config(None, tiny())
    check_fits(cfg, 1, 1, "cpu")
    device, host = rank_bytes(cfg, 1)
    assert 0 < device < 1 << 30 and host == 0
