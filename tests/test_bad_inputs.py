"""Bad input anywhere is one line, ``luban: error: <key> = <value>: <what is allowed>``, exit 2:
the concrete cases users hit (regressions), then property-based fuzzing of configs, planner
flags and manifests (hypothesis) asserting no traceback and no file changed."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luban.cli import main
from luban.config import load_config
from luban.errors import LubanError

PLAN = ["plan", "estimate", "--model", "gpt2-124m", "--system", "dgx-a100-80g", "--gpus", "8", "--global-batch", "8"]


def run(capsys, argv) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("override,words", [
    ("train.lr=nan", "train.lr = nan: a finite number"),
    ("train.lr=inf", "train.lr = inf: a finite number"),
    ("train.min_lr=nan", "train.min_lr = nan"),
    ("model.norm_eps=nan", "model.norm_eps = nan"),
    ("model.init_std=inf", "model.init_std = inf"),
    ("data.eval_batches=0", "data.eval_batches = 0: from 1"),
    ('run.dir=""', "run.dir = ''"),
    ("train.steps=1e23", "train.steps"),
    ("train.global_batch=1000000000", "train.global_batch = 1000000000: from 1 to 1048576"),
    ("train.beta1=1.5", "train.beta1 = 1.5"),
    ("train.seed=1180591620717411303424", "train.seed"),
    ("model.hidden=1099511627776", "model.hidden = 1099511627776: at most 1048576"),
    ("model.seq_len=1e9", "model.seq_len"),
    ("tr\nain.steps=1", "section = 'tr\\nain': unknown; allowed: model, "),  # printed two lines before
    ("trian.steps=1", "section = 'trian': unknown; allowed: model, "),
    ("model.zero_eps=0", "model.zero_eps = 0: unknown key"),
    ("model.norm_eps=0", "model.norm_eps = 0.0: must be positive"),
])
def test_train_config_cases(capsys, override, words):
    code, err = run(capsys, ["train", "--set", override])
    assert code == 2 and err.startswith("luban: error: ") and words in err and len(err.strip().splitlines()) == 1


def test_train_file_and_flag_cases(capsys, tmp_path):
    binary = tmp_path / "bin.toml"
    binary.write_bytes(bytes(range(256)) * 4)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "a\nb").mkdir()  # a name with a newline, printed raw in the message: escaped, one line
    cases = [(["train", str(binary)], "a readable UTF-8 TOML file"),
             (["import", str(tmp_path / "a\nb"), str(tmp_path / "run")], "a\\nb/config.json: no such file"),
             (["train", "--set", f'run.dir="{tmp_path / "afile" / "run"}"'], "run.dir"),
             (["train", "--set", 'run.dir="/proc/luban"'], "run.dir"),
             (["train", "--nproc", "2", "--master-port", "99999"], "--master-port = 99999"),
             (["train", "--nproc", "0"], "--nproc = 0"),
             # an integer bound as typed: it read "an integer from 1 to 1.1259e+15"
             (["data", "build", str(tmp_path / "afile"), "--out", str(tmp_path / "ds"), "--max-bytes", "0"],
              "--max-bytes = 0: an integer from 1 to 1125899906842624")]
    for argv, words in cases:
        code, err = run(capsys, argv)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (argv, err)


@pytest.mark.parametrize("extra,words", [
    (["--seq", "100000"], "--seq = 100000: from 1 to 1024"),
    (["--train-tokens", "nan"], "--train-tokens = nan"),
    (["--train-tokens", "-5"], "--train-tokens = -5.0"),
    (["--price-per-gpu-hour", "inf"], "--price-per-gpu-hour = inf"),
    (["--dispatcher", "nccl"], "--dispatcher = 'nccl': one of 'alltoall', 'deepep'"),
    (["--dispatcher", "deepep"], "--dispatcher = 'deepep': only for a mixture-of-experts model"),  # gpt2: dense
    (["--ep-overlap"], "--ep-overlap = True: only for a mixture-of-experts model"),
    (["--pad-vocab", "yes"], "--pad-vocab"),
    (["--tp-overlap", "1"], "--tp-overlap"),
    (["--grad-reduce-in-fp32", "off"], "--grad-reduce-in-fp32 = 'off': auto (only megatron-core has the switch)"),
    (["--grad-reduce-in-fp32", "fp16"], "--grad-reduce-in-fp32"),
    # a hostile sweep, 2026-11-27: tracebacks, silently accepted contradictions
    (["--recompute", "full:99999999999999999999"], "parallel.recompute = 'full:99999999999999999999': one of"),
    (["--recompute", "full:"], "parallel.recompute = 'full:': one of"),
    (["--recompute", "full:²"], "parallel.recompute = 'full:²': one of"),
    (["--virtual-stages", "2"], "parallel.virtual_stages = 2: 1 at pp = 1"),
    (["--expert-imbalance", "50"], "--expert-imbalance = 50.0: only for a mixture-of-experts model"),  # gpt2: dense
    (["--tp-overlap", "on"], "--tp-overlap = 'on': needs tensor + sequence parallel"),
    (["--explain", "--json"], "--explain = 'with --json': one or the other"),
    (["--system-set", "nvlink_domain=1e19"], "nvlink_domain = '1e19': an integer from 1 to 16777216"),
    (["--system-set", "oversubscription_exponent=2"], "unknown key"),
])
def test_planner_flag_cases(capsys, extra, words):
    code, err = run(capsys, PLAN + extra)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_other_commands_cases(capsys, tmp_path):
    cases = [(["plan", "search", "--model", "gpt2-124m", "--system", "dgx-a100-80g", "--gpus", "8",
               "--global-batch", "8", "--chart", "/unwritable/x.png"], "--chart"),
             (["cluster", "simulate", "--trace", str(tmp_path / "missing.jsonl")], "--trace"),
             (["cluster", "serve", "--state", str(tmp_path / "s"), "--nodes", "-3"], "--nodes = -3"),
             (["cluster", "serve", "--state", str(tmp_path / "s"), "--gpus", "-4"], "--gpus = -4"),
             (["cluster", "serve", "--state", str(tmp_path / "s"), "--tick", "-1"], "--tick = -1.0"),
             (["cluster", "serve", "--state", str(tmp_path / "s"), "--port", "99999"], "--port = 99999"),
             # a hostile sweep, 2026-11-27: each was a traceback
             (["plan", "search", "--model", "qwen3-30b-a3b", "--system", "dgx-h100", "--gpus", "8", "--global-batch", "8",
               "--ep", "128"], "--ep = 128: no layout of 8 GPUs has it"),
             (["plan", "probe", "--device", "nosuch"], "--device = 'nosuch': cpu, cuda or cuda:N"),
             (["plan", "probe", "--device", "cuda:-1"], "--device = 'cuda:-1'")]
    import torch

    if not torch.cuda.is_available():  # this machine's lack of the device, said in one line
        cases.append((["plan", "probe", "--device", "cuda"], "--device = 'cuda': cpu: this machine has no CUDA device"))
    for argv, words in cases:
        code, err = run(capsys, argv)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (argv, err)


def _profile(tmp_path, name, change):
    """dgx-h100's profile as a JSON file with ``change`` applied to its raw fields."""
    from luban.plan.system import load_system

    raw = json.loads(json.dumps(load_system("dgx-h100").to_dict()))
    change(raw)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("name,change,words", [
    ("eff-not-table", lambda r: r.update(efficiency=5), "efficiency = 5: a table"),
    ("curve-scalar", lambda r: r["efficiency"].update(matmul=0.5), "efficiency.matmul = 0.5: a list of numbers"),
    ("curve-strings", lambda r: r["efficiency"].update(matmul=["a"] * len(r["efficiency"]["matmul"])), "efficiency.matmul"),
    ("curve-zero", lambda r: r["efficiency"].update(collective=[0] * len(r["efficiency"]["collective"])), "each >= 1e-09"),
    ("curve-negative", lambda r: r["efficiency"].update(matmul=[-1] * len(r["efficiency"]["matmul"])), "each >= 1e-09"),
    ("hbm-eff-string", lambda r: r["efficiency"].update(hbm_efficiency="x"), "efficiency.hbm_efficiency = 'x'"),
    ("hbm-eff-negative", lambda r: r["efficiency"].update(hbm_efficiency=-1), "efficiency.hbm_efficiency = -1"),
    ("overlap-5", lambda r: r["efficiency"].update(zero3_overlap=5), "efficiency.zero3_overlap = 5"),
    ("launch-negative", lambda r: r["efficiency"].update(kernel_launch_s=-1), "efficiency.kernel_launch_s = -1"),
    ("eff-unknown", lambda r: r["efficiency"].update(bogus=1), "efficiency.bogus = 1"),
    ("cpu-string", lambda r: r.update(cpu="x"), ".cpu = 'x'"),
    ("latency-huge", lambda r: r.update(nvlink_latency=1e308), "nvlink_latency = 1e+308"),
    ("unknown-key", lambda r: r.update(foo=1), ".foo = 1: not a profile key"),
    ("missing-key", lambda r: r.pop("hbm_bytes"), ".hbm_bytes = '(missing)': required"),
    ("peak-precision", lambda r: r["peak_flops"].update(bf17=1e15), ".peak_flops = "),
])
def test_profile_files_are_checked_field_by_field(capsys, tmp_path, name, change, words):
    """Each used to end in a traceback (TypeError, OverflowError) or a NaN/negative step time."""
    path = _profile(tmp_path, name, change)
    code, err = run(capsys, ["plan", "estimate", "--model", "llama-8b", "--system", str(path), "--gpus", "64",
                             "--global-batch", "64", "--json"])
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_json_output_is_strict_even_for_an_unlimited_tier(capsys):
    """--system-set hbm_gib=inf (documented: unlimited) printed Infinity, which is not JSON."""
    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    for command in (["estimate"], ["search"]):
        argv = ["plan", *command, "--model", "llama-8b", "--system", "dgx-h100", "--gpus", "8", "--global-batch", "8",
                "--system-set", "hbm_gib=inf", "--json"]
        assert main(argv) == 0
        out = strict(capsys.readouterr().out)
        assert (out if command == ["estimate"] else out["best"][0])["hbm_bytes"] is None  # unlimited


# -- fuzz --------------------------------------------------------------------------------------
KEYS = [f"{s}.{k}" for s, ks in {
    "train": ("steps", "global_batch", "lr", "min_lr", "seed", "beta1", "beta2", "momentum", "warmup_steps",
              "checkpoint_every", "eval_every", "grad_clip", "weight_decay", "optimizer", "keep_checkpoints",
              "checkpoint_every_minutes", "async_checkpoint"),
    "data": ("seq_len", "eval_batches", "prefetch", "path"),
    "model": ("hidden", "layers", "heads", "vocab", "seq_len", "norm_eps", "init_std", "dropout", "arch",
              "experts", "experts_per_token", "expert_ffn_hidden", "shared_experts", "dense_layers", "router",
              "router_bias_rate", "aux_loss_coef", "capacity_factor", "kv_heads", "rope_theta"),
    "parallel": ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "schedule", "precision", "offload",
                 "virtual_stages", "recompute"),
    "run": ("dir", "device", "progress"), "bogus": ("key",)}.items() for k in ks]
NASTY = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "1e308", "-1", "0", "2**70", "1180591620717411303424", "true", "[1, 2]",
                     "{a = 1}", '""', '"x"', "1.5", "-0.0", "1e-320", "'", "\"\\u0000\"", "=", "9" * 40]),
    st.integers(min_value=-(1 << 80), max_value=1 << 80).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: repr(f).replace("inf", "inf")),
    st.text(max_size=12))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(KEYS), NASTY), min_size=1, max_size=3))
def test_fuzzed_config_values_are_one_line_errors_or_valid(pairs):
    try:
        cfg = load_config(None, [f"{k}={v}" for k, v in pairs])
    except LubanError as err:
        assert "\n" not in str(err) and str(err)
        return
    for section in ("train", "data"):  # accepted: then every number in it is finite
        for value in cfg.to_dict()[section].values():
            assert not isinstance(value, float) or math.isfinite(value)


FLAGS = ["--seq", "--train-tokens", "--price-per-gpu-hour", "--gpus", "--global-batch", "--tp", "--pp", "--dp", "--dispatcher",
         "--micro-batch", "--zero", "--pad-vocab", "--compile", "--tp-overlap", "--grad-reduce-in-fp32"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(FLAGS), NASTY.filter(lambda v: not v.startswith("-") or v[1:2].isdigit())),
                min_size=1, max_size=3))
def test_fuzzed_planner_flags_never_trace(capsys, pairs):
    argv = ["plan", "estimate", "--model", "gpt2-124m", "--system", "dgx-a100-80g", "--gpus", "8",
            "--global-batch", "8", *sum(([f, v] for f, v in pairs), [])]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own type errors: one line too (luban.cli.Parser), exit 2
        code = exit_.code
    err = capsys.readouterr().err
    assert code in (0, 2), err
    assert "Traceback" not in err
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and err.startswith("luban: error: "), err


@pytest.mark.parametrize("argv,words", [
    (["nosuch"], "COMMAND = 'nosuch': one of 'train', "),
    (["cluster", "serve", "--bogus"], "--bogus = (unrecognized): not an option"),
    (["cluster", "serve", "--run-jobs-as", "x"], "--run-jobs-as = 'x': one of 'user', 'namespace', 'service'"),
    (["cluster", "serve", "--port", "abc"], "--port = 'abc': an integer from 1 to 65535"),
    (["cluster", "simulate", "--nope"], "--nope = (unrecognized): not an option"),
    (["data"], "data: ACTION = (missing): required"),
    (["plan", "estimate", "--gpus", "8"], "--model = (missing): required"),
    (["plan", "nope"], "ACTION = 'nope': one of 'estimate', "),
    (["jobs", "--bogus"], "--bogus = (unrecognized): not an option"),
    # a command's unknown option is named by that command, before any value is read (it was the top
    # parser's: "see: luban --help"; and `sample --top-p 0.9` said CHECKPOINT '0.9' is no folder)
    (["sample", "--top-p", "0.9"], "sample: --top-p = (unrecognized): not an option of this command  "
                                   "(see: luban sample --help)"),
    (["plan", "probe", "--bogus=3"], "plan probe: --bogus = (unrecognized): not an option of this command  "
                                     "(see: luban plan probe --help)"),
    (["admin", "user", "add", "--zzz"], "(see: luban admin user add --help)"),
    (["sample", "/", "more"], "sample: more = (unrecognized): one argument more than this command takes"),
    (["import", "/", "-x"], "import: -x = (unrecognized): not an option of this command"),  # said OUT = (missing)
    # no abbreviations: `plan search --tp on` (search has no --tp) set --tp-overlap
    (["sample", "--t", "3"], "sample: --t = (unrecognized): not an option of this command"),
    (["plan", "search", "--model", "gpt2-124m", "--gpus", "8", "--global-batch", "8", "--tp", "on"],
     "plan search: --tp = (unrecognized): not an option of this command"),
    (["submit", "--priority", "WHATEVER", "--", "true"], "priority = 'WHATEVER': one of"),
    (["admin"], "admin"),
    (["cluster", "simulate", "--tick", "nan"], "--tick = nan: a finite number"),
    (["cluster", "simulate", "--checkpoint-s", "-1"], "--checkpoint-s = -1.0: a finite number"),
    (["cluster", "simulate", "--zones", "0"], "--zones = 0: an integer from 1 to 100000"),
    (["cluster", "trace", "--days", "nan", "-o", "/nonexistent-dir/t.jsonl"], "--days = nan: a finite number in (0, "),
    (["cluster", "trace", "-o", "/nonexistent-dir/t.jsonl"], "--output = '/nonexistent-dir/t.jsonl': a new file's path in"),
    (["train", "--resume", ""], "--resume = '': auto or a checkpoint directory"),  # trained from scratch before
    (["demo", "--nproc", "2", "--set", "train.steps=1"], "train.steps = 1: at least 2 for the demo"),  # named 0
    (["quota", "--token", "x", "--url", "http://[::1"], "--url = 'http://[::1': the service's http(s)://HOST[:PORT]"),
    (["jobs", "--token", "x", "--url", "ftp://host"], "--url = 'ftp://host': the service's http(s)://HOST[:PORT]"),
])
def test_usage_errors_are_one_line_exit_2(capsys, argv, words):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("luban: error: ") and words in err, err


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, request):
    from luban.data.build import build_dataset
    from tests.data.conftest import write_docs

    root = tmp_path_factory.mktemp("fuzz")
    build_dataset([write_docs(root / "text", n_docs=12)], root / "ds", shard_size_mb=0.001, val_fraction=0.25)
    return root / "ds"


def _paths(value, prefix=()):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))
    yield prefix


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_manifests_are_named_and_nothing_changes(dataset, tmp_path_factory, data):
    from luban.data.manifest import load_manifest, open_dataset, write_manifest

    work = tmp_path_factory.mktemp("m") / "ds"
    shutil.copytree(dataset, work)
    manifest = json.loads((work / "manifest.json").read_text())
    paths = [p for p in _paths(manifest) if p]
    where = data.draw(st.sampled_from(paths))
    new = data.draw(st.one_of(st.integers(-5, 10**6), st.text(max_size=8), st.none(), st.booleans(),
                              st.just([]), st.just({}), st.floats(allow_nan=True)))
    target = manifest
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = new
    resign = data.draw(st.booleans())  # a consistent-looking manifest, or a plainly edited one
    if resign:
        write_manifest(work, {k: v for k, v in manifest.items() if k != "checksum"})
    else:
        (work / "manifest.json").write_text(json.dumps(manifest))
    before = {p.name: p.read_bytes() for p in work.iterdir()}
    try:
        open_dataset(work)
    except LubanError as err:
        assert "\n" not in str(err)
    else:  # accepted only if the change did not matter to what the manifest checks
        load_manifest(work)
    assert {p.name: p.read_bytes() for p in work.iterdir()} == before


# -- issue 24: files checked before use ------------------------------------------------------------
def test_issue24_file_cases(capsys, tmp_path, monkeypatch):
    """Each was a traceback on 3457f4b; now one line naming the file or flag, exit 2."""
    (tmp_path / "list.json").write_text("[1, 2, 3]")
    (tmp_path / "t5.toml").write_text("train = 5\n")
    (tmp_path / "ckpt").mkdir()
    cases = [
        (["plan", "estimate", "--model", str(tmp_path / "list.json"), "--system", "dgx-a100-80g", "--gpus", "8",
          "--global-batch", "8"], "--model = '" + str(tmp_path / "list.json") + "': a JSON table of model keys"),
        (["plan", "estimate", "--model", "gpt2-124m", "--system", str(tmp_path / "list.json"), "--gpus", "8",
          "--global-batch", "8"], "a profile table"),
        (["train", str(tmp_path / "t5.toml")], "t5.toml: train = 5: a table of keys"),
        (["train", str(tmp_path / "t5.toml"), "--set", "train.steps=3"], "t5.toml: train = 5: a table of keys"),
        (["plan", "search", "--model", "gpt2-124m", "--system", "dgx-a100-80g", "--gpus", "8", "--global-batch", "8",
          "--chart", "/proc/x.png"], "--chart = '/proc/x.png': a new file's path in an existing, writable folder"),
        (["plan", "search", "--model", "gpt2-124m", "--system", "dgx-a100-80g", "--gpus", "8", "--global-batch", "8",
          "--chart", str(tmp_path)], "--chart = "),
        (["export", str(tmp_path / "ckpt"), "--format", "hf", "/proc/x"], "OUT = '/proc/x': a folder that exists"),
        (["cluster", "simulate", "--trace", str(tmp_path / "list.json")], "a trace job (a JSON object, not list)"),
    ]
    # an image suffix matplotlib cannot write is refused before the search (a 1e9-layout search
    # would otherwise run first): the planner must not be called at all
    import luban.plan.search as search_module

    def no_search(*a, **k):
        raise AssertionError("searched before checking --chart")
    monkeypatch.setattr(search_module, "search", no_search)
    cases.append((["plan", "search", "--model", "gpt2-124m", "--system", "dgx-a100-80g", "--gpus", "8",
                   "--global-batch", "8", "--chart", str(tmp_path / "x.bmpx")], "an image file ending in one of"))
    for argv, words in cases:
        try:
            code = main(argv)
        except SystemExit as done:
            code = done.code
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("luban: error: ") and err.count("\n") == 1 and words in err, (argv, err)
        assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "list.json", "t5.toml"]


def test_a_stale_rank_environment_is_one_line(capsys, tmp_path, monkeypatch):
    """WORLD_SIZE left exported in a shell makes ``luban train`` a rank: without RANK or MASTER_ADDR,
    or with them garbled, it was torch's env:// ValueError (or int()'s) traceback (a hostile sweep,
    2026-11-27); now one line naming the variable, and nothing written."""
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    argv = ["train", "--set", f'run.dir="{tmp_path / "run"}"', "--set", "parallel.dp=2"]
    cases = [({"WORLD_SIZE": "2"}, "RANK = (unset): set by the launcher of a job's ranks"),
             ({"WORLD_SIZE": "two"}, "WORLD_SIZE = 'two': an integer from 1 to 16777216"),
             ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR = (unset): "),
             ({"WORLD_SIZE": "2", "RANK": "5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
              "RANK = '5': an integer from 0 to 1 (WORLD_SIZE = 2)"),
             ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0x10"},
              "MASTER_PORT = '0x10': an integer from 1 to 65535")]
    for env, words in cases:
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            code, err = run(capsys, argv)
        assert code == 2 and err.startswith("luban: error: ") and err.count("\n") == 1 and words in err, (env, err)
    assert not (tmp_path / "run").exists()


def test_a_server_that_is_not_luban_s_is_named(monkeypatch):
    """A web server's empty 404 printed 'luban: error:  (HTTP 404)' (a hostile sweep, 2026-11-27)."""
    import httpx

    from luban.cluster.client import Client

    client = Client(url="http://10.0.0.1:80", token="x")
    client.http = httpx.Client(base_url=client.url, transport=httpx.MockTransport(lambda request: httpx.Response(404)))
    with pytest.raises(LubanError, match=r"^GET /quota answered without a message: is http://10.0.0.1:80 a luban "
                                         r"cluster service\? \(HTTP 404\)$"):
        client.call("GET", "/quota")
    client.http = httpx.Client(base_url=client.url, transport=httpx.MockTransport(
        lambda request: httpx.Response(422, json={"detail": [{"msg": "bad\nthing"}]})))
    with pytest.raises(LubanError, match=r"^\[\{'msg': 'bad\\nthing'\}\] \(HTTP 422\)$"):
        client.call("GET", "/quota")


def test_a_huge_bad_value_is_shown_cut_short(capsys):
    """A megabyte value is still one short line (errors.shown: the first 200 characters of its repr)."""
    code, err = run(capsys, ["train", "--set", 'train.lr="' + "x" * 1_000_000 + '"'])
    assert code == 2 and err.startswith("luban: error: train.lr = 'xxx") and "...: " in err and len(err) < 400, err[:500]


@pytest.mark.parametrize("text", ["٣", " 7", "7 ", "1_0", "0x10", "", "٣.5", "１"])
def test_numbers_on_the_command_line_are_ascii_decimal(capsys, text):
    """int()/float() take surrounding spaces, underscores and other scripts' digits: ``luban stop ٣``
    stopped job 3 (2026-11-28). A flag's number is ASCII digits (and a sign, a point, an exponent)."""
    from luban import schema

    for parse in (schema.integer(0, None), schema.number(0, None)):
        with pytest.raises(schema.Invalid):
            parse(text)
    assert main(["stop", text]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("luban: error: jobs = "), err


@pytest.mark.parametrize("argv, key", [(["plan", "estimate", "--gpus", "-1e3"], "--gpus = '-1e3'"),
                                       (["plan", "estimate", "--global-batch", "-inf"], "--global-batch = '-inf'"),
                                       (["data", "build", "--val-fraction", "-1E-2"], "--val-fraction = ")])
def test_a_negative_number_reaches_every_commands_flag_check(capsys, argv, key):
    """argparse takes ``-1e3`` or ``-inf`` for an option, not a value: every command but the cluster's
    said ``--gpus = (missing)`` (2026-11-28); ``luban.cli.Parser`` now reads them as values."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0] and "(missing)" not in err[0], err
