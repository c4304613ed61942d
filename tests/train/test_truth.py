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


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_a_refused_run_leaves_no_run_folder(tiny, monkeypatch, capsys, tmp_path, nproc):
    """A run refused before training (here: it cannot fit) made its run.dir first, and left it behind
    holding luban's marker and an empty checkpoints/: every refusal now comes before the folder."""
    from luban import cli
    from luban.parallel import launch

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(launch, "launch", _no_engine)  # no rank may start
    sets = sum((["--set", s] for s in [*tiny(), *HUGE, "model.seq_len=128", f"parallel.dp={nproc}"]), [])
    assert cli.main(["train", "--nproc", nproc, *sets]) == 2
    assert capsys.readouterr().err.startswith("luban: error: memory: ")
    assert not (tmp_path / "run").exists()


def test_a_model_that_fits_is_not_refused(tiny):
    from luban.train.memcheck import check_fits, rank_bytes

    cfg = load_config(None, tiny())
    check_fits(cfg, 1, 1, "cpu")
    device, host = rank_bytes(cfg, 1)
    assert 0 < device < 1 << 30 and host == 0


# -- data verify and sample: the tokenizer is part of what training reads ------------------

@pytest.fixture(scope="module")
def bpe_datasets(tmp_path_factory):
    """Two BPE datasets with the same vocabulary size and different merges."""
    import sysconfig
    from pathlib import Path

    from luban.data.build import build_dataset

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root = tmp_path_factory.mktemp("bpe")
    for name, files in (("a", ["textwrap.py", "shlex.py"]), ("b", ["json/decoder.py", "json/encoder.py"])):
        build_dataset([str(stdlib / f) for f in files], root / name, tokenizer="bpe", vocab_size=300)
    return root / "a", root / "b"


def _verify(path):
    from .conftest import luban

    return luban("data", "verify", path)


def test_data_verify_checks_the_tokenizer_file(bpe_datasets, tmp_path):
    import shutil

    a, b = bpe_datasets
    assert _verify(a).returncode == 0 and "ok tokenizer bpe (vocab 300" in _verify(a).stdout
    gone = shutil.copytree(a, tmp_path / "gone")
    (gone / "tokenizer.json").unlink()
    proc = _verify(gone)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "verified" not in proc.stdout, proc.stdout + proc.stderr
    assert f"{gone / 'tokenizer.json'}: cannot load the BPE tokenizer (missing" in lines[0]
    swapped = shutil.copytree(a, tmp_path / "swapped")
    shutil.copy(b / "tokenizer.json", swapped / "tokenizer.json")  # same vocabulary size, other merges
    proc = _verify(swapped)
    assert proc.returncode == 2 and "verified" not in proc.stdout, proc.stdout + proc.stderr
    assert "tokenizer.json: SHA-256" in proc.stderr and "replaced or damaged" in proc.stderr


def test_sample_refuses_a_dataset_with_another_tokenizer(tiny, tmp_path, small_dataset, bpe_datasets):
    import shutil

    from .conftest import luban

    luban("train", *sum((["--set", s] for s in tiny(**{"train.steps": 2, "train.eval_every": 0})), []), check=0)
    run = tmp_path / "run"
    proc = luban("sample", run, "--data", bpe_datasets[0], "--tokens", 5)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "--- sample" not in proc.stdout, proc.stdout + proc.stderr
    assert "its tokenizer (bpe, vocab 300" in lines[0] and "trained with (byte, vocab 257, eos 256)" in lines[0]
    same = shutil.copytree(small_dataset, tmp_path / "same-tokenizer")  # another dataset, the run's tokenizer
    assert luban("sample", run, "--data", same, "--tokens", 5).returncode == 0


# -- MFU: one peak per run, and a sanity cap -------------------------------------------------

def _steps(run):
    return [r for line in (run / "metrics.jsonl").read_text().splitlines()
            if "step" in (r := json.loads(line)) and "loss" in r]


def test_a_resumed_run_reuses_its_recorded_cpu_peak(tiny, tmp_path, monkeypatch):
    """A resume on a busier CPU measures a lower peak; the run keeps the one of its first start."""
    from luban.plan import probe
    from luban.train import peak as peak_module
    from luban.train.trainer import Trainer

    monkeypatch.delenv("LUBAN_PEAK_FLOPS", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = tmp_path / "run"
    monkeypatch.setattr(probe, "measure_matmul_peak", lambda **kw: 1e13)  # the first start's CPU
    peak_module.peak_flops.cache_clear()  # a new process
    Trainer(load_config(None, tiny(**{"train.steps": 2, "train.eval_every": 0}))).train()
    recorded = json.loads((run / "peak.json").read_text())
    assert recorded["flops"] == 1e13 and recorded["device"] == "cpu" and recorded["source"].startswith("measured")
    monkeypatch.setattr(probe, "measure_matmul_peak", lambda **kw: 1e3)  # the resume's CPU: loaded
    peak_module.peak_flops.cache_clear()
    Trainer(load_config(None, tiny(**{"train.steps": 4, "train.eval_every": 0}))).train(resume="auto")
    records = _steps(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["mfu"] is not None and 0 < r["mfu"] < 0.01 for r in records), [r["mfu"] for r in records]
    assert all(abs(r["mfu"] - r["tflops"] * 1e12 / 1e13) < 1e-9 for r in records)  # the same peak throughout
    meta = json.loads(next((run / "checkpoints").glob("step_0000004/meta.json")).read_text())
    assert meta["peak"]["flops"] == 1e13


def test_mfu_above_100_percent_is_reported_as_not_measured_with_one_warning(tiny, tmp_path, monkeypatch, capsys):
    from luban.train.trainer import Trainer

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LUBAN_PEAK_FLOPS", "1000")  # a peak far below any CPU: MFU would be millions of %
    Trainer(load_config(None, tiny(**{"train.steps": 3, "train.eval_every": 0}))).train()
    records = _steps(tmp_path / "run")
    assert len(records) == 3 and all(r["mfu"] is None and r["hfu"] is None and r["tflops"] > 0 for r in records)
    out = capsys.readouterr().out
    assert out.count("is above 100%") == 1 and "mfu n/a" in out and "LUBAN_PEAK_FLOPS" in out


# -- first contact (issue 24 item 5) ---------------------------------------------------------

def test_a_bpe_dataset_sizes_a_presets_vocabulary(tiny, tmp_path, bpe_datasets):
    """The tiny preset (257 ids) on a 300-id BPE dataset trains; an explicit model.vocab is kept
    and a too-small one names the key to set."""
    from .conftest import luban

    def sets(**extra):
        return sum((["--set", s] for s in tiny(**{"data.path": f'"{bpe_datasets[0]}"', "train.steps": 2,
                                                   "train.eval_every": 0, **extra})), [])

    proc = luban("train", *sets(), check=0)
    assert "model.vocab = 300: the dataset's tokenizer vocabulary" in proc.stdout
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["vocab"] == 300
    out = luban("sample", tmp_path / "run", "--tokens", 5, check=0).stdout
    assert "--- sample 1" in out
    proc = luban("train", *sets(**{"model.vocab": 257, "run.dir": f'"{tmp_path / "explicit"}"'}))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "model.vocab = 257: must be >= the dataset's tokenizer vocabulary 300" in lines[0]
    assert "set model.vocab = 300" in lines[0]


def _readme_block(after: str, lang: str) -> str:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rest = text[text.index(after):]
    start = rest.index(f"```{lang}\n") + len(f"```{lang}\n")
    return rest[start:rest.index("```", start)]


def test_the_readmes_three_commands_work_literally_in_order(tmp_path):
    """'Training in three commands' with the README's config.toml, run as written (the train step
    shortened with extra --set flags after the README's own): the sample command samples the run
    the config writes."""
    import shlex
    import shutil
    import sysconfig
    import tomllib
    from pathlib import Path

    from .conftest import luban

    commands = [shlex.split(line) for line in _readme_block("## Training in three commands", "bash").splitlines()
                if line.strip()]
    config = _readme_block("A config has five sections", "toml")
    assert [c[:2] for c in commands] == [["luban", "data"], ["luban", "train"], ["luban", "sample"]]
    run_dir = tomllib.loads(config)["run"]["dir"]
    assert commands[2][2] == run_dir, f"the README samples {commands[2][2]}, its config writes {run_dir}"

    texts = tmp_path / "my_texts"
    texts.mkdir()
    for name in ("textwrap.py", "shlex.py", "json/decoder.py"):
        shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / name, texts / Path(name).name)
    (tmp_path / "config.toml").write_text(config)
    shorter = ["model.preset=\"tiny\"", "train.steps=2", "train.global_batch=4", "run.tensorboard=false"]
    commands[1] += sum((["--set", s] for s in shorter), [])
    for argv in commands:
        proc = luban(*argv[1:], cwd=tmp_path, timeout=600)
        assert proc.returncode == 0, (argv, proc.stdout, proc.stderr)
    assert "--- sample 1 (step 2) ---" in proc.stdout
    assert (tmp_path / run_dir / "checkpoints").is_dir()
