"""Mixed precision: autocast for bf16/fp16 and dynamic loss scaling for fp16.

Weights, gradients and optimizer state stay fp32 (Micikevicius et al. 2018, "Mixed
Precision Training"). Under FSDP2 the compute dtype comes from ``MixedPrecisionPolicy``
instead of autocast. The loss scaler is luban's own (not ``torch.amp.GradScaler``) because
it must decide on the *global* gradient norm: a non-finite norm on any rank — any pipeline
stage, any shard — skips the step on every rank.
"""

from __future__ import annotations

import contextlib
import math

import torch

from luban.parallel.layout import ParallelLayout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
