"""Mixed precision: autocast for bf16/fp16 and dynamic loss scaling for fp16.

Weights, gradients and optimizer state stay fp32 (Micikevicius et al. 2018, "Mixed
Precision Training") on every layout, and gradients are reduced in fp32. Under FSDP2 bf16 is
FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``; fp16 is autocast, as everywhere else
(``FSDP_PARAM_DTYPE`` says why). The loss scaler is luban's own (not ``torch.amp.GradScaler``) because
it must decide on the *global* gradient norm: a non-finite norm on any rank — any pipeline
stage, any shard — skips the step on every rank.
"""

from __future__ import annotations

import contextlib
import math

import torch

from luban.parallel.layout import FSDP_PARAM_PRECISION, ParallelLayout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# What FSDP2 all-gathers the weights in (``MixedPrecisionPolicy.param_dtype``; None: the stored fp32
# weights, with autocast around the forward as in one process). FSDP2's cast makes the *whole* forward
# run in that dtype: embeddings, residual stream, norms, and the gradients of norm weights and
# embeddings (sums over every token) come out in it, where autocast keeps them fp32 and casts only
# the matmuls' inputs.
# * bf16 has fp32's exponent range, so that overflows nothing autocast does not; it only rounds more
#   (tiny, one step, 2026-11-28: each gradient at most 1.4e-2 from fp32's, relative, against 1.0e-2 in
#   one process; docs/training.md), and the all-gather moves half the bytes of fp32 (torchtitan's choice).
# * fp16 (largest value 65504) overflowed where one process did not: tiny, dp 2, zero 2, one step, the
#   largest loss scale without overflow was 2^18 against 2^20 for one process and DDP. With autocast
#   under FSDP2 the arithmetic is one process's (tests/parallel/test_review_1128.py); the price is an
#   fp32 all-gather (2x the bytes of fp16, and fp32 gathered weights under zero 1/2), plus autocast's
#   fp16 copies of the weights, which backward keeps as one process does (unsharded, even under zero 3,
#   unless recompute redoes the casts; docs/parallelism.md).
# (the choice, by name: ``layout.FSDP_PARAM_PRECISION``, which the planner reads without torch)
FSDP_PARAM_DTYPE = {p: None if name is None else DTYPES[name] for p, name in FSDP_PARAM_PRECISION.items()}


def autocast(layout: ParallelLayout, device: torch.device):
    """bf16/fp16 autocast for the forward pass (no-op for fp32)."""
    if layout.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[layout.precision])


class LossScaler:
    """Dynamic loss scaling: x0.5 on overflow (step skipped), x2 after ``growth_interval`` good steps.

    ``scale`` means the same on every layout: the factor of the gradient of each token's loss is
    ``scale / tokens of the global batch``, as in one process (``backward_scale``), so a layout
    overflows where one process does and a checkpoint's scale resumes on any layout."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0

    def update(self, grad_norm: float) -> bool:
        """Record the (unscaled, global) gradient norm; return whether the step may be applied."""
        if not self.enabled:
            return True
        if not math.isfinite(grad_norm):
            self.scale, self.good_steps = self.scale / 2, 0
            return False
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2
        return True

    def backward_scale(self, data_ranks: int, microbatches: int = 1) -> float:
        """The factor a backward multiplies one micro-batch's (mean) loss by: ``scale`` over the
        ``data_ranks`` (dp·cp) whose mean gradient data parallel takes and over the ``microbatches``
        whose gradients are summed unweighted (1 where the loss is already divided by their
        number). The gradients then carry this factor (``Engine.step`` divides it out). Each rank's
        loss is the mean over its own tokens: scaled by ``scale`` alone, a rank's tokens got
        gradients dp·cp (times its pipeline micro-batches) larger than in one process, and fp16
        overflowed at a scale one process, or the layout that saved it, ran fine with. 1 when off."""
        return self.scale / (data_ranks * microbatches) if self.enabled else 1.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        """A disabled scaler (bf16, fp32) keeps scale 1: an fp16 checkpoint's scale resumed into it
        scaled every gradient of the backward, which nothing divided out again."""
        if self.enabled:
            self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
