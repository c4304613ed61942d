"""A checkpoint save that fails on one rank only (a hostile review, 2026-12-03).

``_save`` ran rank 0's parts (the empty ``.tmp-`` folder; the manifest, the rename, retention)
and each rank's RNG file between barriers. When one rank's part failed (EIO from the rename, a
full disk on one node), that rank raised while the others waited in the next barrier until
gloo's timeout (30 minutes): a background save deadlocked outright — rank 0 in ``wait``'s
all-reduce, rank 1 in ``_save``'s last barrier — and the ranks that got out named another error
than the one that failed. Now every part ends in ``checkpoint._agree``: the ranks share the
outcome, all raise the first failing rank's error, and the next save works.
"""

from __future__ import annotations

import ctypes
import errno
import json

import pytest
import torch

from luban.errors import CheckpointWriteError
from luban.train import checkpoint
from tests.child import launch
from tests.train import save_fail_ranks


def test_a_save_failing_on_one_rank_fails_alike_on_every_rank_and_the_next_one_works(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code, output = launch([tmp_path / "checkpoints", out], 2, "tests.train.save_fail_ranks", timeout=420)
    assert code == 0, output[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for mode in ("sync", "async"):
        for name, where in save_fail_ranks.CASES.items():
            if mode == "sync" and name in save_fail_ranks.ASYNC_ONLY:
                continue
            case = f"{mode} {name}"
            step = ranks[0][case + ": step"]
            said = [r[case] for r in ranks]
            assert all(message is not None for message in said), (case, said)  # it failed on every rank ...
            if name.startswith("bug"):  # ... a bug as itself where it happened, named elsewhere
                assert said[1] == "ValueError: a bug everywhere=None", (case, said)
                assert said[0] == "RuntimeError: the checkpoint save failed on rank 1: ValueError: a bug " \
                                  "everywhere=None", (case, said)
            else:  # ... a storage error word for word alike, naming the rank, printed once (rank 0)
                assert said[0] == said[1], (case, said)
                assert said[0].startswith(f"CheckpointWriteError: checkpoint step {step} could not be written"), said
                failing = min(where)
                assert f"Input/output error (rank {failing})" in said[0], (case, said)
                assert said[0].endswith("everywhere=True"), (case, said)
            # the last good checkpoint stays the newest valid one (a failed re-save keeps its step's)
            newest = [r[case + ": newest"] for r in ranks]
            assert newest[0] == newest[1], (case, newest)
            if name == "exchange":
                assert newest[0] == f"step_{step:07d}", (case, newest)
            else:
                assert newest[0] is not None and newest[0] < f"step_{step:07d}", (case, newest)
    assert ranks[0]["after"] == ranks[1]["after"] == f"step_{ranks[0]['after: step']:07d}", ranks[0]


def test_a_failed_clean_up_after_the_rename_warns_and_the_save_stands(tmp_path, monkeypatch, capsys):
    root = tmp_path / "checkpoints"
    meta = _meta
    checkpoint.save(root, 1, {"w": torch.zeros(8)}, meta(1), keep=1)

    def failing(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(checkpoint, "_prune", failing)
    final = checkpoint.save(root, 2, {"w": torch.ones(8)}, meta(2), keep=1)
    assert checkpoint.latest_valid(root) == final and checkpoint.verify(final) is None
    err = capsys.readouterr().err
    assert "luban: warning: checkpoint step_0000002 is saved, but older checkpoints" in err, err
    assert "Input/output error" in err, err
    monkeypatch.undo()
    checkpoint.save(root, 3, {"w": torch.ones(8)}, meta(3), keep=1)  # the next save cleans up
    assert sorted(p.name for p in root.iterdir()) == ["step_0000003"]


def _meta(step):
    return {"step": step, "config": {"model": {}}, "world_size": 1}


@pytest.mark.parametrize("name", ["step_0000002", ".tmp-step_0000002", ".removing-step_0000002"])
@pytest.mark.parametrize("kind", ["file", "link to a folder", "dangling link"])
def test_a_user_s_file_or_link_where_a_save_goes_is_refused_and_left_as_it_is(tmp_path, name, kind):
    """A re-save swapped a user's regular file named step_N into .tmp-step_N; every later save of
    that step then failed with "File exists" (a link went the same way)."""
    root = tmp_path / "checkpoints"
    checkpoint.save(root, 1, {"w": torch.zeros(8)}, _meta(1), keep=3)
    if name == ".removing-step_0000002":
        checkpoint.save(root, 2, {"w": torch.zeros(8)}, _meta(2), keep=3)  # where a re-save moves the old one
    theirs, elsewhere = root / name, tmp_path / "mine"
    elsewhere.mkdir()
    if kind == "file":
        theirs.write_text("my notes")
    else:
        theirs.symlink_to(elsewhere if kind == "link to a folder" else tmp_path / "nowhere")
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(CheckpointWriteError) as refused:
        checkpoint.save(root, 2, {"w": torch.ones(8)}, _meta(2), keep=3)
    what = "a file" if kind == "file" else "a link"
    assert f"{name} is {what}, which luban did not write; move it away" in str(refused.value), refused.value
    assert sorted(p.name for p in root.iterdir()) == before  # nothing moved, nothing removed
    assert (theirs.read_text() == "my notes") if kind == "file" else theirs.is_symlink()
    assert list(elsewhere.iterdir()) == []
    theirs.unlink()  # moved away: the same save works
    checkpoint.save(root, 2, {"w": torch.ones(8)}, _meta(2), keep=3)
    assert checkpoint.latest_valid(root).name == "step_0000002"


def test_a_re_save_where_renameat2_is_refused_with_eperm_keeps_the_valid_checkpoint(tmp_path, monkeypatch):
    """A seccomp filter older than renameat2 answers EPERM: every re-save failed with exit 74."""
    root = tmp_path / "checkpoints"
    first = checkpoint.save(root, 2, {"w": torch.zeros(8)}, _meta(2), keep=3)
    calls = []

    class NoRenameat2:
        def __init__(self, *args, **kwargs):
            def renameat2(*args):
                calls.append(args)
                ctypes.set_errno(errno.EPERM)
                return -1
            self.renameat2 = renameat2

    monkeypatch.setattr(checkpoint.ctypes, "CDLL", NoRenameat2)
    assert checkpoint.save(root, 2, {"w": torch.ones(8)}, _meta(2), keep=3) == first  # no exit 74
    assert calls and checkpoint.verify(first) is None
    assert sorted(p.name for p in root.iterdir()) == ["step_0000002"]
