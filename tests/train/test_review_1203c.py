"""A resume on another dataset of as many samples went on silently (a hostile review, 2026-12-03):
the loader refuses a dataset of another size (``samples_per_epoch``), but one of the same size
and other text passed. Checkpoints now keep the dataset manifest's checksum, and a resume on a
dataset with another one says so (a note: switching data mid-run is a user's right, and a rebuild
with another shard size holds the same samples under another checksum)."""

from __future__ import annotations

from luban.data.build import build_dataset

from .conftest import luban, tiny_overrides


def _sets(values):
    return sum((["--set", v] for v in values), [])


def test_a_resume_on_another_dataset_of_the_same_size_is_named(tmp_path):
    datasets = []
    for name, letter in (("one", "a"), ("two", "b")):
        text = tmp_path / f"text-{name}"
        text.mkdir()
        for i in range(8):
            (text / f"{i}.txt").write_text(f"{letter} {i} " * 200)
        build_dataset([text], tmp_path / name, seed=1)
        datasets.append(tmp_path / name)
    run = tmp_path / "run"
    base = {"train.steps": 2, "train.checkpoint_every": 2, "train.eval_every": 0}
    luban("train", *_sets(tiny_overrides(datasets[0], run, **base)), check=0)
    same = luban("train", "--resume", "auto", *_sets(tiny_overrides(datasets[0], run, **{**base, "train.steps": 3})),
                 check=0)
    assert "the dataset is not the one" not in same.stdout, same.stdout
    other = luban("train", "--resume", "auto", *_sets(tiny_overrides(datasets[1], run, **{**base, "train.steps": 4})),
                  check=0)
    assert f"the dataset is not the one the checkpoint was trained on ({datasets[0]}: another manifest checksum): " \
           f"the run goes on at sample 12 of {datasets[1]}'s order" in other.stdout, other.stdout
