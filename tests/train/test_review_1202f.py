"""Retention counts only valid checkpoints and never removes the one just written (a hostile review,
2026-12-02: a damaged newest checkpoint, skipped by ``--resume auto``, or a user's empty
``step_0000009`` folder ranked first, so the save after the resume deleted itself and every good one;
exit 0, and the next ``--resume auto`` found nothing to resume)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from luban.train import checkpoint


def meta(step):
    return {"step": step, "config": {"model": {}}, "world_size": 1}


def save(root: Path, step: int, keep: int) -> Path:
    return checkpoint.save(root, step, {"w": torch.full((64,), float(step))}, meta(step), keep=keep)


def damage(ckpt: Path) -> None:
    """One flipped byte in the weights: sizes unchanged, the CRC32 fails."""
    f = next(ckpt.glob("*.distcp"))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    checkpoint._VERIFIED.clear()  # as a new process finds it


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("newer", ["damaged", "empty user folder"])
def test_a_newer_invalid_folder_neither_counts_nor_makes_the_new_checkpoint_go(tmp_path, newer):
    root = tmp_path / "checkpoints"
    for step in (4, 9):
        save(root, step, keep=3)
    if newer == "damaged":
        damage(root / "step_0000009")
    else:
        for f in (root / "step_0000009").iterdir():
            f.unlink()
    assert checkpoint.latest_valid(root) == root / "step_0000004"  # what --resume auto picks
    save(root, 6, keep=1)
    assert names(root) == ["step_0000006", "step_0000009"]  # the older good one goes, as keep=1 says
    assert checkpoint.latest_valid(root) == root / "step_0000006"
    save(root, 7, keep=1)
    assert names(root) == ["step_0000007", "step_0000009"]


def test_only_valid_checkpoints_count_toward_keep(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        save(root, step, keep=5)
    damage(root / "step_0000004")
    save(root, 6, keep=2)  # keep 6 and the newest valid older one (2); the damaged 4 between them stays
    assert names(root) == ["step_0000002", "step_0000004", "step_0000006"]
    save(root, 8, keep=2)  # 8 and 6 are the two valid newest: 4 and 2 (luban's) go
    assert names(root) == ["step_0000006", "step_0000008"]


def test_a_folder_luban_did_not_finish_or_write_is_never_pruned(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_0000001").mkdir(parents=True)  # a user's empty folder: no manifest, not luban's
    save(root, 2, keep=5)
    (root / "step_0000002" / "manifest.json").unlink()  # a save that never finished
    for step in (3, 4, 5):
        save(root, step, keep=1)
    assert names(root) == ["step_0000001", "step_0000002", "step_0000005"]


def test_retention_reads_an_older_checkpoint_back_at_most_once_per_process(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        save(root, step, keep=5)
    checkpoint._VERIFIED.clear()
    read = []
    real = checkpoint.verify
    monkeypatch.setattr(checkpoint, "verify", lambda ckpt, **kw: read.append(ckpt.name) or real(ckpt, **kw))
    for step in (3, 4, 5):
        save(root, step, keep=5)
    assert sorted(read) == ["step_0000001", "step_0000002"]  # those this process wrote: never


def test_export_writes_no_tokenizer_that_the_run_did_not_train_with(tmp_path):
    """``luban export`` wrote the run's dataset's *current* tokenizer, checking only its size: a dataset
    rebuilt since with other merges of the same size gave an HF folder whose ids decode to other text
    (``luban sample`` refused it). Now it writes no tokenizer then, and says why."""
    import shutil
    import sysconfig

    from luban.data.build import build_dataset
    from tests.train.conftest import luban, tiny_overrides

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = tmp_path / "data"
    build_dataset([str(stdlib / "textwrap.py"), str(stdlib / "shlex.py")], data, tokenizer="bpe", vocab_size=300)
    luban("train", *sum((["--set", s] for s in tiny_overrides(data, tmp_path / "run", **{"train.steps": 2,
                                                                                          "train.eval_every": 0})),
                        []), check=0)
    luban("export", tmp_path / "run", tmp_path / "hf1", check=0)
    assert (tmp_path / "hf1" / "tokenizer.json").is_file()  # the run's own tokenizer: written
    shutil.rmtree(data)
    build_dataset([str(stdlib / "json/decoder.py"), str(stdlib / "json/encoder.py")], data, tokenizer="bpe",
                  vocab_size=300)
    proc = luban("export", tmp_path / "run", tmp_path / "hf2", check=0)
    assert not (tmp_path / "hf2" / "tokenizer.json").exists() and (tmp_path / "hf2" / "model.safetensors").is_file()
    assert "luban: warning: no tokenizer written: the run's dataset" in proc.stderr, proc.stderr
    assert "now holds another tokenizer (bpe, vocab 300" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("key", ["model.seq_len", "data.seq_len"])
def test_a_sequence_longer_than_the_dataset_names_the_setting_it_came_from(tmp_path, key):
    from luban.data.build import build_dataset
    from tests.train.conftest import luban, tiny_overrides

    text = tmp_path / "a.txt"
    text.write_text("a short corpus\n" * 4)
    build_dataset([str(text)], tmp_path / "data", val_fraction=0)
    sets = {key: 4096, "train.eval_every": 0} | ({"model.seq_len": 4096} if key == "data.seq_len" else {})
    proc = luban("train", *sum((["--set", s] for s in tiny_overrides(tmp_path / "data", tmp_path / "run", **sets)),
                               []))
    assert proc.returncode == 2 and f"luban: error: {key} = 4096: at most 60: split 'train'" in proc.stderr, \
        proc.stdout + proc.stderr


def test_a_demo_on_an_odd_number_of_ranks_says_it_shows_no_move(small_dataset, tmp_path):
    """``luban demo --nproc 1`` (or 3) skipped the resume on another layout without a word."""
    from tests.train.conftest import luban, tiny_overrides

    proc = luban("demo", "--nproc", "1", *sum((["--set", s] for s in tiny_overrides(
        small_dataset, tmp_path / "run", **{"train.steps": 2, "train.eval_every": 0})), []))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "luban: warning: 1 rank(s): the demo's move to another layout" in proc.stderr, proc.stderr
    assert "resuming step" not in proc.stdout


KILLED_REMOVAL = r"""
import os, shutil, signal, sys
from pathlib import Path
import torch
from luban.train import checkpoint

root = Path(sys.argv[1])
for step in (1, 2):
    checkpoint.save(root, step, {"w": torch.zeros(64)}, {"step": step, "config": {"model": {}}, "world_size": 1}, keep=5)

def killed(path, ignore_errors=False):  # the manifest goes first (if luban has not unlinked it), then kill -9
    names = sorted(os.listdir(path), key=lambda name: name != "manifest.json")
    os.unlink(os.path.join(path, names[0]))
    os.kill(os.getpid(), signal.SIGKILL)

shutil.rmtree = killed
step = int(sys.argv[2])  # (meta.json names its folder's step: one that names another is refused since 2026-12-04)
checkpoint.save(root, step, {"w": torch.ones(64)}, {"step": step, "config": {"model": {}}, "world_size": 1},
                keep=int(sys.argv[3]))
"""


@pytest.mark.parametrize("step, keep, survivor", [(3, 1, "step_0000003"), (2, 5, "step_0000002")])
def test_a_kill_during_a_removal_leaves_nothing_for_good(tmp_path, step, keep, survivor):
    """kill -9 while retention (or a re-save of the same step) removed an old checkpoint left a
    ``step_NNNNNNN`` without its manifest, which no later save would remove (not luban's any more):
    litter for ever. Now the folder is renamed aside first; the next save finishes the removal."""
    import sys

    from tests.child import Child

    root = tmp_path / "checkpoints"
    script = tmp_path / "kill.py"
    script.write_text(KILLED_REMOVAL)
    with Child([sys.executable, script, root, step, keep]) as child:
        assert child.wait(120) == -9, child.output()
    assert not any(p.name.startswith("step_") and not (p / "manifest.json").is_file() for p in root.iterdir()), names(root)
    assert checkpoint.latest_valid(root) == root / survivor
    save(root, 4, keep=1)
    assert names(root) == ["step_0000004"]  # the half-removed folder and any killed save's .tmp- are gone


def test_the_sweep_takes_only_what_luban_names_and_wrote(tmp_path):
    root = tmp_path / "checkpoints"
    save(root, 1, keep=5)
    (root / ".removing-notes").mkdir()  # a user's, though it holds a name a save writes
    (root / ".removing-notes" / "meta.json").write_text("{}")
    (tmp_path / "mine").mkdir()
    (root / ".tmp-step_0000001").symlink_to(tmp_path / "mine")  # a link: never followed, never removed
    (root / ".removing-step_0000000").mkdir()  # a killed removal's leftover, with a user's file in it
    (root / ".removing-step_0000000" / "notes.txt").write_text("mine")
    (root / ".tmp-step_0000000").mkdir()  # a killed save's leftover: luban's files only
    (root / ".tmp-step_0000000" / "meta.json").write_text("{}")
    save(root, 2, keep=5)
    assert names(root) == [".removing-notes", ".removing-step_0000000", ".tmp-step_0000001", "step_0000001",
                           "step_0000002"]
    assert (tmp_path / "mine").is_dir() and (root / ".removing-step_0000000" / "notes.txt").is_file()


KILLED_RESAVE = r"""
import os, signal, sys
from pathlib import Path
import torch
from luban.train import checkpoint

root, where = Path(sys.argv[1]), sys.argv[2]
meta = lambda step, note: {"step": step, "config": {"model": {}}, "world_size": 1, "note": note}
checkpoint.save(root, 1, {"w": torch.zeros(64)}, meta(1, "first"), keep=5)
checkpoint.save(root, 2, {"w": torch.zeros(64)}, meta(2, "old"), keep=5)
if where in ("no swap", "no swap, damaged"):  # a filesystem without RENAME_EXCHANGE: killed at a rename of .tmp-
    checkpoint._exchange = lambda a, b: False
    if where == "no swap, damaged":  # the old copy fails its checks: replaced by two renames
        checkpoint._verifies = lambda ckpt: False
    real = Path.rename
    def rename(self, target):
        if self.name.startswith(".tmp-"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, target)
    Path.rename = rename
else:  # killed right after the swap, before the old copy is removed
    swap = checkpoint._exchange
    def swapped(a, b):
        assert swap(a, b), "this filesystem has no RENAME_EXCHANGE"
        os.kill(os.getpid(), signal.SIGKILL)
    checkpoint._exchange = swapped
checkpoint.save(root, 2, {"w": torch.ones(64)}, meta(2, "new"), keep=int(sys.argv[3]))
"""


@pytest.mark.parametrize("keep", [1, 5])
@pytest.mark.parametrize("where", ["after the swap", "no swap", "no swap, damaged"])
def test_a_kill_during_a_resave_of_the_same_step_keeps_a_whole_copy(tmp_path, where, keep):
    """A re-save renamed the old step_N aside, then the new one into place: a kill between the two
    left step N only under hidden names, which ``--resume auto`` does not see (with keep = 1 it then
    started afresh) and the next save's sweep deleted (hostile reviews, 2026-12-03). Now the two are
    swapped in one step where the filesystem can (renameat2 RENAME_EXCHANGE); where it cannot, the
    step keeps its valid checkpoint (no rename at all); only a damaged one is replaced by two
    renames, and a kill between them keeps the new whole copy, hidden, whatever is saved next."""
    import json
    import sys

    from tests.child import Child

    root = tmp_path / "checkpoints"
    script = tmp_path / "kill.py"
    script.write_text(KILLED_RESAVE)
    with Child([sys.executable, script, root, where, keep]) as child:
        assert child.wait(120) == -9, child.output()
    if where == "after the swap":
        assert json.loads((root / "step_0000002" / "meta.json").read_text())["note"] == "new"
        assert checkpoint.latest_valid(root) == root / "step_0000002"
        save(root, 3, keep=5)
        assert names(root) == ["step_0000001", "step_0000002", "step_0000003"]  # the old copy swept
    elif where == "no swap":  # no rename of .tmp- was reached: the old copy stays, nothing else
        assert child.output() == "" or "Traceback" not in child.output()
        assert checkpoint.latest_valid(root) == root / "step_0000002"
        assert json.loads((root / "step_0000002" / "meta.json").read_text())["note"] == "old"
        save(root, 3, keep=5)
        assert names(root) == ["step_0000001", "step_0000002", "step_0000003"]
    else:
        hidden = {p.name: json.loads((p / "meta.json").read_text())["note"] for p in root.iterdir()
                  if p.name.startswith(".")}
        assert hidden == {".removing-step_0000002": "old", ".tmp-step_0000002": "new"}, hidden
        assert checkpoint.verify(root / ".tmp-step_0000002") is None
        save(root, 3, keep=1)
        assert ".tmp-step_0000002" in names(root)  # the new whole copy is not deleted by a later save
        assert ".removing-step_0000002" not in names(root)  # the damaged old one is


def test_a_resave_swaps_in_the_new_checkpoint_and_leaves_nothing_behind(tmp_path):
    import json

    root = tmp_path / "checkpoints"
    save(root, 1, keep=5)
    path = checkpoint.save(root, 1, {"w": torch.ones(64)}, {**meta(1), "note": "again"}, keep=5)
    assert json.loads((path / "meta.json").read_text())["note"] == "again" and checkpoint.verify(path) is None
    assert names(root) == ["step_0000001"]


def test_a_users_file_in_the_aside_folder_stops_a_resave_naming_it(tmp_path):
    """A user's file in ``.removing-step_N`` made every re-save of step N fail with 'Directory not
    empty' and the advice to free space; it is now named before anything is written."""
    from luban.errors import CheckpointWriteError

    root = tmp_path / "checkpoints"
    save(root, 1, keep=5)
    (root / ".removing-step_0000001").mkdir()
    (root / ".removing-step_0000001" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointWriteError, match=r"\.removing-step_0000001 holds 'notes\.txt'"):
        save(root, 1, keep=5)
    assert checkpoint.latest_valid(root) == root / "step_0000001"
    assert (root / ".removing-step_0000001" / "notes.txt").read_text() == "mine"


KILLED_AFTER_ASIDE = r"""
import os, signal, sys
from pathlib import Path
import torch
from luban.train import checkpoint

root = Path(sys.argv[1])
for step in (1, 2):
    checkpoint.save(root, step, {"w": torch.zeros(64)}, {"step": step, "config": {"model": {}}, "world_size": 1}, keep=5)
real = Path.unlink
def unlink(self, missing_ok=False):
    if self.name == "manifest.json" and self.parent.name.startswith(".removing-"):
        os.kill(os.getpid(), signal.SIGKILL)  # renamed aside, still whole
    return real(self, missing_ok=missing_ok)
Path.unlink = unlink
checkpoint.save(root, 3, {"w": torch.ones(64)}, {"step": 3, "config": {"model": {}}, "world_size": 1}, keep=1)
"""


def test_a_kill_between_retentions_rename_and_unlink_leaks_nothing(tmp_path):
    """Retention renamed step_2 aside, then was killed before its manifest went: the whole hidden
    copy was kept by the sweep for good (a hostile review, 2026-12-03). ``.removing-`` is always swept."""
    import sys

    from tests.child import Child

    root = tmp_path / "checkpoints"
    script = tmp_path / "kill.py"
    script.write_text(KILLED_AFTER_ASIDE)
    with Child([sys.executable, script, root]) as child:
        assert child.wait(120) == -9, child.output()
    assert ".removing-step_0000002" in names(root) and checkpoint.latest_valid(root) == root / "step_0000003"
    save(root, 4, keep=1)
    assert names(root) == ["step_0000004"]
