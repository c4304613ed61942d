"""The planner, a hostile review of 2026-12-04."""

from __future__ import annotations

import pytest

from luban.cli import main

MOE = 'arch="llama"\nhidden=512\nlayers=4\nheads=8\nkv_heads=2\nexperts=8\nexperts_per_token=2\nexpert_ffn_hidden=101\nffn_hidden=1024\n'


def test_tp_must_divide_the_expert_width_where_the_runtime_splits_experts_by_tp(tmp_path, capsys):
    """(2026-12-04) Megatron splits routed experts by tp (``expert_tp``): tp = 2 of a 101-wide expert was
    planned (estimate and search); only the dense ffn_hidden was checked. luban's experts are not split."""
    model = tmp_path / "moe.toml"
    model.write_text(MOE)
    base = ["plan", "estimate", "--model", str(model), "--gpus", "2", "--global-batch", "8", "--tp", "2"]
    assert main([*base, "--runtime", "megatron"]) == 2
    err = capsys.readouterr().err
    assert "parallel.tp = 2: must divide heads=8, kv_heads=2, ffn_hidden=1024 and expert_ffn_hidden=101" in err, err
    assert main([*base, "--runtime", "luban"]) == 0
    capsys.readouterr()
    assert main(["plan", "search", "--model", str(model), "--gpus", "2", "--global-batch", "8",
                 "--runtime", "megatron", "--top", "50"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if " dp" in line and " tp" in line]
    assert rows and not [r for r in rows if " tp2 " in r], rows


def test_hybrid_sharding_changes_the_data_parallel_time_as_its_groups_do():
    """(2026-12-04) ``dp_replicate`` changed the memory but never the communication: HSDP gathers and
    reduce-scatters within a shard group (here one node's NVLink) and all-reduces each shard over the
    replicas; with one shard per rank (r = dp) that is DDP's one all-reduce and no gather."""
    from luban.model.presets import get_preset
    from luban.parallel.layout import ParallelLayout
    from luban.plan.estimate import estimate

    def dp_comm(**layout):
        est = estimate(get_preset("llama-8b"), "dgx-h100", ParallelLayout(dp=64, micro_batch=1, **layout),
                       global_batch=64, seq=512, runtime="fsdp2")
        return est.time_breakdown_s["dp_comm"] + est.dp_hidden_s  # exposed and hidden: all of it

    flat, hybrid, whole = dp_comm(zero=3), dp_comm(zero=3, dp_replicate=8), dp_comm(zero=3, dp_replicate=64)
    assert len({round(flat, 6), round(hybrid, 6), round(whole, 6)}) == 3, (flat, hybrid, whole)
    assert whole == pytest.approx(dp_comm(zero=2, dp_replicate=64), rel=1e-6)  # no gathers either way
    from luban.plan.explain import describe

    assert describe(ParallelLayout(dp=64, dp_replicate=8, zero=3)).startswith("dp64 r8 z3 ")


def test_estimates_that_do_not_fit_say_which_memory_and_what_is_near(capsys):
    """(2026-12-04) A host tier too small read "DOES NOT FIT in 80 GiB" (the GPU's, which it fit); a model no
    layout fits printed "nearest layouts that fit:" over nothing; the training cost read as if it ran."""
    host = ["plan", "estimate", "--model", "llama-8b", "--gpus", "16", "--global-batch", "32", "--zero", "3",
            "--system", "dgx-h100", "--system-set", "offload_gib=1", "--offload", "params"]
    assert main(host) == 0
    out = capsys.readouterr().out
    assert "-> fits in 80 GiB, but the offloaded state DOES NOT FIT in host memory\n" in out, out
    assert main(["plan", "estimate", "--model", "llama-70b", "--gpus", "1", "--global-batch", "8", "--system",
                 "dgx-h100", "--train-tokens", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "training 1e+09 tokens (were it to fit): " in out and "-> DOES NOT FIT in 80 GiB\n" in out, out
    assert "nearest layouts that fit: none on 1 GPUs (more GPUs, offload or a smaller model" in out, out


def test_a_chart_of_a_cjk_named_model_prints_no_warnings_and_probe_checks_its_suffix_first(tmp_path, capfd):
    """(2026-12-04) matplotlib's glyph warnings, with its source paths, reached stderr; ``probe --out x.yaml``
    probed for minutes, then wrote TOML under that name."""
    model = tmp_path / "m.toml"
    model.write_text('preset = "gpt2-124m"\nname = "模型\\u0007x"\n')
    assert main(["plan", "search", "--model", str(model), "--gpus", "8", "--global-batch", "8", "--system",
                 "dgx-h100", "--chart", str(tmp_path / "c.png")]) == 0
    err = capfd.readouterr().err
    assert "Warning" not in err and (tmp_path / "c.png").stat().st_size > 0, err
    assert main(["plan", "probe", "--out", str(tmp_path / "x.yaml")]) == 2
    assert "--out = " in capfd.readouterr().err and not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize("runtime, flags, line", [
    ("fsdp2", ["--offload", "blocks"], "parallel.offload = 'blocks': this runtime offloads none, optimizer, params, activations"),
    ("pytorch", ["--zero", "1", "--gpus", "2", "--global-batch", "2"], "parallel.zero = 1: this runtime runs zero = 0"),
    ("transformers", ["--cp", "2", "--gpus", "2", "--global-batch", "1"], "parallel.cp = 2: this runtime has no context parallel"),
])
def test_a_runtime_plans_only_what_its_framework_runs(capsys, runtime, flags, line):
    """(2026-12-04) search recommended 'z0 off=blocks' for fsdp2 (blocks: seed 003's what-if, run by no
    framework) and 'dp8 z1' for the one-process pytorch loop; estimate took --zero 3 --cp 2 for it."""
    base = {"--gpus": "1", "--global-batch": "8"}
    args = dict(zip(flags[::2], flags[1::2]))
    argv = ["plan", "estimate", "--model", "gpt2-124m", "--system", "dgx-h100", "--runtime", runtime,
            *sum(([k, v] for k, v in {**base, **args}.items()), [])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert line in err, err
