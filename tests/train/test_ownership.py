"""luban's folder rule (luban/owned.py) for runs, HF exports and imports, end to end through the CLI:
a folder luban did not make is refused untouched with one line, exit 2; luban's own is reused;
nothing luban writes deletes what it did not write (issue 24's data-loss cases)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from .conftest import luban


def _sets(overrides):
    return sum((["--set", s] for s in overrides), [])


def snapshot(root: Path) -> dict:
    """Every path under ``root`` with its mode and content hash: equal snapshots = untouched."""
    out = {".": root.stat().st_mode}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = (p.stat().st_mode, hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None)
    return out


def one_line_refusal(proc, *words) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("luban: error: "), proc.stderr
    assert all(w in lines[0] for w in words), lines[0]


@pytest.fixture(scope="module")
def trained(small_dataset, tmp_path_factory):
    """A finished tiny run (one checkpoint) and its HF export."""
    from .conftest import tiny_overrides

    base = tmp_path_factory.mktemp("own")
    luban("train", *_sets(tiny_overrides(small_dataset, base / "run", **{"train.steps": 2, "train.eval_every": 0})),
          check=0)
    luban("export", base / "run", "--format", "hf", base / "hf", check=0)
    return base


def test_a_run_folder_is_marked_and_a_marker_less_run_is_still_luban_s(trained):
    from luban import owned

    run = trained / "run"
    assert owned.marked_kind(run) == "run" and owned.marked_kind(trained / "hf") == "hf-export"
    legacy = trained / "legacy-run"
    shutil.copytree(run, legacy)
    (legacy / owned.MARKER).unlink()  # as written by luban before the marker
    assert owned.owner(legacy) == "run"
    owned.check(legacy, "run", "run.dir")


def test_import_into_a_run_with_checkpoints_is_refused_and_deletes_nothing(trained, tmp_path):
    """Issue 24: importing into runs/victim (checkpoints 100/200/300) deleted 100, 200 and the
    imported step 0 (retention keep = 1)."""
    victim = tmp_path / "victim"
    step = next((trained / "run" / "checkpoints").glob("step_*"))
    for s in (100, 200, 300):
        shutil.copytree(step, victim / "checkpoints" / f"step_{s:07d}")
    (victim / "metrics.jsonl").write_text('{"step": 300}\n')
    before = snapshot(victim)
    proc = luban("import", trained / "hf", victim)
    one_line_refusal(proc, "OUT", str(victim), "already holds a run", "nothing was changed")
    assert snapshot(victim) == before

    from luban import owned

    fresh = tmp_path / "fresh"
    proc = luban("import", trained / "hf", fresh, check=0)
    assert (fresh / "checkpoints" / "step_0000000").is_dir() and owned.marked_kind(fresh) == "run"


def test_a_fresh_start_into_a_run_with_checkpoints_is_refused_and_changes_nothing(trained, tmp_path, small_dataset):
    """`luban train` without --resume into a run folder with checkpoints (a forgotten flag, a rerun of
    the demo) trained a new run there: it saved over the old run's equal-numbered checkpoints, pruned
    the rest under its retention, and --resume auto then continued a mix of the two runs (found
    2026-11-27: steps 3, 4 of run A beside step 2 of run B). Refused now, nothing changed; with
    --resume auto it continues."""
    from .conftest import tiny_overrides

    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    before = snapshot(run)
    sets = _sets(tiny_overrides(small_dataset, run, **{"train.steps": 3, "train.eval_every": 0,
                                                       "train.checkpoint_every": 1}))
    proc = luban("train", *sets)
    one_line_refusal(proc, f"run.dir = '{run}': already holds a run (1 checkpoint(s), the newest step_0000002); "
                           "continue it with --resume auto, or choose a new run.dir (nothing was changed)")
    assert snapshot(run) == before
    proc = luban("train", *sets, "--nproc", "2")  # the launcher refuses too, before any rank starts
    one_line_refusal(proc, "already holds a run")
    assert snapshot(run) == before
    assert "resumed from" in luban("train", *sets, "--resume", "auto", check=0).stdout
    assert (run / "checkpoints" / "step_0000003").is_dir()


def test_a_second_demo_into_the_first_ones_folder_is_refused(trained, tmp_path, small_dataset):
    """`luban demo` twice (README's first command) trained its first half fresh into the first demo's
    run, then --resume auto took the first demo's last checkpoint: the second half never ran. Now
    one line naming a new folder, nothing changed."""
    from .conftest import tiny_overrides

    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    before = snapshot(run)
    proc = luban("demo", "--nproc", "2", *_sets(tiny_overrides(small_dataset, run, **{"train.steps": 2})))
    one_line_refusal(proc, f"run.dir = '{run}': holds an earlier run (newest step_0000002); run this demo into a "
                           f"new folder (luban demo --set run.dir='\"{run}-2\"') or remove that one")
    assert snapshot(run) == before


def test_import_refuses_a_folder_of_other_files(trained, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    before = snapshot(theirs)
    one_line_refusal(luban("import", trained / "hf", theirs), "OUT", "'notes.txt'", "luban did not write")
    assert snapshot(theirs) == before


def test_a_full_disk_during_an_export_is_one_line_and_exit_74(trained, tmp_path):
    """safetensors reports a failed write as its own SafetensorError, not an OSError: it reached the
    user as a traceback (a hostile sweep, 2026-11-27). EFBIG past a file-size limit stands in for a
    full disk (CPython ignores SIGXFSZ); no temp file is left."""
    import resource

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    out = luban("export", trained / "run", "--format", "hf", tmp_path / "hf", preexec_fn=small_files)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 74 and len(lines) == 1 and lines[0].startswith("luban: error: OUT = "), out.stderr
    assert "could not be written" in lines[0]
    assert not [p for p in (tmp_path / "hf").iterdir() if p.name != ".luban"]


def test_a_full_disk_during_an_import_says_import_again(trained, tmp_path):
    """It said "the previous checkpoint is intact ... resume with --resume auto": an import has neither."""
    import resource

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    out = luban("import", trained / "hf", tmp_path / "run", preexec_fn=small_files)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 74 and len(lines) == 1, out.stderr
    assert lines[0] == f"luban: error: OUT = '{tmp_path / 'run'}': the imported checkpoint could not be written " \
                       "(File too large); free space or choose another folder, then import again", lines[0]
    assert not list((tmp_path / "run" / "checkpoints").iterdir())


def test_export_never_overwrites_a_users_folder(trained, tmp_path):
    """Issue 24: export into a folder holding the user's own config.json and model.safetensors
    overwrote both."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    (theirs / "config.json").write_text('{"mine": true}')
    (theirs / "model.safetensors").write_bytes(b"my weights")
    before = snapshot(theirs)
    one_line_refusal(luban("export", trained / "run", "--format", "hf", theirs), "OUT", "luban did not write")
    assert snapshot(theirs) == before
    # luban's own export folder is rewritten; a run folder is luban's, but not an export
    luban("export", trained / "run", "--format", "hf", trained / "hf", check=0)
    one_line_refusal(luban("export", trained / "run", "--format", "hf", trained / "run"),
                     "is luban's folder for a training run, not a Hugging Face export")


def test_train_refuses_a_run_dir_of_other_files(small_dataset, tmp_path):
    """Issue 24: run.dir a folder of other files: the user's config.json was overwritten and
    metrics.jsonl appended to."""
    from .conftest import tiny_overrides

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text('{"my": "config"}')
    (theirs / "metrics.jsonl").write_text('{"my": 1}\n')
    before = snapshot(theirs)
    proc = luban("train", *_sets(tiny_overrides(small_dataset, theirs, **{"train.steps": 1})))
    one_line_refusal(proc, "run.dir", str(theirs), "luban did not write", "nothing was changed")
    assert snapshot(theirs) == before
    # the same through `luban demo` (same start-up check), and a dataset folder is not a run
    proc = luban("demo", *_sets(tiny_overrides(small_dataset, theirs, **{"train.steps": 2})))
    one_line_refusal(proc, "run.dir", "luban did not write")
    proc = luban("train", *_sets(tiny_overrides(small_dataset, small_dataset, **{"train.steps": 1})))
    one_line_refusal(proc, "run.dir", "luban's folder for a dataset, not a training run")
    assert snapshot(theirs) == before


def test_sample_names_a_data_folder_that_is_not_a_dataset(trained, tmp_path):
    """--data pointing at plain texts said 'the dataset the run trained on is gone' (a hostile sweep)."""
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("hello")
    one_line_refusal(luban("sample", trained / "run", "--data", tmp_path / "texts", "--tokens", "4"),
                     "--data = ", "a luban dataset (a folder with manifest.json")


def test_an_import_into_a_folder_a_run_or_import_is_using_is_refused(trained, tmp_path):
    """(2026-12-04) Two imports into one new folder at once each saved a step_0000000 there (and an import
    into a folder a run was starting in joined it): an import now holds the run folder's lock, as a run does."""
    import subprocess
    import sys

    from luban import owned

    out = tmp_path / "new"
    owned.claim(out, "run", "OUT")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom luban.train.rundir import lock_run_dir\n"
                               "lock_run_dir(sys.argv[1]); print('held', flush=True); time.sleep(120)", str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = luban("import", trained / "hf", out)
        one_line_refusal(proc, "OUT", str(out), "another luban train (or import) is using this folder now")
        assert not (out / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    proc = luban("import", trained / "hf", out, check=0)
    assert (out / "checkpoints" / "step_0000000").is_dir()
