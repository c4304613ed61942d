"""The published tables, reproduced with the built-in dgx-a100-80g profile (no per-row tuning)."""

import shutil

import pytest

from luban.plan import validate


@pytest.fixture(scope="module")
def tables():
    return validate.validate_all("dgx-a100-80g")


def test_korthikanti_table5_iteration_times(tables):
    s = tables["korthikanti2022-t5"]["summary"]
    assert s["rows"] == 8
    assert s["mean_abs_error"] <= 0.03 and s["max_abs_error"] <= 0.08


def test_narayanan_table1_tflops_per_gpu(tables):
    s = tables["narayanan2021-t1"]["summary"]
    assert s["rows"] == 10 and s["mean_abs_error"] <= 0.05


def test_narayanan_table1_at_micro_batch_1(tables):
    """#11's goal: Table 1 within 5% with every row at micro-batch 1, the same profile."""
    rows = tables["narayanan2021-t1-mb1"]["rows"]
    assert len(rows) == 10 and all(r["estimate"].layout.micro_batch == 1 for r in rows)
    assert tables["narayanan2021-t1-mb1"]["summary"]["mean_abs_error"] <= 0.05


def test_zero_table1_model_states_exact(tables):
    rows = tables["zero2019-t1"]["rows"]
    assert len(rows) == 54 and all(r["exact"] for r in rows)


def test_korthikanti_mfu_matches_megatron_readme(tables):
    """MFU of the sp + selective runs against the Megatron-LM README figures (same definition)."""
    refs = {r["model"]: float(r["MFU_pct_present_work (Megatron-LM README 2022-05)"]) / 100
            for r in validate.read_table("korthikanti2022_table5_iteration_time_mfu.csv")}
    for row in tables["korthikanti2022-t5"]["rows"]:
        if row["row"].endswith("sp + selective"):
            assert row["estimate"].mfu == pytest.approx(refs[row["row"].split()[0]], rel=0.08)


def test_reference_dir_override(tmp_path, monkeypatch):
    for f in validate.PACKAGED.glob("*.csv"):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "zero2019_table1_model_state_memory_GB.csv").write_text("DP_degree_Nd,7.5B_Pos_GB\n4,52.5\n")
    monkeypatch.setenv("LUBAN_REFERENCE_DIR", str(tmp_path))
    rows = validate.zero_table1()
    assert len(rows) == 1 and rows[0]["exact"]


def test_h100_tables_fitted_and_held_out(tables):
    """H100: the rows bench/plan_calibrate_hopper.py fitted dgx-h100's constants to, and the
    rows it never saw, reported apart; both within the 8% goal."""
    fitted, held = tables["h100-fitted"], tables["h100-held-out"]
    everything = sum((tables[name]["rows"] for name in validate.HOPPER_TABLES), [])
    assert fitted["summary"]["rows"] + held["summary"]["rows"] == len(everything) == 25
    assert fitted["summary"]["rows"] == 15 and not set(map(id, fitted["rows"])) & set(map(id, held["rows"]))
    assert fitted["summary"]["mean_abs_error"] <= 0.08 and held["summary"]["mean_abs_error"] <= 0.08
    for name in validate.HOPPER_TABLES:  # issue #11's goal holds per table, not only pooled
        assert tables[name]["summary"]["mean_abs_error"] <= 0.08, (name, tables[name]["summary"])
    # each table is estimated with the attention kernel generation its software ran
    kernels = {name: {r["estimate"].extra.get("attention_kernel") for r in tables[name]["rows"]}
               for name in validate.HOPPER_TABLES}
    assert kernels == {"megatron-bridge-h100-dense": {"fa3"}, "nemo-h100-long-sequence-cp": {"fa2"},
                       "llama3-2024-t4-h100": {"fa2"}}, kernels
    assert all(r["estimate"].layout.precision == "fp8" for r in tables["megatron-bridge-h100-dense"]["rows"])
    # the published layouts ran: most are planned to fit; with the Llama rows' real SwiGLU shapes
    # (2026-11-26) the memory model over-estimates six by up to 19% (docs/planner.md: 25.09 Megatron-Bridge
    # rows, whose recipe is not in the repository, keep fp32 main gradients; NeMo's 4K CP row; Llama 3's
    # 405B rows): a guard against that growing, not a claim that it is right
    over = [r for r in everything if not r["estimate"].fits]
    assert len(over) <= 6 and all(r["estimate"].memory_bytes["total"] <= 1.2 * r["estimate"].hbm_bytes for r in over)
    assert all(r["estimate"].fits for r in tables["megatron-bridge-h100-dense"]["rows"] if r["row"] >= "25.11")
