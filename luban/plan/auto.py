"""``choose_layout``: the layout the trainer uses when the config does not fix one.

Plans with ``runtime="luban"`` (luban's own memory accounting: fp32 weights, gradients and
optimizer state; the tensors luban's transformer saves) on the given system profile, or on a
probe of this machine (measured once and cached, ``luban.plan.probe.cached_profile``).
"""

from __future__ import annotations

from luban.errors import LubanError
from luban.model.config import ModelConfig
from luban.parallel.layout import LUBAN_RULES, OFFLOADS, SCHEDULES, ParallelLayout
from luban.plan.estimate import Estimate
from luban.plan.explain import describe
from luban.plan.problem import Problem
from luban.plan.search import SearchResult, search
from luban.plan.system import System, load_system


RUNTIME_OFFLOADS = tuple(OFFLOADS.index(o) for o in LUBAN_RULES.offloads)  # what luban's runtime runs


def auto_offloads(system: System) -> tuple:
    """What ``--parallel auto`` may offload on ``system``: on a CPU profile (it has ``[cpu]`` terms) the
    device is the host, so moving state or activations "to the host" frees no memory and only costs
    copies: nothing. (With bf16 faster than fp32 on a probe, one process chose zero 3 + offload =
    params for FSDP2's bf16 casts: predicted 17% faster, measured 12-16% slower in CPU time.)"""
    return (OFFLOADS.index("none"),) if system.cpu else RUNTIME_OFFLOADS


def choose_layout(model_cfg: ModelConfig, world_size: int, global_batch: int, seq_len: int,
                  system: "System | str | None" = None, *, precision: str | None = None,
                  optimizer: str = "adamw", schedules=SCHEDULES, offloads=None) -> tuple[ParallelLayout, Estimate]:
    """The fastest valid layout that fits, and its estimate (per-rank bytes, step time).

    ``precision`` defaults to the faster of bf16 and fp32 on the system (fp32 on most CPUs);
    ``schedules`` and ``offloads`` restrict the search to what the runtime supports (``offloads``
    default: ``auto_offloads``).
    """
    problem, result = candidates(model_cfg, world_size, global_batch, seq_len, system, precision=precision,
                                 optimizer=optimizer, schedules=schedules, offloads=offloads, top=1)
    if not result.best:
        worst = max(result.rejected, key=result.rejected.get) if result.rejected else "no candidates"
        raise LubanError(f"plan: no layout of {model_cfg.name} on {world_size} x {problem.system.name} with global_batch = "
                         f"{global_batch}, seq_len = {seq_len} is valid and fits (most common reason: {worst})")
    best = result.best[0]
    best.extra["summary"] = describe(best.layout)
    return best.layout, best


def candidates(model_cfg: ModelConfig, world_size: int, global_batch: int, seq_len: int,
               system: "System | str | None" = None, *, precision: str | None = None, optimizer: str = "adamw",
               schedules=SCHEDULES, offloads=None, top: int = 1) -> tuple[Problem, SearchResult]:
    """The search ``choose_layout`` runs: the ``top`` fastest valid layouts that fit (a large
    ``top``: every layout ``--parallel auto`` can choose on this system; tests sweep them; ``offloads``
    default: ``auto_offloads``)."""
    if system is None:
        from luban.plan.probe import cached_profile

        system = System.from_dict(cached_profile(), source="probe")
    system = load_system(system)
    precision = precision or system.faster_precision()
    offloads = auto_offloads(system) if offloads is None else offloads
    problem = Problem(model_cfg, system, world_size, seq_len, global_batch, runtime="luban", optimizer=optimizer)
    return problem, search(problem, top=top, precision=precision, schedules=schedules, offloads=offloads)
