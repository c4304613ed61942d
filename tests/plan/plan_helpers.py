"""Shared helpers of the planner tests."""

from luban.model.presets import get_preset
from luban.plan.problem import Problem
from luban.plan.system import load_system


def make_problem(model="gpt3-175b", gpus=64, seq=2048, batch=64, system="dgx-a100-80g", **kw) -> Problem:
    cfg = get_preset(model) if isinstance(model, str) else model
    return Problem(cfg, load_system(system), gpus, seq, batch, **kw)
