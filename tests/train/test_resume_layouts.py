"""Bitwise resume under every layout family, in multi-rank runs.

Each case trains ``STEPS`` steps straight through, and again suspended by a real SIGUSR1 on one
rank after step ``STOP`` and resumed with ``--resume auto`` semantics; ``resume_ranks.py`` runs
all cases in one spawn of 4 gloo ranks. The two final checkpoints must hold the same tensors bit
for bit (model and optimizer state, every key), the same per-rank RNG states and loader
position, and the two runs' loss and grad-norm traces must be equal at every step.

DDP (``zero = 0``) runs here in every form it takes (dense, several buckets, MoE with the experts
in DDP and under expert parallel, under pipeline and context parallel): a single-process test
cannot see what went wrong there — on 3457f4b all four DDP cases differed from the first resumed
step on (``luban/parallel/data_parallel.py``, ``pipeline.py``). The first case's straight run is
its ranks' first training in the process: that is how the RNG drawn once per process by the MFU
peak measurement (``luban.plan.probe.matmul_flops``) showed up in the saved RNG states.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from luban.parallel.launch import launch

from .conftest import tiny_overrides

STEPS, STOP, NPROC = 4, 2, 4
LLAMA = {"model.preset": '"tiny-llama"'}
MOE = {"model.preset": '"tiny-moe"'}


def _layout(**kw):
    return {f"parallel.{k}": (str(v).lower() if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) else v)
            for k, v in kw.items()}


CASES = {  # name: model and [parallel] keys; 4 ranks, global batch 8
    # DDP: several buckets (1 MiB) and two micro-batches accumulated under no_sync; MoE with the
    # experts in DDP's buckets; under expert + context parallel; under pipeline + expert parallel
    "ddp-dp4": {**LLAMA, **_layout(dp=4, micro_batch=1, bucket_mb=1)},
    "ddp-dp4-moe": {**MOE, **_layout(dp=4)},
    "ddp-cp2-dp2-ep2": {**MOE, **_layout(cp=2, dp=2, ep=2)},
    "ddp-pp2-dp2-ep2": {**MOE, **_layout(pp=2, dp=2, ep=2, micro_batch=2)},
    # ZeRO 1/2/3 with tensor (+ sequence), context, expert and pipeline parallel
    "zero1-tp2-sp-dp2": {**LLAMA, **_layout(tp=2, sp=True, dp=2, zero=1)},
    "zero2-cp2-dp2-ep4": {**MOE, **_layout(cp=2, dp=2, ep=4, zero=2)},
    "zero3-pp2-dp2": {**LLAMA, **_layout(pp=2, dp=2, zero=3, micro_batch=2)},
}


def _overrides(data: Path, run: Path, keys: dict) -> list[str]:
    return tiny_overrides(data, run, **{"train.steps": STEPS, "train.global_batch": 8, "train.eval_every": 0,
                                        "train.warmup_steps": 2, **keys})


def _tensors(ckpt: Path) -> dict:
    out = ckpt.parent / f"{ckpt.parent.parent.name}.pt"
    dcp_to_torch_save(ckpt, out)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        else:
            flat[prefix] = value
    walk("", torch.load(out, weights_only=False))
    return flat


def _trace(run: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"]) for line in (run / "metrics.jsonl").open()
            if "grad_norm" in (r := json.loads(line))]


def _differences(straight: Path, split: Path) -> list[str]:
    """What differs between the two runs' final checkpoints and traces (empty: bitwise equal)."""
    errors = sorted(str(p.read_text()) for p in split.glob("error.rank*.txt"))
    if errors:
        return [f"failed: {errors[0][-2000:]}"]
    final = f"checkpoints/step_{STEPS:07d}"
    a, b = _tensors(straight / final), _tensors(split / final)
    out = []
    if a.keys() != b.keys():
        out.append(f"checkpoint keys differ: {sorted(a.keys() ^ b.keys())[:5]}")
    tensors = [k for k in a.keys() & b.keys() if isinstance(a[k], torch.Tensor)]
    differ = [k for k in tensors if not torch.equal(a[k], b[k])]
    if differ:
        worst = max((a[k].double() - b[k].double()).abs().max().item() for k in differ)
        out.append(f"{len(differ)} of {len(tensors)} checkpoint tensors differ (max {worst:.2g}), e.g. {sorted(differ)[:3]}")
    other = [k for k in a.keys() & b.keys() if k not in tensors and a[k] != b[k]]
    if other:
        out.append(f"checkpoint values differ: {other[:3]}")
    for rng in sorted((straight / final).glob("rng_rank*.pt")):
        if not torch.equal(torch.load(rng)["cpu"], torch.load(split / final / rng.name)["cpu"]):
            out.append(f"{rng.name} differs")
    meta_a, meta_b = (json.loads((p / final / "meta.json").read_text()) for p in (straight, split))
    if (meta_a["step"], meta_a["loader"]) != (meta_b["step"], meta_b["loader"]):
        out.append(f"meta differs: {meta_a['loader']} vs {meta_b['loader']}")
    ta, tb = _trace(straight), _trace(split)
    if [t[0] for t in tb] != list(range(1, STEPS + 1)):
        out.append(f"split run logged steps {[t[0] for t in tb]}")
    first = next((s for (s, *x), (_, *y) in zip(ta, tb) if x != y), None)
    if first is not None:
        out.append(f"loss/grad norm first differ at step {first}: {ta[first - 1][1:]} vs {tb[first - 1][1:]}")
    return out


@pytest.mark.multirank
def test_suspend_and_resume_is_bitwise_on_every_layout_family(small_dataset, tmp_path, monkeypatch):
    cases = [{"name": name, "straight": _overrides(small_dataset, tmp_path / name / "straight", keys),
              "split": _overrides(small_dataset, tmp_path / name / "split", keys), "stop_at": STOP}
             for name, keys in CASES.items()]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("LUBAN_PEAK_FLOPS", raising=False)  # the ranks measure their peak, as users' do (above)
    code = launch([str(tmp_path / "cases.json")], nproc=NPROC, module="tests.train.resume_ranks")
    report = {name: _differences(tmp_path / name / "straight", tmp_path / name / "split")
              for name in CASES if (tmp_path / name / "split").exists()}
    assert code == 0 and len(report) == len(CASES), (code, report)
    bad = {name: diffs for name, diffs in report.items() if diffs}
    print(json.dumps(report, indent=1))
    assert not bad, "\n".join(f"{name}: {'; '.join(d)}" for name, d in bad.items())
