"""``luban plan study seed003``: model shapes, a reduced run end to end, and the CLI's errors."""

import json
import re
import math
import subprocess
import sys
from pathlib import Path

from luban.model.flops import param_count
from luban.plan import study

ROOT = Path(__file__).resolve().parents[2]


def test_seed_models_follow_the_seed_rules():
    slope, intercept = study.aspect_fit()
    assert 1.0 < slope < 2.0  # Table II: h/blocks grows with blocks (128 at 96 blocks, 200 at 128)
    previous = 0
    for t in study.SIZES_T:
        cfg = study.seed_model(t)
        assert cfg.heads == cfg.layers and cfg.ffn_hidden == 4 * cfg.hidden and cfg.seq_len == 8192
        assert cfg.layers % study.BLOCK_STEP == 0 and cfg.hidden % cfg.heads == 0
        assert abs(math.log(param_count(cfg) / (t * 1e12))) < math.log(1.5)
        assert param_count(cfg) > previous
        previous = param_count(cfg)
    a, b = (study.block_model(n, study.PAIR_HEAD_DIM) for n in study.BLOCKS_PAIR)
    assert 1.0e12 < param_count(b) < param_count(a) < 1.2e12  # the seed's two ~1.1T models


def test_reduced_study_writes_table_and_charts(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "OFFLOAD_GIB", (1024, 2048))
    monkeypatch.setattr(study, "HBM_GIB", (80, 120))
    res = study.run(tmp_path, sizes=(1, 16), scaling_gpus=(4096, 8192), log=lambda _: None)
    for name in ("results.json", "seed003.md", "a_model_size.png", "b_strong_scaling.png", "c_blocks.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "results.json").read_text())["precision"] == res["precision"]
    table = (tmp_path / "seed003.md").read_text()
    rows = study.findings(res)
    assert len(rows) == 13 and all(set(re.findall(r"yes|no", r["agree"])) and r["why"] for r in rows)
    for r in rows:
        assert r["finding"] in table
    # the searches are real: a smaller model trains, more HBM never hurts, the 254-block model maps worse
    assert study._mfu(res, 1, 80, "none") > 0.2
    for t in (1, 16):
        assert study._mfu(res, t, 120, "1024GiB@100") >= study._mfu(res, t, 80, "1024GiB@100")
    c256, c254 = study._c(res, "luban")
    assert c256["valid"] > 3 * c254["valid"] > 0


def test_cli_rejects_unknown_study_and_unwritable_out(tmp_path):
    (tmp_path / "file").write_text("x")
    for args, key in ((["seed004"], "study = 'seed004'"), (["seed003", "--out", str(tmp_path / "file" / "x")], "--out")):
        r = subprocess.run([sys.executable, "-m", "luban", "plan", "study", *args], capture_output=True, text=True,
                           cwd=ROOT, timeout=120)
        assert r.returncode == 2 and r.stderr.startswith(f"luban: error: {key}") and "Traceback" not in r.stderr
