"""Every command that reads a file, handed a damaged one (issue 24): random bytes, a truncated
valid file, valid JSON/TOML/YAML of the wrong types, an empty file, a folder where a file belongs,
an unreadable path; and every destination flag handed a place it cannot write (/proc, a folder, a
missing folder). Each case runs ``luban.cli.main`` in-process with captured output and must end
with exit 2 and exactly one ``luban: error:`` line, no traceback, and no file changed. (A damaged
file that is still a valid input, e.g. a TOML cut at a line end, may run: exit 0, nothing on
stderr.) ``test_totals`` prints the case counts (run with -s) and checks there were >= 250."""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from luban.cli import main

TOTALS: collections.Counter = collections.Counter()
KINDS = ("bytes", "truncated", "wrong-types", "empty", "folder", "unreadable")
PLAN = ["--system", "dgx-a100-80g", "--gpus", "8", "--global-batch", "8"]
SYSTEM = (Path(__file__).resolve().parents[1] / "luban/plan/systems/dgx-a100-80g.toml").read_text()
MODEL = {"hidden": 64, "layers": 2, "heads": 2, "vocab": 1000, "seq_len": 128}


def _toml(table: dict) -> str:
    """A tiny TOML writer for the fuzz's tables (values: str/int/float/bool/list, sub-tables)."""
    def lit(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, float):
            return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(repr(v), repr(v))
        if isinstance(v, list):
            return "[" + ", ".join(lit(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {lit(x)}" for k, x in v.items()) + "}"
        return str(v)
    flat = [f"{json.dumps(k)} = {lit(v)}" for k, v in table.items() if not isinstance(v, dict)]
    subs = [f"[{json.dumps(k)}]\n" + "\n".join(f"{json.dumps(kk)} = {lit(vv)}" for kk, vv in v.items())
            for k, v in table.items() if isinstance(v, dict)]
    return "\n".join(flat + subs) + "\n"


WRONG = st.one_of(st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=True, allow_infinity=True),
                  st.text(max_size=6), st.booleans(), st.lists(st.integers(-3, 3), max_size=3),
                  st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2))


# -- the commands and their valid files ------------------------------------------------------------
class Target:
    """``argv(path, work)``: the command with the file at ``path``; ``valid(work)``: a valid file's
    text; ``fmt``: json/toml/yaml/jsonl, for the wrong-types variant; ``where``: the file's name
    inside a folder argument (a dataset's manifest), or None when the argument is the file."""

    def __init__(self, name, argv, valid, fmt, suffix="", where=None, may_run=False):
        self.name, self.argv, self.valid, self.fmt, self.suffix = name, argv, valid, fmt, suffix
        self.where, self.may_run = where, may_run


def _trace(work: Path) -> str:
    return "".join(json.dumps({"id": i, "submit": 10.0 * i, "user": "u", "nodes": 1, "duration": 60.0,
                               "priority": 2, "checkpointable": True}) + "\n" for i in range(3))


def _dataset_manifest(work: Path) -> str:
    return (work / "ds" / "manifest.json").read_text()


def _ckpt_meta(work: Path) -> str:
    return (work / "ckpt" / "meta.json").read_text()


TARGETS = [
    Target("plan estimate --model (json)", lambda p, w: ["plan", "estimate", "--model", p, *PLAN],
           lambda w: json.dumps(MODEL), "json", ".json", may_run=True),
    Target("plan estimate --model (toml)", lambda p, w: ["plan", "estimate", "--model", p, *PLAN],
           lambda w: _toml({"model": MODEL}), "toml", ".toml", may_run=True),
    Target("plan search --model", lambda p, w: ["plan", "search", "--model", p, *PLAN],
           lambda w: json.dumps(MODEL), "json", ".json", may_run=True),
    Target("plan estimate --system", lambda p, w: ["plan", "estimate", "--model", "gpt2-124m", "--system", p,
                                                   "--gpus", "8", "--global-batch", "8"],
           lambda w: SYSTEM, "toml", ".toml", may_run=True),
    Target("train CONFIG", lambda p, w: ["train", p, "--set", f"run.dir={json.dumps(str(w / 'run'))}"],
           lambda w: _toml({"model": {"preset": "tiny"}, "train": {"steps": 1}}), "toml", ".toml"),
    Target("cluster simulate --trace", lambda p, w: ["cluster", "simulate", "--trace", p], _trace, "jsonl",
           ".jsonl", may_run=True),
    Target("submit JOB.yaml", lambda p, w: ["submit", "--url", "http://127.0.0.1:9", "--token", "x", p],
           lambda w: "name: fuzz\ncommand: 'true'\n", "yaml", ".yaml"),
    Target("data info (manifest)", lambda p, w: ["data", "info", p.parent], _dataset_manifest, "json",
           where="manifest.json"),
    Target("data verify (manifest)", lambda p, w: ["data", "verify", p.parent], _dataset_manifest, "json",
           where="manifest.json"),
    Target("sample (meta.json)", lambda p, w: ["sample", p.parent], _ckpt_meta, "json", where="meta.json"),
    Target("export (meta.json)", lambda p, w: ["export", p.parent, w / "hf"], _ckpt_meta, "json",
           where="meta.json"),
]
DESTINATIONS = {  # a flag that names where to write -> (argv, "file" or "dir")
    "plan search --chart": (lambda d, w: ["plan", "search", "--model", "gpt2-124m", *PLAN, "--chart", d], "file"),
    "plan probe --out": (lambda d, w: ["plan", "probe", "--out", d], "file"),
    "cluster trace -o": (lambda d, w: ["cluster", "trace", "--jobs", "3", "-o", d], "file"),
    "plan study --out": (lambda d, w: ["plan", "study", "seed003", "--out", d], "dir"),
    "export OUT": (lambda d, w: ["export", w / "ckpt", d], "dir"),
    "import OUT": (lambda d, w: ["import", w / "ds", d], "dir"),
    "data build --out": (lambda d, w: ["data", "build", "--out", d, w / "afile"], "dir"),
}
BAD_PLACES = {"dir": ["/proc/luban-fuzz/x", "/proc/x", "/sys/x", "{w}/afile/x", "/proc/self/x"],
              "file": ["/proc/luban-fuzz/x.png", "/proc/x.png", "/sys/x.png", "{w}/afile/x.png",
                       "{w}/missing/dir/x.png", "{w}/adir", "/proc/self/x.png"]}


@pytest.fixture(scope="module")
def template(tmp_path_factory, small_dataset):
    """A folder with a dataset, a checkpoint-shaped folder (meta.json + manifest) and plain files."""
    root = tmp_path_factory.mktemp("file-fuzz")
    shutil.copytree(small_dataset, root / "ds")
    ckpt = root / "ckpt"
    ckpt.mkdir()
    meta = {"step": 1, "config": {"model": {"preset": "tiny"} | MODEL}, "world_size": 1}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    _sign(ckpt)
    (root / "afile").write_text("x\n")
    (root / "adir").mkdir()
    return root


def _sign(ckpt: Path) -> None:
    """A manifest consistent with the folder's files (as a save writes it), so a damaged meta.json
    reaches the code that reads it instead of failing the CRC check."""
    files = {f.name: {"bytes": f.stat().st_size, "crc32": zlib.crc32(f.read_bytes()) & 0xFFFFFFFF}
             for f in sorted(ckpt.iterdir()) if f.is_file() and f.name != "manifest.json"}
    (ckpt / "manifest.json").write_text(json.dumps({"files": files}))


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else "dir")
            for p in sorted(root.rglob("*")) if not p.is_symlink()}


def run(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as done:  # argparse's --help; usage errors return 2 through Parser.error
            code = done.code
    return code, out.getvalue(), err.getvalue()


def wrong_types(data, target: Target, source: Path) -> str:
    """Valid syntax, wrong content: a non-table at the top, a key set to a value of another type,
    a whole section replaced by a scalar."""
    valid = target.valid(source)
    if target.fmt == "jsonl":
        rows = [json.loads(line) for line in valid.splitlines()]
        row = data.draw(st.integers(0, len(rows) - 1))
        key = data.draw(st.sampled_from(sorted(rows[row])))
        rows[row][key] = data.draw(WRONG.filter(lambda v: type(v) is not type(rows[row][key])))
        return "".join(json.dumps(r) + "\n" for r in rows)
    if target.fmt == "yaml":
        return data.draw(st.sampled_from(["- 1\n- 2\n", "5\n", "name: [1, 2]\ncommand: true\n",
                                          "name: x\ncommand: {a: 1}\n", "name: x\ncommand: 'true'\nenv: [1]\n",
                                          "name: x\ncommand: 'true'\nnodes: -3\n", "'x'\n"]))
    table = json.loads(valid) if target.fmt == "json" else __import__("tomllib").loads(valid)
    how = data.draw(st.sampled_from(["top", "key", "section"]))
    if how == "top":
        top = data.draw(st.one_of(st.lists(st.integers(), max_size=3), st.integers(), st.text(max_size=5),
                                  st.just({}), st.none()))
        return json.dumps(top) if target.fmt == "json" else _toml({"x": top} if top is not None else {})
    section = data.draw(st.sampled_from(sorted(table)))
    if how == "section" or not isinstance(table[section], dict):
        table[section] = data.draw(WRONG.filter(lambda v: type(v) is not type(table[section])))
    else:
        holder = table[section]
        key = data.draw(st.sampled_from(sorted(holder)))
        holder[key] = data.draw(WRONG.filter(lambda v: type(v) is not type(holder[key])))
    return json.dumps(table) if target.fmt == "json" else _toml(table)


def damage(data, target: Target, path: Path, work: Path, source: Path) -> str:
    kind = data.draw(st.sampled_from(KINDS))
    if kind == "folder":
        path.mkdir()
        (path / "x").write_text("x")
        return kind
    if kind == "unreadable":  # a name that is not a readable regular file: dangling link, kernel file
        choice = data.draw(st.sampled_from(["dangling", "proc"]))
        if choice == "dangling" or target.where:
            path.symlink_to(work / "no-such-target")
        else:
            return "unreadable:/proc/self/mem"
        return kind
    valid = target.valid(source)
    if kind == "bytes":
        body = data.draw(st.binary(min_size=1, max_size=64))
    elif kind == "truncated":
        cut = data.draw(st.integers(0, max(0, len(valid.encode()) - 1)))
        body = valid.encode()[:cut]
    elif kind == "empty":
        body = b""
    else:
        body = wrong_types(data, target, source).encode()
    path.write_bytes(body)
    return kind


@settings(max_examples=220, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(data=st.data())
def test_damaged_files_are_one_line_errors_and_change_nothing(template, data):
    target = data.draw(st.sampled_from(TARGETS), label="target")
    work = Path(tempfile.mkdtemp(prefix="fz-", dir=template.parent))
    try:
        for name in ("ds", "ckpt", "adir", "afile"):
            (shutil.copytree if (template / name).is_dir() else shutil.copy)(template / name, work / name)
        if target.where:
            folder = work / ("ds" if target.where == "manifest.json" else "ckpt")
            path = folder / target.where
            path.unlink()
        else:
            path = work / f"input{target.suffix}"
        kind = damage(data, target, path, work, template)
        if kind.startswith("unreadable:"):
            path, kind = Path(kind.split(":", 1)[1]), "unreadable"
        elif target.where == "meta.json" and data.draw(st.booleans(), label="re-sign the checkpoint"):
            _sign(path.parent)  # as if saved so: the damage reaches meta.json's reader
        before = snapshot(work)
        if target.name == "train CONFIG":  # still a valid config: it would train; only the check is run
            from luban.config import load_config
            from luban.errors import LubanError

            with contextlib.suppress(LubanError):
                load_config(path, [f"run.dir={json.dumps(str(work / 'run'))}"])
                TOTALS[(target.name, kind, "valid")] += 1
                return
        code, out, err = run(target.argv(path, work))
        TOTALS[(target.name, kind, code)] += 1
        assert "Traceback" not in err, (target.name, kind, err)
        if code == 0 and target.may_run and kind in ("truncated", "wrong-types") and err == "":
            return  # still a valid input (a TOML cut at a line end, a value the type allows)
        assert code == 2, (target.name, kind, code, out, err)
        assert err.startswith("luban: error: ") and err.count("\n") == 1 and err.endswith("\n"), (target.name, kind, err)
        assert snapshot(work) == before, (target.name, kind)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("name", list(DESTINATIONS))
def test_unwritable_destinations_are_one_line_errors(template, name):
    argv, kind = DESTINATIONS[name]
    before = snapshot(template)
    for place in BAD_PLACES[kind]:
        dest = place.format(w=template)
        code, out, err = run(argv(dest, template))
        TOTALS[(name, "destination", code)] += 1
        assert code == 2, (name, dest, code, err)
        assert err.startswith("luban: error: ") and err.count("\n") == 1, (name, dest, err)
        assert "Traceback" not in err
        assert snapshot(template) == before, (name, dest)


def test_totals(capsys):
    """Run last (file order): the counts of the cases above, by command, damage and exit code."""
    cases = sum(TOTALS.values())
    with capsys.disabled():
        by_kind = collections.Counter()
        for (target, kind, code), n in TOTALS.items():
            by_kind[(kind, str(code))] += n
        print(f"\nfile fuzz: {cases} cases; by damage and exit: "
              + ", ".join(f"{k} exit {c}: {n}" for (k, c), n in sorted(by_kind.items())))
        for (target, kind, code), n in sorted(TOTALS.items(), key=str):
            print(f"  {target:32s} {kind:12s} exit {code}: {n}")
    if os.environ.get("PYTEST_XDIST_WORKER") is None and cases:
        assert cases >= 250, cases
