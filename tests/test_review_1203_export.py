"""Hugging Face import/export and luban's folder rule, a hostile review of 2026-12-03.

- A Ctrl-C during ``luban export`` that the native safetensors write did not answer ended the
  process (the watchdog's forced exit) and left safetensors' own ``.tmpXXXXXX`` in OUT, as big as
  the model, for good: the export now removes the temporaries its write made, on a forced exit too.
- A Ctrl-C during ``luban import``'s checkpoint save was exit 74, "could not be written ...": the
  native writer turns the ``KeyboardInterrupt`` into a RuntimeError that DCP wraps; it is an
  interrupt (130) now, and the half-written folder goes.
- A link got round "nothing else inside a run folder" (``latest -> run/checkpoints``; export into
  ``latest/hf``); a folder left holding only the marker's temporary (a kill while marking) was
  refused for good as holding a file luban did not write.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from luban import interrupt, owned
from luban.errors import LubanError
from luban.model import hf
from luban.model.config import ModelConfig
from luban.model.transformer import build_model
from luban.train import checkpoint


@pytest.mark.parametrize("how", ["Ctrl-C", "forced exit"])
def test_an_interrupted_export_leaves_no_temporary(tmp_path, monkeypatch, how):
    cfg = ModelConfig.from_dict({"preset": "tiny"})
    out = tmp_path / "hf"
    owned.claim(out, "hf-export", "OUT")
    (out / ".tmpmine").write_text("a user's file")  # there before: not this export's

    def interrupted_save_file(tensors, filename, metadata=None):
        (Path(filename).parent / ".tmpa1B2c3").write_bytes(b"\0" * 1024)  # safetensors' own temporary
        if how == "forced exit":  # what the watchdog runs before os._exit(130)
            for cleanup in list(interrupt._STATE.cleanups.values()):
                cleanup()
            assert not (out / ".tmpa1B2c3").exists()
        raise KeyboardInterrupt

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted_save_file)
    with pytest.raises(KeyboardInterrupt):
        hf.export_folder(cfg, build_model(cfg, seed=0).state_dict(), out, record=True)
    assert sorted(p.name for p in out.iterdir()) == [".luban", ".tmpmine"]


def test_an_export_failing_before_its_write_keeps_a_users_temporaries(tmp_path, monkeypatch):
    """(2026-12-04) The names there before were taken only after the record's first write: when that
    write failed (a full disk), every ``.tmp*`` in OUT passed for safetensors' own and was deleted."""
    import errno

    cfg = ModelConfig.from_dict({"preset": "tiny"})
    out = tmp_path / "hf"
    owned.claim(out, "hf-export", "OUT")
    (out / ".tmpmine").write_text("a user's file")

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf, "_write_record", full_disk)
    with pytest.raises(hf.OutputWriteError, match="No space left"):
        hf.export_folder(cfg, build_model(cfg, seed=0).state_dict(), out, record=True)
    assert (out / ".tmpmine").read_text() == "a user's file"


@pytest.mark.parametrize("before", ["a new folder", "an earlier export"])
def test_an_interrupted_export_does_not_claim_a_file_put_there_afterwards(tmp_path, monkeypatch, before):
    """(2026-12-04) The record kept the interrupted write's ``model.safetensors`` as luban's, identity
    unknown: a user's file put there afterwards passed for luban's and the next export replaced it. The
    record is settled when an export stops: the earlier export's file (still there) keeps its identity."""
    import safetensors.torch

    cfg = ModelConfig.from_dict({"preset": "tiny"})
    state = build_model(cfg, seed=0).state_dict()
    out = tmp_path / "hf"
    owned.claim(out, "hf-export", "OUT")
    if before == "an earlier export":
        hf.export_folder(cfg, state, out, record=True)
    real = safetensors.torch.save_file

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hf.export_folder(cfg, state, out, record=True)
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    if before == "an earlier export":  # still luban's: the next export replaces it
        assert hf.export_folder(cfg, state, out, record=True)[0] == "model.safetensors"
        return
    (out / "model.safetensors").write_bytes(b"the user's weights")
    with pytest.raises(LubanError, match="holds 'model.safetensors', which luban did not write"):
        hf.export_folder(cfg, state, out, record=True)
    assert (out / "model.safetensors").read_bytes() == b"the user's weights"


KILLED_EXPORT = """
import os, signal, sys
from pathlib import Path
import safetensors.torch
from luban import owned
from luban.model import hf
from luban.model.config import ModelConfig
from luban.model.transformer import build_model

out = Path(sys.argv[1])
def killed_while_writing(tensors, filename, metadata=None):  # safetensors' own temporary, half written
    data = safetensors.torch.save(tensors, metadata=metadata)
    (Path(filename).parent / ".tmpQ7xZ2k").write_bytes(data[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)
safetensors.torch.save_file = killed_while_writing
cfg = ModelConfig.from_dict({"preset": "tiny"})
hf.export_folder(cfg, build_model(cfg, seed=0).state_dict(), out, record=True)
"""


@pytest.mark.parametrize("before", ["a new folder", "an earlier export"])
def test_a_kill_9_during_an_export_leaves_a_temporary_the_next_export_removes(tmp_path, before):
    """(2026-12-04) A kill -9 while safetensors wrote the weights left its ``.tmpXXXXXX``, as big as the
    model, for good (nothing runs on a kill -9). The record now says the weights are being written
    (by whom, since when, the ``.tmp*`` names there before); the next export removes a file that is
    safetensors' by name, time and header, and nothing else. And the file it was writing is luban's
    only if it is the one that was there (an earlier export's): a user's put there afterwards is kept."""
    import signal
    import subprocess
    import sys

    cfg = ModelConfig.from_dict({"preset": "tiny"})
    out = tmp_path / "hf"
    owned.claim(out, "hf-export", "OUT")
    import safetensors.torch

    weights = safetensors.torch.save({"w": torch.zeros(4)}, metadata={"format": "pt"})
    (out / ".tmpMine01").write_bytes(weights)  # a user's, there before: kept, safetensors or not
    if before == "an earlier export":
        hf.export_folder(cfg, build_model(cfg, seed=1).state_dict(), out, record=True)
    proc = subprocess.run([sys.executable, "-c", KILLED_EXPORT, str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (out / ".tmpQ7xZ2k").stat().st_size > 0
    (out / ".tmpLater1").write_text("a user's file, put there afterwards")  # not safetensors
    (out / ".tmpOlder1").write_bytes(weights)  # safetensors, but older than the export that was killed
    os.utime(out / ".tmpOlder1", ns=(0, 0))
    if before == "a new folder":  # a user's weights, put there after the kill: refused, kept
        (out / "model.safetensors").write_bytes(b"the user's weights")
        with pytest.raises(LubanError, match="holds 'model.safetensors', which luban did not write"):
            hf.export_folder(cfg, build_model(cfg, seed=0).state_dict(), out, record=True)
        assert (out / "model.safetensors").read_bytes() == b"the user's weights"
        (out / "model.safetensors").unlink()
    hf.export_folder(cfg, build_model(cfg, seed=0).state_dict(), out, record=True)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".tmp")) == [".tmpLater1", ".tmpMine01", ".tmpOlder1"]
    assert "writing" not in json.loads((out / ".luban").read_text())


def _two_models():
    from luban.data.tokenizer import ByteTokenizer

    gpt = ModelConfig.from_dict({"preset": "tiny"})
    llama = ModelConfig.from_dict({"preset": "tiny-llama"})
    return (gpt, build_model(gpt, seed=0).state_dict()), (llama, build_model(llama, seed=1).state_dict()), ByteTokenizer()


def _contents(out: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != ".luban"}


@pytest.mark.parametrize("at", ["model.safetensors", "tokenizer.json", "generation_config.json", "config.json"])
def test_a_re_export_interrupted_while_writing_leaves_the_earlier_export_whole(tmp_path, monkeypatch, at):
    """(2026-12-04) A re-export replaced model.safetensors first, then wrote the JSON files one by one: a
    Ctrl-C between left another model's config.json beside the new weights (transformers: a size-mismatch
    error), and a Ctrl-C inside a JSON file's fsync left its ``.NAME.tmp-PID`` for good. Now every file goes
    to a temporary first, then all are renamed in one step that a Ctrl-C does not cut."""
    import safetensors.torch

    (gpt, gpt_state), (llama, llama_state), tok = _two_models()
    out = tmp_path / "hf"
    owned.claim(out, "hf-export", "OUT")
    hf.export_folder(gpt, gpt_state, out, tokenizer=tok, record=True)
    before = _contents(out)
    real_save, real_write = safetensors.torch.save_file, hf._write_synced

    def save_file(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        if at == "model.safetensors":
            raise KeyboardInterrupt

    def write(path, data):
        real_write(path, data[: len(data) // 2])
        if path.name.startswith(f".{at}.tmp-"):
            raise KeyboardInterrupt
        real_write(path, data)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    monkeypatch.setattr(hf, "_write_synced", write)
    with pytest.raises(KeyboardInterrupt):
        hf.export_folder(llama, llama_state, out, tokenizer=tok, record=True)
    assert _contents(out) == before  # the earlier export, whole; no temporary
    monkeypatch.undo()
    hf.export_folder(llama, llama_state, out, tokenizer=tok, record=True)  # and it is still luban's to replace
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"


def test_a_ctrl_c_while_the_files_are_renamed_in_waits_for_all_of_them(tmp_path, monkeypatch):
    (gpt, gpt_state), (llama, llama_state), tok = _two_models()
    out = tmp_path / "hf"
    owned.claim(out, "hf-export", "OUT")
    hf.export_folder(gpt, gpt_state, out, tokenizer=tok, record=True)
    real_replace, seen = os.replace, []

    def replace(src, dst):
        if Path(dst).name == "model.safetensors":  # a Ctrl-C as the first file goes in (the handler
            interrupt._on_sigint(2, None)           # luban.interrupt installs, run by hand)
        seen.append(Path(dst).name)
        real_replace(src, dst)

    monkeypatch.setattr(interrupt._STATE, "interrupted_at", None)
    monkeypatch.setattr(interrupt._STATE, "pending", False)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        hf.export_folder(llama, llama_state, out, tokenizer=tok, record=True)
    monkeypatch.setattr(os, "replace", real_replace)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(seen)  # all went in, then the Ctrl-C
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]
    monkeypatch.setattr(interrupt._STATE, "interrupted_at", None)
    hf.export_folder(gpt, gpt_state, out, tokenizer=tok, record=True)  # the record says it is luban's


def test_export_and_import_show_the_folder_escaped_on_a_terminal(tmp_path, monkeypatch, capsys):
    """(2026-12-04) ``wrote OUT: ...`` printed OUT's bytes as they are: a folder named with escape
    sequences set a terminal's title or cleared it (every other line luban prints escapes them)."""
    from luban import errors
    from luban.cli import main

    cfg = ModelConfig.from_dict({"preset": "tiny"})
    meta = {"step": 0, "config": {"model": cfg.to_dict()}, "world_size": 1}
    checkpoint.save(tmp_path / "run/checkpoints", 0, {"model": build_model(cfg, seed=0).state_dict()}, meta, keep=1)
    monkeypatch.setattr(errors, "_isatty", lambda stream: True)
    out = tmp_path / "hf\x1b]0;TITLE\x07"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    assert main(["import", str(out), str(tmp_path / "back\x1b[2J")]) == 0
    printed = capsys.readouterr().out
    assert "\x1b" not in printed and "\\x1b]0;TITLE\\x07" in printed and "\\x1b[2J" in printed, printed


KILLED_RENAMING = """
import os, sys
from pathlib import Path
from luban.data.tokenizer import ByteTokenizer
from luban.model import hf
from luban.model.config import ModelConfig
from luban.model.transformer import build_model

out, at = Path(sys.argv[1]), int(sys.argv[2])
real, seen = os.replace, []
def replace(src, dst):
    seen.append(dst)
    if len(seen) == at:
        os._exit(137)  # as a kill -9 there
    real(src, dst)
os.replace = replace
cfg = ModelConfig.from_dict({"preset": "tiny-llama"})
hf.export_folder(cfg, build_model(cfg, seed=1).state_dict(), out, tokenizer=ByteTokenizer(), record=True)
"""


@pytest.mark.parametrize("at", [1, 2, 4, 8, 9])  # the note, its first rename, mid-way, the last, the final record
def test_a_kill_9_while_an_export_renames_its_files_in_leaves_a_folder_the_next_export_takes(tmp_path, at):
    """(2026-12-04) After a kill -9 between the first rename and the final record, every later export
    there was refused ('holds model.safetensors, which luban did not write': the note had only the
    identities of the files replaced) and its temporaries (also the marker's ``..luban.tmp-PID``)
    stayed for good. The note now holds the identities of the new files too (a rename keeps them)."""
    import subprocess
    import sys

    (gpt, gpt_state), _, tok = _two_models()
    out = tmp_path / "hf"
    owned.claim(out, "hf-export", "OUT")
    hf.export_folder(gpt, gpt_state, out, tokenizer=tok, record=True)
    proc = subprocess.run([sys.executable, "-c", KILLED_RENAMING, str(out), str(at)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 137, proc.stderr[-2000:]
    hf.export_folder(gpt, gpt_state, out, tokenizer=tok, record=True)
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"


@pytest.mark.parametrize("note", ['{"pid": Infinity, "since_ns": 0, "temporaries": []}',
                                  '{"pid": 4194303, "since_ns": 1e400, "temporaries": []}',
                                  '{"pid": 4194303, "since_ns": 0, "temporaries": 5, "was": [], "new": "x"}'])
def test_a_hand_edited_writing_note_is_no_traceback(tmp_path, note):
    cfg = ModelConfig.from_dict({"preset": "tiny"})
    out = tmp_path / "hf"
    owned.claim(out, "hf-export", "OUT")
    (out / ".luban").write_text('{"luban": "hf-export", "files": {}, "writing": %s}' % note)
    assert hf.export_folder(cfg, build_model(cfg, seed=0).state_dict(), out, record=True)[0] == "model.safetensors"


def test_a_users_file_named_as_an_exports_temporary_is_kept(tmp_path):
    """(2026-12-04) It was written over and renamed onto config.json (an export as PID 1 in a container
    and a user's ``.config.json.tmp-1``)."""
    cfg = ModelConfig.from_dict({"preset": "tiny"})
    out = tmp_path / "hf"
    owned.claim(out, "hf-export", "OUT")
    theirs = out / f".config.json.tmp-{os.getpid()}"
    theirs.write_text("USER DATA")
    with pytest.raises(LubanError, match=f"holds '{theirs.name}', which luban did not write"):
        hf.export_folder(cfg, build_model(cfg, seed=0).state_dict(), out, record=True)
    assert theirs.read_text() == "USER DATA" and sorted(p.name for p in out.iterdir()) == [".config.json.tmp-" +
                                                                                             str(os.getpid()), ".luban"]


def test_a_ctrl_c_inside_a_checkpoint_write_is_an_interrupt_not_a_storage_error(tmp_path, monkeypatch):
    real = checkpoint.dcp.save

    def ctrl_c_in_the_native_writer(*args, **kwargs):
        monkeypatch.setattr(interrupt._STATE, "interrupted_at", time.monotonic())
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint.dcp, "save", ctrl_c_in_the_native_writer)
    root = tmp_path / "checkpoints"
    meta = {"step": 0, "config": {"model": {}}, "world_size": 1}
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(root, 0, {"w": torch.zeros(8)}, meta, keep=1)
    assert list(root.iterdir()) == []  # the half-written folder went
    monkeypatch.setattr(checkpoint.dcp, "save", real)
    monkeypatch.setattr(interrupt._STATE, "interrupted_at", None)
    checkpoint.save(root, 0, {"w": torch.zeros(8)}, meta, keep=1)


def test_a_link_does_not_get_round_the_run_folder_rule(tmp_path):
    run = tmp_path / "run"
    owned.claim(run, "run", "run.dir")
    (run / "checkpoints").mkdir()
    (tmp_path / "latest").symlink_to(run / "checkpoints")
    with pytest.raises(LubanError) as refused:
        owned.claim(tmp_path / "latest" / "hf", "hf-export", "OUT")
    assert f"is inside {str(run)!r}, luban's folder for a training run" in str(refused.value), refused.value
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == []


def test_a_folder_holding_only_a_dead_start_s_marker_temporary_is_empty(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / ".luban.tmp-4194303").write_text('{"luban": "hf-e')  # a kill while marking (a pid no one has)
    assert owned.owner(folder) == "empty"
    owned.claim(folder, "hf-export", "OUT")
    assert sorted(p.name for p in folder.iterdir()) == [".luban"]  # the stale temporary went
    alive = folder.parent / "live"
    alive.mkdir()
    (alive / ".luban.tmp-1").write_text("")  # a live process's (pid 1 always is): not touched
    owned.mark(alive, "run")
    assert sorted(p.name for p in alive.iterdir()) == [".luban", ".luban.tmp-1"]


def test_a_second_export_into_a_folder_being_written_is_refused(tmp_path):
    """(2026-12-04) Two exports into one folder at once each wrote their 'writing' note over the other's
    (a kill -9 of one then left its temporaries for good). An export holds the folder's ``flock`` now: here
    another process holds it, as a running export does, and ``luban export`` refuses, changing nothing."""
    import fcntl
    import subprocess
    import sys

    cfg = ModelConfig.from_dict({"preset": "tiny"})
    out = tmp_path / "hf"
    owned.claim(out, "hf-export", "OUT")
    hf.export_folder(cfg, build_model(cfg, seed=1).state_dict(), out, record=True)
    before = _contents(out)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(120)", str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LubanError, match=r"^OUT = .*: another luban export is writing into this folder now"):
            hf.export_folder(cfg, build_model(cfg, seed=0).state_dict(), out, record=True)
        assert _contents(out) == before
    finally:
        holder.kill()
        holder.wait(timeout=30)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)  # the export gave its own lock back
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    hf.export_folder(cfg, build_model(cfg, seed=0).state_dict(), out, record=True)
    assert _contents(out) != before


def test_a_killed_exports_temporaries_go_though_its_pid_is_now_another_process(tmp_path):
    """(2026-12-04) A killed export's note and temporaries were kept for good while any process had its
    PID (a PID is reused: a long-lived one took it). The folder's lock says no export runs there."""
    cfg = ModelConfig.from_dict({"preset": "tiny"})
    out = tmp_path / "hf"
    owned.claim(out, "hf-export", "OUT")
    alive = os.getppid()  # a live process that is no export
    for name in (f".config.json.tmp-{alive}", f"..luban.tmp-{alive}"):
        (out / name).write_text("half written")
    (out / ".luban").write_text(json.dumps({"luban": "hf-export", "files": {}, "writing": {
        "pid": alive, "since_ns": time.time_ns(), "temporaries": [], "was": {}}}))
    hf.export_folder(cfg, build_model(cfg, seed=0).state_dict(), out, record=True)
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]
    assert "writing" not in json.loads((out / ".luban").read_text())
