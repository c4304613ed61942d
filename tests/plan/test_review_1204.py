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
