"""Every typed flag and argument of every ``luban`` command, fed values its declaration
(``luban.schema``) refuses: exit 2, one line ``luban: error: <key> = <value>: <allowed>``, no
traceback, nothing written. Then the concrete misbehaviours users hit (regressions)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luban import schema
from luban.cli import build_parser, main


def _typed(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser, action) for every argument with a ``type=`` in the whole tree."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _typed(sub, (*path, name))
        elif action.type is not None:
            yield path, parser, action


TYPED = list(_typed(build_parser()))
IDS = [" ".join(path) + " " + (action.option_strings[-1] if action.option_strings else action.dest)
       for path, _, action in TYPED]

# malformed in some way for some declaration; each case uses only those its declaration refuses
BAD = ["nan", "inf", "-inf", "-1", "0", "1e400", str(2**70), str(-2**70), "2**70", "", " ", "1.5", "abc",
       "\udcff", "a\x00b", "\u0663", "1:99:99", "bad/name", "user:", "missing/x", "afile", "adir", "afile/x",
       "/proc/luban-fuzz/x"]
VALID = ["1", "1024", "alice", "user:alice", "NORMAL", "adir", "afile"]  # to fill earlier positionals


def refuses(action, value: str) -> bool:
    try:
        action.type(value)
    except schema.Invalid:
        return True
    return False


def argv_for(path, parser, action, value: str) -> list[str]:
    if action.option_strings:
        return [*path, f"{max(action.option_strings, key=len)}={value}"]
    before = []
    for other in parser._positionals._group_actions:
        if other is action:
            break
        before.append(next(v for v in VALID if other.type is None or not refuses(other, v)))
    return [*path, *before, "--", value]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A current folder holding a file and a folder, for the path values; returns its snapshot."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    monkeypatch.chdir(tmp_path)
    return lambda: {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*")}


def run_in_process(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(argv, snapshot, before) -> str:
    code, out, err = run_in_process(argv)
    assert code == 2, (argv, out, err)
    assert err.endswith("\n") and err.count("\n") == 1 and err.startswith("luban: error: ") and " = " in err, (argv, err)
    assert "Traceback" not in err and not out, (argv, out, err)
    assert snapshot() == before, argv
    return err


def test_every_typed_argument_is_a_schema_declaration():
    assert len(TYPED) > 80  # the walk found the whole tree
    for path, _, action in TYPED:
        assert isinstance(getattr(action.type, "allowed", None), str), (path, action.dest)
        numeric = next((x for x in ("1", "1024") if not refuses(action, x)), None)
        if numeric is not None and not isinstance(action.type(numeric), str):  # a number: finite and bounded
            assert all(refuses(action, v) for v in ("nan", "-inf", str(2**70), str(-2**70))), (path, action.dest)


@pytest.mark.parametrize("case", range(len(TYPED)), ids=IDS)
def test_each_typed_argument_refuses_with_one_line(workdir, case):
    path, parser, action = TYPED[case]
    before = workdir()
    values = [v for v in BAD if refuses(action, v)]
    assert values, "no malformed value for " + IDS[case]
    key = max(action.option_strings, key=len) if action.option_strings else action.metavar or action.dest
    for value in values:
        err = assert_one_line_error(argv_for(path, parser, action, value), workdir, before)
        assert err.startswith(f"luban: error: {key} = "), err


NASTY = st.one_of(st.sampled_from(BAD), st.text(max_size=10), st.integers(-(1 << 80), 1 << 80).map(str),
                  st.floats(allow_nan=True, allow_infinity=True).map(repr))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.filter_too_much])
@given(st.data())
def test_fuzzed_arguments_are_one_line_errors_and_change_nothing(workdir, data):
    path, parser, action = data.draw(st.sampled_from(TYPED))
    value = data.draw(NASTY.filter(lambda v: refuses(action, v)))
    assert_one_line_error(argv_for(path, parser, action, value), workdir, workdir())


# -- regressions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,words", [
    (["data", "build", "--out", "/proc/luban-x", "afile"], "--out = '/proc/luban-x': a folder"),
    (["sample", "adir", "--temperature", "nan"], "--temperature = nan: 0, or a finite number from 0.001 to 100"),
    (["sample", "adir", "--temperature=-1"], "--temperature = -1.0"),
    (["sample", "adir", "--temperature", "inf"], "--temperature = inf"),
    (["sample", "adir", "--top-k=-1"], "--top-k = -1: an integer from 0 to"),
    (["sample", "adir", "--seed", "99999999999999999999999"], "--seed = 99999999999999999999999: an integer from 0"),
    (["sample", "adir", "--seed=-1"], "--seed = -1"),
    (["sample", "adir", "--prompt", "\udcff"], "--prompt = '\\udcff': UTF-8 text"),
    (["sample", "adir", "--tokens", "10000000000"], "--tokens = 10000000000: an integer from 1 to 65536"),
    (["sample", "adir", "--tokens"], "--tokens = (missing): an integer from 1 to 65536"),
    (["cluster", "serve", "--db", "nosuchdriver://x"], "--db = 'nosuchdriver://x': a file path, or a database URL"),
    (["cluster", "trace", "--seed=-1", "-o", "t.jsonl"], "--seed = -1"),
    (["cluster", "trace", "--jobs", "100000000000", "-o", "t.jsonl"], "--jobs = 100000000000: an integer from 1 to"),
    (["cluster", "simulate", "--zones", "1000000", "--nodes", "2"], "--zones = 1000000"),
    (["cluster", "simulate", "--zones", "3", "--nodes", "2"], "--zones = 3: an integer from 1 to --nodes = 2"),
    (["cluster", "serve", "--zones", "3", "--nodes", "2"], "--zones = 3: an integer from 1 to --nodes = 2"),
    (["submit", "-n", "99999999999999999999", "--", "true"], "--nodes = 99999999999999999999"),
    (["submit", "-t", "1:99:99", "--", "true"], "--time = '1:99:99': MINUTES, MM:SS"),
    (["admin", "quota", "set", "user:alice", "NORMAL", "--", "-1"], "nodes = -1: an integer from 0"),
    (["admin", "quota", "set", "alice", "NORMAL", "2"], "owner = 'alice': user:NAME or group:NAME"),
    (["admin", "quota", "set", "user:alice", "BOGUS", "2"], "priority = 'BOGUS': one of EXTREME_HIGH"),
    (["admin", "user", "add", ""], "name = '': a name matching"),
    (["admin", "user", "add", "bad/name"], "name = 'bad/name'"),
    (["stop", "1", "x"], "jobs = 'x': an integer from 1"),
    (["nosuch"], "COMMAND = 'nosuch': one of 'train', "),
])
def test_reported_inputs(workdir, argv, words):
    err = assert_one_line_error(argv, workdir, workdir())
    assert words in err, err


def test_nothing_is_created_for_a_bad_db(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "luban", "cluster", "serve", "--db", "nosuchdriver://x"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())


def test_a_real_user_sees_one_line_for_undecodable_bytes(tmp_path):
    """argv bytes that are not UTF-8 arrive as lone surrogates; they used to crash encode()."""
    proc = subprocess.run([sys.executable, "-m", "luban", "sample", str(tmp_path), "--prompt", b"\xff"],
                          capture_output=True, timeout=60, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err == "luban: error: --prompt = '\\udcff': UTF-8 text\n", err


def test_durations_follow_slurm_forms():
    from luban.cluster.cli import parse_duration

    assert [parse_duration(t) for t in ("90", "1:30", "30:00:00", "1-23:59:59")] == [5400, 90, 108000, 172799]
    for bad in ("1:99:99", "1:60", "1-24", "1-1:60", "\u0663", "400-0"):
        with pytest.raises(Exception, match="--time"):
            parse_duration(bad)


def test_sample_edges_on_a_real_run(small_dataset, tmp_path):
    """An empty prompt starts a new document; temperature 0 is greedy (the same text every
    seed); a top-k beyond the vocabulary samples among all tokens."""
    from tests.train.conftest import luban, tiny_overrides

    run = tmp_path / "run"
    sets = sum((["--set", s] for s in tiny_overrides(small_dataset, run, **{"train.steps": 1})), [])
    luban("train", *sets, check=0)
    greedy = [luban("sample", run, "--prompt", "", "--tokens", 8, "--temperature", 0, "--seed", seed, check=0).stdout
              for seed in (0, 1)]
    assert greedy[0] == greedy[1] and "--- sample 1" in greedy[0]
    assert "--- sample 1" in luban("sample", run, "--tokens", 8, "--top-k", 100000, check=0).stdout


def _sample_run(tmp_path, dataset, scale: float = 1.0, nan: bool = False) -> Path:
    """A one-layer run folder whose checkpoint names ``dataset``; its weights times ``scale``, or one NaN."""
    from luban.model.config import ModelConfig
    from luban.model.presets import get_preset
    from luban.model.transformer import build_model
    from luban.train import checkpoint

    cfg = ModelConfig.from_dict({**get_preset("tiny").to_dict(), "layers": 1, "vocab": 257})
    state = build_model(cfg, seed=3).state_dict()
    for tensor in {t.data_ptr(): t for t in state.values()}.values():  # a tied weight once
        tensor.mul_(scale)
    if nan:
        state["layers.0.attn.wq.weight"][0, 0] = float("nan")
    meta = {"step": 0, "config": {"model": cfg.to_dict()}, "world_size": 1, "dataset": str(dataset)}
    checkpoint.save(tmp_path / "run/checkpoints", 0, {"model": state}, meta, keep=1)
    return tmp_path / "run"


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_sample_refuses_a_diverged_checkpoint(small_dataset, tmp_path, capsys, temperature):
    """NaN weights (the trainer does not stop on a NaN loss), or finite ones so large that the logits
    overflow, gave torch.multinomial's RuntimeError traceback (or, greedy, tokens from NaN logits): a
    hostile sweep, 2026-11-27. One line, exit 2, as `luban export` says it."""
    run = _sample_run(tmp_path, small_dataset, nan=True)
    capsys.readouterr()
    assert main(["sample", str(run), "--tokens", "3", "--temperature", temperature]) == 2
    assert capsys.readouterr().err == (f"luban: error: CHECKPOINT = '{run}': its tensor layers.0.attn.wq.weight has "
                                       "1 NaN or infinite value: a diverged run; sample an earlier checkpoint\n")
    run = _sample_run(tmp_path / "huge", small_dataset, scale=1e30)
    assert main(["sample", str(run), "--tokens", "3", "--temperature", temperature]) == 2
    assert capsys.readouterr().err == (f"luban: error: CHECKPOINT = '{run}': its logits are not finite numbers "
                                       "(weights so large they overflow: a diverged run); sample an earlier checkpoint\n")


def test_sample_and_export_refuse_a_model_larger_than_memory(small_dataset, tmp_path, capsys, monkeypatch):
    """A checkpoint of a model bigger than this machine's memory (trained on a cluster) was built anyway:
    the allocator's RuntimeError traceback, or the kernel's OOM kill (a hostile sweep, 2026-11-27)."""
    from luban.train import memcheck

    run = _sample_run(tmp_path, small_dataset)
    monkeypatch.setattr(memcheck, "mem_available", lambda: 1 << 10)
    capsys.readouterr()
    for argv in (["sample", str(run), "--tokens", "1"], ["export", str(run), str(tmp_path / "out")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"luban: error: CHECKPOINT = '{run}': its model (tiny, 247,808 parameters) ") and err.endswith(
            "GiB of host memory in float32, but 0.0 GiB is available; read it on a machine with more memory\n"), err
    assert not (tmp_path / "out").exists()


def test_sample_escapes_a_models_control_codes_on_a_terminal(small_dataset, tmp_path, monkeypatch):
    """A model can generate any byte, ESC and BEL among them (a terminal escape sets the title, OSC 52
    writes the clipboard): on a terminal they are printed escaped; into a pipe or a file, as generated."""
    from luban.data.tokenizer import load_tokenizer
    from luban.train import sample

    text = "hi\x1b]52;c;ZWNobyBoaQ==\x07\tthere\n"
    ids = load_tokenizer(small_dataset).encode(text)
    monkeypatch.setattr(sample, "generate", lambda model, prompt, *args: prompt + ids)
    run = _sample_run(tmp_path, small_dataset)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, expected in ((io.StringIO(), text), (Terminal(), "hi\\x1b]52;c;ZWNobyBoaQ==\\x07\tthere\n")):
        with contextlib.redirect_stdout(stream):
            assert main(["sample", str(run), "--prompt", "", "--tokens", "1"]) == 0
        assert expected in stream.getvalue(), stream.getvalue()


def test_a_carriage_return_on_a_terminal_ends_a_line_or_is_shown_escaped():
    """Alone, a carriage return sends the cursor back: the words after it print over the line before
    (a job could hide what its log says). On a terminal it is shown escaped unless a line feed follows,
    also where a log read in chunks splits the pair; piped, it is as written."""
    from luban.errors import for_terminal, for_terminal_chunks

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert for_terminal("ok\r\nrm -rf done\rall is well\n", Terminal()) == "ok\nrm -rf done\\rall is well\n"
    assert "".join(for_terminal_chunks(["a\r", "\nb\r", "c\r"], Terminal())) == "a\nb\\rc\\r"
    assert "".join(for_terminal_chunks(["a\r", "\nb"], io.StringIO())) == "a\r\nb"


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False) | st.text(),
                    lambda inner: st.lists(inner, max_size=4), max_leaves=8))
def test_every_toml_luban_writes_reads_back_as_written(value):
    """One TOML writer (luban.config.toml_value) for the [parallel] block a plan prints and a probed
    profile: two had drifted apart (one wrote a bool as Python's True, the other a string unescaped)."""
    import tomllib

    from luban.config import parse_override, toml_value

    assert tomllib.loads(f"v = {toml_value(value)}")["v"] == value
    assert parse_override(f"train.x={toml_value(value)}")[2] == value


def test_an_error_line_shows_control_codes_escaped_on_a_terminal(tmp_path):
    """A folder's name can hold ESC (set the title, clear the screen, write the clipboard), and some
    errors name a path as it is: the one error line shows it escaped on a terminal, as it is into a
    pipe or a file."""
    folder = tmp_path / "run\x1b]0;pwned\x07"
    folder.mkdir()

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream in (Terminal(), io.StringIO()):
        with contextlib.redirect_stderr(stream):
            assert main(["data", "info", str(folder)]) == 2
        line = stream.getvalue()
        assert line.startswith("luban: error: ") and line.count("\n") == 1, line
        if isinstance(stream, Terminal):
            assert "\x1b" not in line and "run\\x1b]0;pwned\\x07" in line, repr(line)
        else:
            assert "run\x1b]0;pwned\x07" in line, repr(line)


def test_the_command_line_is_built_without_the_cluster_client():
    """2026-11-27: every `luban` process (training ranks included) imported luban.cluster.client, and
    with it httpx (~0.1 s of CPU), to build its command line; only the cluster commands and the SDK use
    it. `luban.cluster`'s names are imported when first used."""
    code = ("import sys; from luban.cli import build_parser; build_parser()\n"
            "print('httpx' in sys.modules)\n"
            "from luban.cluster import Client; print('httpx' in sys.modules, Client.__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "True", "Client"], proc.stdout
