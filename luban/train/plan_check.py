"""``--parallel auto``: plan the layout before launch, and compare the plan with the run after.

Before launch the planner (``luban.plan.auto.choose_layout``) picks the fastest layout that
fits for the world size and system profile; the prediction is written to
``<run>/plan.json``. When the run ends, rank 0 gathers every rank's measured bytes and writes
``<run>/plan_vs_measured.json``: predicted vs measured parameter, gradient and optimizer
bytes and activation bytes per micro-batch (on the fullest rank, as the planner predicts),
and the median step time of the steps after the warm-up (``Trainer``: the device is drained at
its end, so a log window that holds warm-up steps does not mix them into the later steps' mean).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from luban.config import RunConfig

MEMORY_KEYS = {"param_bytes": "param_bytes", "grad_bytes": "grad_bytes", "optimizer_bytes": "optimizer_bytes",
               "activation_bytes": "activation_bytes_per_microbatch"}


def plan(cfg: RunConfig, world: int) -> tuple[RunConfig, dict]:
    """Choose the layout; returns the config with it and the prediction (``write_plan`` records it)."""
    from luban.plan.auto import choose_layout
    from luban.plan.system import load_system

    system = load_system(cfg.run.system, key="run.system") if cfg.run.system else None
    layout, est = choose_layout(cfg.model, world, cfg.train.global_batch, cfg.seq_len,
                                system=system, optimizer=cfg.train.optimizer)
    prediction = {"layout": layout.to_dict(), "system": est.system, "step_time_s": est.step_time_s,
                  "summary": est.extra.get("summary", ""),
                  **{key: getattr(est, attr) for key, attr in MEMORY_KEYS.items()}}
    return cfg.replace(parallel=layout), prediction


def write_plan(run_dir: Path, prediction: dict) -> None:
    """``<run>/plan.json``, which ``compare`` reads when the run ends (run.dir checked and made by then)."""
    (run_dir / "plan.json").write_text(json.dumps(prediction, indent=1))


def layout_overrides(layout: dict) -> list[str]:
    """``--set parallel.k=v`` arguments that pin a planned layout for the launched ranks."""
    return [f"parallel.{k}={json.dumps(v)}" for k, v in layout.items()]


def describe(prediction: dict) -> str:
    gib = 2**30
    mem = " + ".join(f"{k.split('_')[0]} {prediction[k] / gib:.3f}" for k in MEMORY_KEYS)
    return (f"plan: {prediction['summary']} on {prediction['system']}: predicted step {prediction['step_time_s']:.3f} s; "
            f"per rank GiB: {mem} (activations per micro-batch)")


def planned(run_dir: Path) -> bool:
    """Whether ``--parallel auto`` planned this run (``write_plan``): ``compare`` will compare with the plan."""
    return (run_dir / "plan.json").is_file()


def compare(run_dir: Path, memory_by_rank: list[dict], step_times: list[float]) -> dict | None:
    """Write plan_vs_measured.json if this run was planned; returns the comparison. ``step_times``: the
    seconds of each step after the warm-up (``Trainer``'s ``PLAN_WARMUP_STEPS``)."""
    plan_file = run_dir / "plan.json"
    if not planned(run_dir) or not memory_by_rank or not step_times:
        return None
    try:  # luban's own file, but in a folder a user can edit: an unreadable one skips the comparison
        prediction = json.loads(plan_file.read_text())
        if not isinstance(prediction, dict) or not all(
                isinstance(prediction.get(k), (int, float)) for k in (*MEMORY_KEYS, "step_time_s")):
            return None
    except (OSError, ValueError, RecursionError):
        return None
    rows = {}
    for key in MEMORY_KEYS:
        measured = max(m.get(key, 0) for m in memory_by_rank)
        rows[key] = {"predicted": prediction[key], "measured": measured,
                     "error": (prediction[key] - measured) / measured if measured else None}
    measured_step = statistics.median(step_times)
    rows["step_time_s"] = {"predicted": prediction["step_time_s"], "measured": measured_step,
                           "error": (prediction["step_time_s"] - measured_step) / measured_step}
    (run_dir / "plan_vs_measured.json").write_text(json.dumps(rows, indent=1))
    return rows
