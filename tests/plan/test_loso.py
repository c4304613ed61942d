"""Validation by source (luban.plan.loso) and the independent sources' tables (luban.plan.validate)."""

import csv
from pathlib import Path

import numpy as np
import pytest

from luban.plan import loso, runtimes, validate

ROOT = Path(__file__).resolve().parents[2]

NEW_SOURCES = {"mosaicml-composer", "torchtitan", "trainy-torchtitan", "bigscience-megatron-deepspeed",
               "msft-nvidia-megatron-deepspeed"}


@pytest.fixture(scope="module")
def small():
    return loso.score_grid(loso.SMALL_GRID), loso.fit(loso.SMALL_GRID)


def test_each_source_is_scored_at_knobs_fitted_without_it(small):
    """Recomputed from the raw per-candidate errors: for every source the knobs are the argmin of the
    other sources' mean of means, and the held-out figure is that source's mean there."""
    (candidates, errors), result = small
    sources = sorted(errors)
    assert set(result["sources"]) == set(sources) and NEW_SOURCES <= set(sources) and len(sources) >= 9
    means = {s: np.array([np.mean(e) for e in errors[s]]) for s in sources}
    for s in sources:
        others = np.mean([means[o] for o in sources if o != s], axis=0)
        chosen = candidates.index(result["sources"][s]["knobs"])
        assert others[chosen] == pytest.approx(others.min(), abs=2e-6), s  # ties within rounding only
        assert result["sources"][s]["held_out"] == pytest.approx(means[s][chosen])
    assert result["headline"] == pytest.approx(np.mean([v["held_out"] for v in result["sources"].values()]))


def test_a_source_never_chooses_its_own_knobs(monkeypatch):
    """Synthetic errors: source A alone is best at candidate 1, B and C at candidate 0. A must be scored
    at 0 (what B and C choose), not at its own optimum; this fails if ``fit`` looked at A itself."""
    cands = [{"mm": 1.0, "attn": 1.0, "fp8": 1.0, "eager": runtimes.EAGER_TRAFFIC},
             {"mm": 1.04, "attn": 1.0, "fp8": 1.0, "eager": runtimes.EAGER_TRAFFIC}]
    errs = {"A": [[0.30], [0.01]], "B": [[0.02], [0.10]], "C": [[0.03], [0.20]]}
    monkeypatch.setattr(loso, "score_grid", lambda grid=None: (cands, errs))
    out = loso.fit()
    assert out["sources"]["A"]["knobs"] == cands[0] and out["sources"]["A"]["held_out"] == pytest.approx(0.30)
    assert out["sources"]["B"]["knobs"] == cands[1] and out["sources"]["B"]["held_out"] == pytest.approx(0.10)
    assert out["headline"] == pytest.approx((0.30 + 0.10 + 0.20) / 3)


def test_leave_one_source_out_headline(small):
    """Issue #25's goal is a held-out mean <= 8% over the dense sources; what this grid reaches is
    pinned here (docs/planner.md gives the per-source table) so that a regression fails."""
    _, result = small
    # (2026-11-26, session 14: rings across nodes share the node's NICs, refitted: 6.81% on this grid,
    # NeMo 6.3%, torchtitan 5.5%, MosaicML 7.7%, Trainy 1.8%, Megatron-LM 2.6%; 10.3% before.
    # 2026-11-28: the LM head charged to its own pipeline stage, Megatron's pipeline split for Megatron's
    # runs, the H100 profile refitted: 8.01% on this grid, 8.25% on the full one -- OVER issue #25's 8% goal,
    # reported (docs/planner.md "The LM head on its own stage"): BLOOM's one row went 1.2% -> 12.3%.
    # 2026-11-28, later: Megatron-DeepSpeed's compute speed a knob of its own (``ds``, refitted without the
    # held-out source): 7.04% on this grid (7.55% on the full one), BLOOM 12.3% -> 10.5% held out (scored at
    # MT-NLG's 0.75), MT-NLG 21.2% -> 11.9% (at BLOOM's 0.85): back under the goal, so the bound is tight again)
    assert result["headline"] <= 0.071, result
    held = {s: v["held_out"] for s, v in result["sources"].items()}
    assert held["nvidia-megatron-lm"] <= 0.04 and held["nvidia-nemo-megatron-core"] <= 0.07
    assert held["torchtitan"] <= 0.07 and held["mosaicml-composer"] <= 0.09 and held["trainy-torchtitan"] <= 0.04
    assert held["bigscience-megatron-deepspeed"] <= 0.11 and held["msft-nvidia-megatron-deepspeed"] <= 0.12


def test_megatron_deepspeed_speed_is_refitted_without_the_held_out_source(small):
    """Only BLOOM and MT-NLG depend on ``ds`` (``MegatronDeepSpeed.compute_speed``): each is scored at the
    value the other alone implies (MT-NLG's 0.75, BLOOM's 0.85), not at the shipped 0.80 that both chose
    (bench/plan_calibrate_sources.py); the knob slows only Megatron-DeepSpeed's compute."""
    _, result = small
    bloom, mtnlg = result["sources"]["bigscience-megatron-deepspeed"], result["sources"]["msft-nvidia-megatron-deepspeed"]
    assert bloom["knobs"]["ds"] == 0.75 and mtnlg["knobs"]["ds"] == 0.85
    assert runtimes.MegatronDeepSpeed.compute_speed == 0.80 and runtimes.Megatron.compute_speed == 1.0
    assert bloom["held_out"] > bloom["fitted"] and mtnlg["held_out"] > mtnlg["fitted"]  # held out costs something
    slow = {r["row"]: r["predicted"] for r in validate.source_rows("megatron_deepspeed_a100.csv", "t")}
    with loso.deepspeed_speed(1.0):
        fast = {r["row"]: r["predicted"] for r in validate.source_rows("megatron_deepspeed_a100.csv", "t")}
    for row in slow:  # compute is most of these steps (full recompute, 2240-3360 GPUs): 1/0.8 = 1.25 at most
        assert 1.15 < slow[row] / fast[row] < 1.25, row


def test_new_source_tables_cite_every_row():
    for name in ("mosaicml_llm_foundry_throughput.csv", "torchtitan_llama3_h100.csv", "megatron_deepspeed_a100.csv",
                 "trainy_torchtitan_h200.csv"):
        text = (validate.reference_dir() / name).read_text()
        header = [line for line in text.splitlines() if line.startswith("#")]
        assert any("read 2026-11-25" in line for line in header), name  # the date the source was read
        rows = validate.read_source_table(name)
        assert rows and all(r["citation"] and r["source"] and r["team"] and r["runtime"] in runtimes.RUNTIMES for r in rows)
    rows = validate.source_rows("mosaicml_llm_foundry_throughput.csv", "t")
    assert len(rows) == 13 and {r["source"] for r in rows} == {"mosaicml-composer"}
    systems = {r["estimate"].system for r in rows}
    assert systems == {"dgx-a100-80g", "dgx-h100"}


def test_torchtitan_rows_are_scored_relative_to_the_anchor(tmp_path, monkeypatch):
    """The 500 W machine's peak is unknown: each row's error is (pred_i / pred_0) / (ref_i / ref_0) - 1
    against the first row (the anchor, not scored), checked against the same file read absolute."""
    rel = validate.source_rows("torchtitan_llama3_h100.csv", "t")
    text = (validate.reference_dir() / "torchtitan_llama3_h100.csv").read_text()
    (tmp_path / "torchtitan_llama3_h100.csv").write_text(text.replace(",tokens_per_s_per_gpu_relative,", ",tokens_per_s_per_gpu,"))
    monkeypatch.setenv("LUBAN_REFERENCE_DIR", str(tmp_path))
    absolute = validate.source_rows("torchtitan_llama3_h100.csv", "t")
    assert len(rel) == len(absolute) - 1 == 6 + 1
    anchor = absolute[0]["predicted"] / absolute[0]["reference"]
    for r, a in zip(rel, absolute[1:]):
        assert r["error"] == pytest.approx((a["predicted"] / a["reference"]) / anchor - 1)


def test_torchtitan_tp_rows_run_sequence_parallel_and_async_tp_speeds_up_the_forward_only():
    """torchtitan's TP plan shards the norms' sequence (SequenceParallel): every tp 8 row is planned
    with sp; the async-TP rows of the same benchmark (--parallelism.enable_async_tensor_parallel) with
    ``tp_overlap``, which the fsdp2 runtime applies to the forward only (the PyTorch team measured
    ~20-29% forward and ~8% end-to-end speedups). Llama 3.1 8B: planned async/vanilla within 5% of the
    measured 4809.4 / 4378 = 1.099; 70B (full AC) is planned 1.29 against 1.09 (docs/planner.md)."""
    rows = validate.source_rows("torchtitan_llama3_h100.csv", "t")
    tp8 = [r for r in rows if r["estimate"].layout.tp == 8]
    assert len(tp8) == 4 and all(r["estimate"].layout.sp for r in tp8)
    by = {(r["row"].split()[0], "async-tp" in r["row"]): r for r in tp8}
    planned = by["llama3.1-8b", True]["predicted"] / by["llama3.1-8b", False]["predicted"]
    assert planned == pytest.approx(4809.4 / 4378, rel=0.05)
    assert runtimes.get("fsdp2").tp_overlap_backward is False and runtimes.get("megatron-core").tp_overlap_backward


def test_bloom_and_mt_nlg_rows():
    rows = {r["row"].split()[0]: r for r in validate.source_rows("megatron_deepspeed_a100.csv", "t")}
    bloom = rows["bloom-176b"]
    # 2026-11-28: within 5% while its last rank was charged 6 layers + the LM head (worth 1.4 layers); it
    # holds 5 + the head (DeepSpeed's type:transformer|embedding split, Megatron's split here): 15% too fast
    # at the shipped knobs, reported (docs/planner.md "The LM head on its own stage"). With Megatron-DeepSpeed's
    # compute speed (0.80 of Megatron-LM's, fitted on both sources): BLOOM +4.1%, MT-NLG -5.3/-6.3/-8.9%
    assert bloom["estimate"].system == "jean-zay-a100-80g" and abs(bloom["error"]) < 0.05
    assert all(abs(r["error"]) < 0.10 for r in rows.values())
    assert validate.source_system("jean-zay-a100-80g").internode_bandwidth == 6.25e9


def test_single_gpu_rows_follow_the_runners():
    rows = validate.h100_single_gpu()
    assert len(rows) == 11 and all(r["unit"] == "s" for r in rows)
    by = {r["row"]: r for r in rows}
    eager = by["gpt2-124m b16 luban Engine compiled=no"]["predicted"]
    blocks = by["gpt2-124m b16 luban Engine compiled=yes"]["predicted"]
    reference = by["gpt2-124m b16 reference compiled=yes"]["predicted"]
    assert eager > blocks > reference  # eager layers and loss > compiled blocks, eager loss > all compiled
    with open(validate.reference_dir() / validate.SINGLE_GPU_TABLE) as f:
        runners = {(r["runner"], r["compiled"]) for r in csv.DictReader(line for line in f if not line.startswith("#"))}
    assert set(validate.SINGLE_GPU_RUNNERS) <= runners  # every mapped runner is in the file
    # Hugging Face compiled hands SDPA a causal mask (transformers 5.17 under dynamo): every block of
    # the scores; HF eager (mask skipped, is_causal) and the reference loop skip the causal half
    # Hugging Face rows run the ``transformers`` runtime (GPT-2's eager gelu_new; compiled, a causal
    # mask handed to SDPA): slower than the reference loop's same FLOPs, compiled and eager alike
    assert {row for row, r in by.items() if r["estimate"].runtime == "transformers"} == {row for row in by if " HF " in row}
    hf = by["gpt2-124m b16 HF GPT2LMHeadModel (sdpa) compiled=yes"]["predicted"]
    assert hf > reference and by["gpt2-124m b16 HF GPT2LMHeadModel (sdpa) compiled=no"]["predicted"] > eager


def test_validate_takes_each_named_grid(monkeypatch, capsys):
    """``luban plan validate --grid NAME`` refits on ``loso.GRIDS[NAME]``: the fine grid holds the
    shipped knobs and 1,050 x 9 combinations (the sensitivity check of docs/planner.md); an unknown name
    is a one-line error."""
    from luban.cli import main

    fine = loso.GRIDS["fine"]
    assert int(np.prod([len(v) for v in fine.values()])) == 1050 * len(loso.DS_GRID)
    assert all(1.0 in fine[k] for k in ("mm", "attn", "fp8")) and runtimes.EAGER_TRAFFIC in fine["eager"]
    assert runtimes.MegatronDeepSpeed.compute_speed in fine["ds"]
    seen = []
    empty = {"candidates": 0, "sources": {}, "headline": 0.0, "fitted_mean": 0.0, "best_all": {}}
    monkeypatch.setattr(loso, "fit", lambda grid: seen.append(grid) or empty)  # the tables still run, not the refit
    monkeypatch.setattr(loso, "fit_moe", lambda: {"grid": 0, "shipped": 0.0, "sources": {}, "headline": 0.0, "best_all": 0.0})
    for name in ("fine", "small", "full"):
        assert main(["plan", "validate", "--grid", name, "--json"]) == 0
        capsys.readouterr()
    assert seen == [loso.GRIDS["fine"], loso.GRIDS["small"], loso.GRIDS["full"]]
    assert main(["plan", "validate", "--grid", "finer"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_nanotron_candidate_table_runs_under_existing_runtimes(capsys):
    """nanotron's H100 scaling table (a candidate source, not in the headline: docs/planner.md): 26
    cells, each global batch 256 x 4096 tokens; nanotron's own FLOPs count reproduces the note in its
    scaling script (3.57B shape: 363.66 TFLOP/s at 14,167.25 tokens/s/GPU); the bench script plans
    every row under each runtime model and prints their means."""
    import runpy

    rows = validate.read_source_table("nanotron_scaling_h100.csv")
    assert len(rows) == 26 and all(int(r["global_batch"]) == 256 and r["citation"] for r in rows)
    bench = runpy.run_path(str(ROOT / "bench" / "plan_nanotron_check.py"))
    three = next(r for r in rows if r["model"] == "nanotron-3.57b")
    assert bench["nanotron_flops_per_token"](three) * 14167.25 == pytest.approx(363.66e12, rel=1e-3)
    assert bench["main"]([]) == 0
    out = capsys.readouterr().out
    assert out.count(" nodes nanotron-") == 26 and out.count("(26 rows)") == 3
