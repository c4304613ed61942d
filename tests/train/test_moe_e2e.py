"""A MoE model trains end to end: loss falls, expert load and aux loss land in metrics.jsonl,
the balancing bias is checkpointed, and suspend + resume equals a straight run bit for bit."""

import json

from luban.config import load_config
from luban.train.preempt import SuspendFlag
from luban.train.trainer import Trainer

from .conftest import assert_bitwise_equal, final_weights

MOE = {"model.preset": '"tiny-moe"', "model.layers": 3, "train.optimizer": '"adamw"'}


def _train(overrides, stop_at=None, resume=None, monkeypatch=None):
    trainer = Trainer(load_config(None, overrides))
    if stop_at is not None:
        monkeypatch.setattr(SuspendFlag, "agreed", lambda self: trainer.step == stop_at)
    return trainer.train(resume)


def test_moe_trains_logs_load_and_resumes_bit_exactly(tiny, tmp_path, monkeypatch):
    straight = _train(tiny("straight", **MOE))
    first = _train(tiny("split", **MOE), stop_at=4, monkeypatch=monkeypatch)
    assert first.suspended and first.step == 4
    monkeypatch.undo()
    second = _train(tiny("split", **MOE), resume="auto")
    assert second.step == straight.step == 8
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "split")
    assert_bitwise_equal(a, b)
    assert a["layers.1.mlp.router.expert_bias"].abs().sum() > 0  # the sigmoid router balanced, and it was saved
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").open() if '"loss"' in line]
    tokens = 4 * 32 * 2  # global batch x seq x experts_per_token, per MoE layer
    for r in records:
        assert sorted(r["moe_tokens_per_expert"]) == ["1", "2"]
        assert all(sum(load) == tokens and len(load) == 8 for load in r["moe_tokens_per_expert"].values())
        assert all(v >= 1.0 for v in r["moe_load_max_over_mean"].values())
        assert all(v > 0 for v in r["moe_aux_loss"].values()) and r["moe_dropped_tokens"] == {"1": 0, "2": 0}
    assert records[-1]["loss"] < records[0]["loss"]
