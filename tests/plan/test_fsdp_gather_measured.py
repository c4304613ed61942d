"""What luban's FSDP2 all-gathers, measured (``runtimes.Luban.gather_bytes``), on 2 gloo ranks.

Each rank builds luban's Engine (tiny, dp 2, zero 3, one micro-batch) and runs one forward and
backward with ``torch.distributed``'s all-gathers wrapped (``all_gather_single``, what FSDP2's
``DefaultAllGather`` calls in torch 2.13, and ``all_gather_into_tensor``), recording each gather's
dtype and output bytes. Zero 3 gathers every FSDP2 group once in forward and once in backward,
so the bytes per gathered parameter are the gathered bytes over 2 x the parameters.

Measured (2026-11-28, torch 2.13 CPU): bf16 gathers bf16, 2 bytes per parameter (luban's
``MixedPrecisionPolicy(param_dtype=bf16)``, ``luban.parallel.precision.FSDP_PARAM_DTYPE``); fp16 and
fp32 gather the stored fp32 weights, 4 bytes. Before this the planner charged luban 4 bytes in bf16
too (``Luban.gather_half = False``, "as measured" before luban cast bf16 with FSDP2, 2026-11-21).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.child import launch as bounded_launch

PRECISIONS = ("bf16", "fp16", "fp32")


def run(job: dict) -> dict:
    import torch.distributed as dist

    from luban.parallel.engine import OptimizerConfig, build_engine, unwrap
    from luban.parallel.layout import ParallelLayout
    from tests.parallel.harness import batch, model_cfg

    cfg = model_cfg(job)
    layout = ParallelLayout.from_dict(job["layout"])
    gb = 2  # one sequence per rank: one micro-batch
    engine = build_engine(cfg, layout, OptimizerConfig(name="sgd", weight_decay=0.0), gb, seed=0, device=torch.device("cpu"))
    params = sum((p.full_tensor() if hasattr(p, "full_tensor") else p).numel()
                 for part in engine.model_parts for p in unwrap(part).parameters())
    seen = []
    originals = {name: getattr(dist, name) for name in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, name)}

    def wrapped(original):
        def gather(output_tensor, input_tensor, *args, **kwargs):
            seen.append((str(output_tensor.dtype), output_tensor.numel() * output_tensor.element_size()))
            return original(output_tensor, input_tensor, *args, **kwargs)
        return gather

    tokens, labels = batch(0, gb, cfg)
    rows = slice(engine.dp_rank * gb // layout.dp, (engine.dp_rank + 1) * gb // layout.dp)
    for name, original in originals.items():
        setattr(dist, name, wrapped(original))
    try:
        engine.forward_backward(tokens[rows], labels[rows])
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    engine.barrier()
    return {"gathers": seen, "params": params}


def main(jobs_file: str, out_dir: str) -> int:
    from tests.parallel import harness

    return harness.main(jobs_file, out_dir, run=run)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-gather")
    jobs = [{"name": f"zero3-{p}", "preset": "tiny", "layout": {"dp": 2, "zero": 3, "precision": p}} for p in PRECISIONS]
    (out / "jobs.json").write_text(json.dumps(jobs))
    code, output = bounded_launch([out / "jobs.json", out], 2, "tests.plan.test_fsdp_gather_measured", timeout=300,
                                  log=out / "ranks.log")
    return out, code, output


@pytest.mark.multirank
@pytest.mark.parametrize("precision", PRECISIONS)
def test_luban_gather_bytes_follow_what_fsdp2_gathers(spawned, precision):
    from luban.plan import runtimes
    from luban.parallel.layout import PRECISIONS as CODES
    from tests.parallel import harness

    per_rank = harness.spawned_results(spawned, f"zero3-{precision}", nproc=2)
    gathers, params = per_rank[0]["gathers"], per_rank[0]["params"]
    dtypes = {d for d, _ in gathers}
    # zero 3, one micro-batch: each FSDP2 group (the blocks and the rest) gathered once in forward, once in backward
    measured = sum(b for _, b in gathers) / (2 * params)
    expected_dtype = {"bf16": "torch.bfloat16"}.get(precision, "torch.float32")
    assert gathers and dtypes == {expected_dtype}, gathers
    planned = runtimes.get("luban").gather_bytes(4.0, CODES.index(precision))
    assert float(planned) == pytest.approx(measured, rel=0.02), (precision, measured)  # FSDP2 pads shards to dp


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
