"""Fixtures shared by the whole suite: a small packed dataset built once per session; the
``exclusive`` marker; the order in which pytest-xdist hands out test files.

The README's test command runs the suite on two pytest-xdist workers (``-n 2 --dist loadfile``:
a file's tests, and so its module fixtures, stay on one worker). Tests that share something
outside their tmp_path that two of them cannot use at once say so with
``@pytest.mark.exclusive("NAME")``: tests holding the same NAME never run at the same time,
on any worker (an flock on a file shared by this run's workers).
"""

import fcntl
import os
from contextlib import ExitStack
from pathlib import Path

import pytest

# One intra-op thread for torch in the test processes and every child they start (unless the caller
# set OMP_NUM_THREADS; luban.parallel.launch gives oversubscribed ranks one already). The tests'
# models are tiny: a second OpenMP thread gains nothing, and while the other xdist worker's
# processes want the core it spins and waits for it. Measured on the 2-core CI machine under load,
# three 10-step tiny-llama runs took 2.7 s of CPU with one thread and 12-27 s with two.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# MFU's denominator on a CPU is measured: about 1 s of matmuls in every training process, and the
# suite starts a few hundred. A fixed 1 TFLOP/s (above any core here, so MFU stays in (0, 1]) spares
# that; the measured path keeps its own tests (test_truth's recorded-peak test, test_resume's RNG
# test, and test_resume_layouts, whose ranks measure as users' do).
os.environ.setdefault("LUBAN_PEAK_FLOPS", "1e12")

# The heaviest files first (seconds of a 2-core CI run, serial): xdist gives each worker the next
# file when it runs short, so the long ones start early and the short ones fill the end instead
# of one worker finishing a 4-minute file alone. Order only: every test still runs.
HEAVY_FIRST = [
    "tests/parallel/test_layouts.py",         # one 2-, 4- and 8-rank spawn of every layout (~290 s)
    "tests/train/test_auto.py",               # beside it, files of at most 4 ranks: two 8-rank spawns at once
    "tests/train/test_async_checkpoint.py",   # (this file and test_layouts_e2e's, 16 processes on 2 cores)
    "tests/plan/test_study.py",               # took 408 s and 420 s here on 2026-11-27, the suite 36 min
    "tests/train/test_compile.py",
    "tests/train/test_layouts_e2e.py",        # 8-rank suspend/resume (~140 s)
    "tests/train/test_resume_layouts.py",
    "tests/train/test_signals.py",
    "tests/train/test_cli.py",
    "tests/train/test_checkpoint_safety.py",
    "tests/cluster/test_trainer_e2e.py",
    "tests/parallel/test_expert_parallel.py",
    "tests/train/test_ownership.py",
    "tests/model/test_hf.py",
    "tests/test_cli_fuzz.py",
    "tests/bench/test_gpu_check.py",
]


def pytest_configure(config):
    config.addinivalue_line("markers", "exclusive(name): never runs at the same time as another test holding name")


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    root = Path(config.rootpath)

    def key(item):
        return rank.get(Path(item.path).relative_to(root).as_posix(), len(rank))

    items.sort(key=key)  # stable: within a file and among the rest, the collection order


@pytest.fixture(autouse=True)
def _exclusive(request, tmp_path_factory):
    names = sorted({m.args[0] for m in request.node.iter_markers("exclusive")})
    if not names:
        yield
        return
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's, not a worker's
    with ExitStack() as stack:
        for name in names:  # always in the same order: two tests never hold one lock each
            lock = stack.enter_context(open(shared / f"exclusive-{name}.lock", "a"))
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory) -> Path:
    """A byte-level dataset from a handful of standard-library sources (builds in ~1 s)."""
    import json
    import sysconfig

    from luban.data.build import build_dataset

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / name for name in ("json/decoder.py", "json/encoder.py", "textwrap.py", "shlex.py")]
    out = tmp_path_factory.mktemp("data") / "small"
    build_dataset([str(f) for f in files], out, tokenizer="byte")
    assert json.loads((out / "manifest.json").read_text())["tokenizer"]["kind"] == "byte"
    return out


def tiny_toml(run, train: dict, parallel: dict | None = None, run_keys: dict | None = None) -> str:
    """A config file for subprocess tests: a 1-layer, 32-wide tiny model on the embedded corpus."""
    import json

    def table(name, keys):
        return [f"[{name}]", *(f"{k} = {json.dumps(v)}" for k, v in keys.items())]

    lines = table("model", {"preset": "tiny", "layers": 1, "hidden": 32, "heads": 2}) + table("data", {"path": ""})
    lines += table("train", train) + (table("parallel", parallel) if parallel else [])
    return "\n".join(lines + table("run", {"dir": str(run), **(run_keys or {})})) + "\n"
