"""When checkpoints are taken and how: time-based saving (``checkpoint_every_minutes``, as the HAI
platform saves every few minutes) and the fall-back to synchronous saves when host memory cannot
hold a staged copy; both reported in metrics.jsonl."""

import json

from luban.config import load_config
from luban.train import trainer as trainer_module
from luban.train import checkpoint
from luban.train.trainer import Trainer

from .conftest import assert_bitwise_equal, final_weights


def saves(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["checkpoint"] for r in rows if "checkpoint" in r]


def test_time_based_saving_saves_when_the_minutes_pass_not_by_steps(tiny, tmp_path):
    """0.6 ms: every step takes longer, so every step is due (rank 0's clock, broadcast)."""
    result = Trainer(load_config(None, tiny("timed", **{"train.steps": 5, "train.checkpoint_every": 0,
                                                       "train.checkpoint_every_minutes": 1e-5,
                                                       "train.keep_checkpoints": 10}))).train()
    assert result.step == 5
    assert [s["step"] for s in saves(tmp_path / "timed")] == [1, 2, 3, 4, 5]
    assert [p.name for p in checkpoint.step_dirs(tmp_path / "timed" / "checkpoints")][0] == "step_0000005"
    assert all(checkpoint.verify(p) is None for p in checkpoint.step_dirs(tmp_path / "timed" / "checkpoints"))


def test_time_based_saving_off_saves_only_at_the_end(tiny, tmp_path):
    Trainer(load_config(None, tiny("untimed", **{"train.steps": 4, "train.checkpoint_every": 0}))).train()
    assert [s["step"] for s in saves(tmp_path / "untimed")] == [4]


def test_short_host_memory_falls_back_to_synchronous_saves_with_a_message(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(trainer_module, "_mem_available", lambda: 1 << 20)  # 1 MiB: no room for a staged copy
    overrides = tiny("short", **{"train.steps": 4, "train.checkpoint_every": 2})
    Trainer(load_config(None, overrides)).train()
    saved = saves(tmp_path / "short")
    assert [s["step"] for s in saved] == [2, 4] and not any(s["async"] for s in saved), saved
    assert "asynchronous checkpoints off: host memory available" in capsys.readouterr().out
    monkeypatch.undo()
    Trainer(load_config(None, tiny("roomy", **{"train.steps": 4, "train.checkpoint_every": 2}))).train()
    assert [s["async"] for s in saves(tmp_path / "roomy")] == [True, False]  # step 2 in the background, the final save blocking
    assert_bitwise_equal(final_weights(tmp_path / "short"), final_weights(tmp_path / "roomy"))
