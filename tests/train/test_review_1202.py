"""Review of 2026-12-02: the step window around a periodic checkpoint.

The loop reads and drains the device only on logged steps (``StepWindow``). A periodic checkpoint on
a step that does not log reads the device too (its state dict), so on a GPU the steps queued since the
last drain finished inside the save, outside the window: the logged mean step time read low by up to
the window's whole device time. The loop now drains before such a save, and times the drain in the
step (every save follows a drain of its own step).
"""

from luban.config import load_config
from luban.train import trainer as trainer_module
from luban.train.trainer import Trainer


def test_every_save_follows_a_drain_of_its_step(tiny, monkeypatch):
    events = []
    real_save = Trainer.save
    monkeypatch.setattr(trainer_module, "drain", lambda device: events.append(("drain", trainer.step)))
    monkeypatch.setattr(Trainer, "save", lambda self, blocking=False: (events.append(("save", self.step)),
                                                                      real_save(self, blocking))[1])
    trainer = Trainer(load_config(None, tiny("window", **{"train.steps": 9, "train.checkpoint_every": 3,
                                                         "train.log_every": 4, "train.eval_every": 0})))
    trainer.train()
    saves = [i for i, e in enumerate(events) if e[0] == "save"]
    assert [events[i][1] for i in saves] == [3, 6, 9]
    for i in saves:
        assert events[i - 1] == ("drain", events[i][1]), events
    assert [step for kind, step in events if kind == "drain"] == [3, 4, 6, 8, 9]  # saves, logs, the end


def test_a_moe_run_reads_the_device_only_on_logged_steps(tiny, monkeypatch):
    """A MoE run read its per-layer expert counts on the host twice a step: the experts' loop (one
    ``tolist`` per MoE layer and micro-batch) and the engine's load metrics (read every step for the
    record of the steps that log). With grouped GEMMs (forced here: on the CPU ATen's fallback of
    ``torch._grouped_mm``; on a Hopper GPU its fused kernel) and the metrics read when logged, the
    steps that do not log read nothing (counted as ``bench/train_overhead.py`` counts)."""
    import importlib.util
    from pathlib import Path

    from luban.model import moe

    path = Path(__file__).resolve().parents[2] / "bench" / "train_overhead.py"
    spec = importlib.util.spec_from_file_location("train_overhead", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(moe, "grouped_gemm_ok", lambda device, dtype, widths, groups: True)
    config = load_config(None, tiny("moe", **{"model.preset": '"tiny-moe"', "model.layers": 2, "train.steps": 9,
                                              "train.log_every": 4, "train.eval_every": 0}))
    with bench.counting_reads() as reads:
        Trainer(config).train()
    assert set(reads) <= {4, 8, 9}, dict(reads)  # the logged steps (and the last)
    assert reads[4] > 0 and reads[8] > 0
