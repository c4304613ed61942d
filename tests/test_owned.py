"""luban/owned.py, the one rule for every output folder: absent, empty, or luban's own of the same
kind (the .luban marker, or an older luban's recognisable layout); anything else refused untouched
with one line. Commands that need torch are tested end to end in tests/train/test_ownership.py and
tests/cluster/test_service_errors.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from luban import owned
from luban.cli import main
from luban.errors import LubanError


def test_absent_and_empty_folders_are_claimed_and_marked(tmp_path):
    for path in (tmp_path / "a" / "b", tmp_path / "empty"):
        if path.name == "empty":
            path.mkdir()
        assert owned.owner(path) == "empty"
        owned.claim(path, "run", "run.dir")
        assert owned.marked_kind(path) == "run" and json.loads((path / ".luban").read_text()) == {"luban": "run"}
        owned.claim(path, "run", "run.dir")  # its own: again


@pytest.mark.parametrize("kind", sorted(owned.KINDS))
def test_foreign_folders_files_and_other_kinds_are_refused_untouched(tmp_path, kind):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(LubanError, match=r"^KEY = '.*theirs': holds 'notes.txt', which luban did not write"):
        owned.claim(theirs, kind, "KEY")
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(LubanError, match="not a file"):
        owned.claim(tmp_path / "file", kind, "KEY")
    other = "dataset" if kind != "dataset" else "run"
    owned.claim(tmp_path / other, other, "KEY")
    with pytest.raises(LubanError, match=f"is luban's folder for {owned.KINDS[other]}, not {owned.KINDS[kind]}"):
        owned.claim(tmp_path / other, kind, "KEY")
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / ".luban").write_text("not json")
    with pytest.raises(LubanError, match="which luban did not write"):
        owned.claim(forged, kind, "KEY")


def test_folders_of_an_older_luban_are_recognised_by_layout(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_0000100").mkdir(parents=True)
    (run / "checkpoints" / "step_0000100" / "meta.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    assert owned.owner(run) == "run"
    crashed = tmp_path / "crashed"  # no checkpoint yet: luban's own config.json proves it
    crashed.mkdir()
    (crashed / "config.json").write_text(json.dumps({k: {} for k in ("model", "data", "train", "parallel", "run")}))
    assert owned.owner(crashed) == "run"
    users = tmp_path / "users"  # a config.json that is not a luban run's
    users.mkdir()
    (users / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    (users / "model.safetensors").write_bytes(b"")
    assert owned.owner(users) is None  # and an HF export has no legacy form: it looks like this
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    (state / "luban.db").write_bytes(b"")
    (state / "admin.token").write_text("t\n")
    assert owned.owner(state) == "cluster-state"
    (state / "notes.txt").write_text("")
    assert owned.owner(state) is None


def test_data_build_uses_the_rule(tmp_path, capsys):
    from luban.data.build import build_dataset

    src = tmp_path / "doc.txt"
    src.write_text("hello world\n" * 50)
    out = tmp_path / "ds"
    build_dataset([str(src)], out, val_fraction=0)
    assert owned.marked_kind(out) == "dataset"
    build_dataset([str(src)], out, val_fraction=0)  # its own: rebuilt
    (out / ".luban").unlink()  # an older luban's dataset: still rebuilt
    build_dataset([str(src)], out, val_fraction=0)
    assert owned.marked_kind(out) == "dataset"
    run = tmp_path / "run"
    owned.claim(run, "run", "run.dir")
    assert main(["data", "build", str(src), "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("luban: error: --out = ") and "luban's folder for a training run, not a dataset" in err
    assert [p.name for p in run.iterdir()] == [".luban"]


def test_a_folder_holding_only_a_users_manifest_json_is_not_a_dataset(tmp_path, capsys):
    """A web app's manifest.json alone in a folder looked like a dataset an older luban wrote (by its
    name), so ``luban data build --out`` replaced the folder and the user's file was gone."""
    src = tmp_path / "doc.txt"
    src.write_text("hello world\n" * 50)
    app = tmp_path / "pwa"
    app.mkdir()
    (app / "manifest.json").write_text('{"name": "my app", "start_url": "/"}')
    assert owned.owner(app) is None
    assert main(["data", "build", str(src), "--out", str(app)]) == 2
    assert "holds 'manifest.json', which luban did not write" in capsys.readouterr().err
    assert [p.name for p in app.iterdir()] == ["manifest.json"]
    assert json.loads((app / "manifest.json").read_text())["name"] == "my app"


def test_plan_study_refuses_a_foreign_out_folder(tmp_path, capsys):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "results.json").write_text("{}")
    (theirs / "paper.tex").write_text("mine")
    assert main(["plan", "study", "seed003", "--out", str(theirs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out = " in err[0] and "'paper.tex', which luban did not write" in err[0]
    assert sorted(p.name for p in theirs.iterdir()) == ["paper.tex", "results.json"]
    from pathlib import Path

    committed = Path(__file__).resolve().parents[1] / "bench" / "results" / "seed003"
    assert owned.owner(committed) == "plan-study"  # written before the marker: luban's layout


def test_plan_study_refuses_a_folder_of_a_users_results_json(tmp_path, capsys):
    """(2026-12-04) A folder holding a ``results.json`` (and charts) was taken for a study by its file names
    alone: the study wrote its marker there and replaced the user's results. The file's form decides now."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "results.json").write_text('{"my": "experiment results"}')
    (theirs / "loss.png").write_bytes(b"\x89PNG mine")
    assert main(["plan", "study", "seed003", "--out", str(theirs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out = " in err[0] and "which luban did not write" in err[0], err
    assert sorted(p.name for p in theirs.iterdir()) == ["loss.png", "results.json"]
    assert (theirs / "results.json").read_text() == '{"my": "experiment results"}'


@pytest.mark.parametrize("argv", [
    ["plan", "search", "--model", "gpt2-124m", "--system", "dgx-h100", "--gpus", "8", "--global-batch", "8", "--chart", "{}"],
    ["plan", "probe", "--device", "cpu", "--out", "{}"],
    ["cluster", "trace", "--jobs", "10", "--nodes", "4", "-o", "{}"],
], ids=["plan-search-chart", "plan-probe-out", "cluster-trace-output"])
def test_file_outputs_never_overwrite_a_users_file(tmp_path, capsys, argv):
    """The three commands that write one file (a chart, a probed profile, a job trace) refuse a name
    that is taken, with one line, and leave the file as it was; a new name is written whole."""
    theirs = tmp_path / ("mine.png" if "--chart" in argv else "mine.toml" if "probe" in argv else "mine.jsonl")
    theirs.write_text("precious")
    assert main([a.format(theirs) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("luban: error: ") and "never overwrites a file" in err[0], err
    assert theirs.read_text() == "precious" and sorted(p.name for p in tmp_path.iterdir()) == [theirs.name]
    if "probe" in argv:
        return  # a probe of this machine takes seconds; its new-file write is the same create_bytes as below
    fresh = tmp_path / ("new" + theirs.suffix)
    assert main([a.format(fresh) for a in argv]) == 0 and fresh.stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([theirs.name, fresh.name])  # no temp left


def test_create_bytes_loses_a_race_without_replacing(tmp_path):
    """A file that appears between the check and the write is kept: the write fails instead."""
    from luban.data.atomic import create_bytes

    target = tmp_path / "out.toml"
    create_bytes(target, b"first")
    with pytest.raises(FileExistsError):
        create_bytes(target, b"second")
    assert target.read_bytes() == b"first" and [p.name for p in tmp_path.iterdir()] == ["out.toml"]


def test_a_luban_folder_holding_a_symbolic_link_is_refused(tmp_path):
    """A link in luban's own folder (a run's metrics.jsonl -> a user's file) would be written through:
    the folder is refused untouched, the user's file kept (a hostile sweep, 2026-11-27)."""
    run = owned.claim(tmp_path / "run", "run", "run.dir")
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (run / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(LubanError, match=r"holds 'metrics.jsonl', a symbolic link luban did not make"):
        owned.claim(run, "run", "run.dir")
    (run / "metrics.jsonl").unlink()
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "step_0000001").symlink_to(tmp_path)
    with pytest.raises(LubanError, match=r"holds 'checkpoints/step_0000001', a symbolic link"):
        owned.claim(run, "run", "run.dir")
    assert victim.read_text() == "mine"


def test_a_luban_folder_holding_a_named_pipe_or_socket_is_refused(tmp_path):
    """A named pipe at a name luban writes in its own run folder (config.json, plan.json) made the
    write wait for a reader forever (known since session 18): refused like a link, untouched."""
    import socket

    run = owned.claim(tmp_path / "run", "run", "run.dir")
    os.mkfifo(run / "plan.json")
    with pytest.raises(LubanError, match=r"holds 'plan.json', a named pipe luban did not make; remove it"):
        owned.claim(run, "run", "run.dir")
    (run / "plan.json").unlink()
    (run / "checkpoints").mkdir()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(run / "checkpoints" / "latest"))
        with pytest.raises(LubanError, match=r"holds 'checkpoints/latest', a socket luban did not make"):
            owned.claim(run, "run", "run.dir")
    (run / "checkpoints" / "latest").unlink()
    owned.claim(run, "run", "run.dir")  # regular files and folders only: its own again


def test_a_nul_character_in_a_folder_path_is_one_line(tmp_path):
    with pytest.raises(LubanError, match=r"^run\.dir = '.*\\x00x': a folder path without a NUL character"):
        owned.claim(f"{tmp_path}/\0x", "run", "run.dir")


@pytest.mark.parametrize("name", [owned.MARKER, "config.json"])
def test_a_named_pipe_in_a_folder_is_refused_not_waited_on(tmp_path, name):
    """A named pipe called .luban or config.json in --out (or run.dir) made the ownership check wait
    forever for a writer (a hostile sweep, 2026-11-27: `luban plan study --out`, `luban train` hung).
    A child process, so that the old behaviour fails the test at its timeout instead of hanging it."""
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / name)
    proc = subprocess.run([sys.executable, "-m", "luban", "plan", "study", "seed003", "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr == (
        f"luban: error: --out = '{out}': holds '{name}', which luban did not write; choose a new or empty "
        "folder, or one luban made for a planner study (nothing was changed)\n"), proc.stderr
    assert os.listdir(out) == [name]
