"""How the engine runs one step's micro-batches: a ``Schedule`` behind one small protocol.

* ``MicroBatchLoop``: one model part, micro-batch after micro-batch, gradients accumulated
  (data-parallel gradient sync only on the last one, ``set_gradient_sync``);
* ``PipelineSchedule``: this rank's stages of a ``luban.parallel.pipeline.Pipeline`` driven by
  its ``torch.distributed.pipelining`` schedule.

Both backpropagate the loss times the loss scale (``LossScaler.backward_scale``, fp16: the
same per-token factor on every layout), leave that factor on the gradients in ``grad_scale``
and return the unscaled mean loss of this rank's micro-batches. ``saved(measured)`` gives the saved-tensor
context around a micro-batch's forward: activation offload on every one, and with
``measured=True`` (the first ``recorded_microbatches`` of them) the ``ActivationCounter``.
"""

from __future__ import annotations

from typing import Callable, ContextManager, Protocol

import torch
from torch import nn

from luban.model import moe
from luban.parallel.data_parallel import set_gradient_sync
from luban.parallel.layout import ParallelLayout
from luban.parallel.memory import local as _local
from luban.parallel.pipeline import Pipeline
from luban.parallel.precision import LossScaler

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Schedule(Protocol):
    parts: list[nn.Module]  # this rank's model parts (after every apply_* step)
    recorded_microbatches: int  # micro-batches ``saved(True)`` wraps in ``forward_backward``
    measurable: bool  # a step's saved activations are those of its micro-batches only
    grad_scale: float  # the factor the last forward_backward left on the gradients (fp16's loss scale)

    def forward_backward(self, tokens: torch.Tensor, labels: torch.Tensor,
                         saved: Callable[[bool], ContextManager]) -> torch.Tensor:
        """Forward and backward of every micro-batch; the mean loss (unscaled)."""

    def evaluate(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward only; the mean loss."""


class MicroBatchLoop:
    """One model part, ``layout.micro_batch`` samples at a time."""

    recorded_microbatches = 1  # activations have the same shapes every micro-batch: record the first
    measurable = True
    grad_scale = 1.0  # the factor the last forward_backward left on the gradients

    def __init__(self, module: nn.Module, layout: ParallelLayout, loss_fn: LossFn, scaler: LossScaler,
                 autocast: Callable[[], ContextManager]):
        self.parts, self.layout, self.loss_fn, self.scaler, self.autocast = [module], layout, loss_fn, scaler, autocast
        # the model computes its loss with the head fused (luban.model.head_loss); tensor
        # parallel keeps the logits for its vocab-parallel loss
        self.fused = layout.tp == 1

    def _loss(self, x, y):
        model = self.parts[0]
        return model(x, labels=y) if self.fused else self.loss_fn(model(x), y)

    def forward_backward(self, tokens, labels, saved) -> torch.Tensor:
        model, mb = self.parts[0], self.layout.micro_batch
        n = tokens.shape[0] // mb
        self.grad_scale = self.scaler.backward_scale(self.layout.dp * self.layout.cp)
        moe.set_aux_grad_scale(self.parts, self.grad_scale / n)  # backward runs on loss / n * grad_scale
        total = torch.zeros((), device=tokens.device)
        for i, (x, y) in enumerate(zip(tokens.split(mb), labels.split(mb))):
            with set_gradient_sync(model, self.layout, sync=i == n - 1):
                with saved(i == 0), self.autocast():
                    loss = self._loss(x, y) / n
                (loss * self.grad_scale).backward()
            total += _local(loss.detach())
        return total

    def evaluate(self, tokens, labels) -> torch.Tensor:
        """The mean over the same micro-batches as training: one forward of this rank's whole
        share held its activations and logits at once (memory training never needs), and a MoE
        capacity cut per micro-batch dropped other tokens than training and other layouts did."""
        mb = self.layout.micro_batch
        with self.autocast():
            losses = [_local(self._loss(x, y)).float() for x, y in zip(tokens.split(mb), labels.split(mb))]
        return torch.stack(losses).mean()


class PipelineSchedule:
    """A pipeline's stages on this rank; every micro-batch's activations are recorded."""

    grad_scale = 1.0  # the factor the last forward_backward left on the gradients

    def __init__(self, pipeline: Pipeline, loss_fn: LossFn, scaler: LossScaler, autocast: Callable[[], ContextManager],
                 data_ranks: int = 1):
        self.pipeline, self.parts, self.loss_fn, self.scaler, self.autocast = (
            pipeline, pipeline.parts, loss_fn, scaler, autocast)
        self.data_ranks = data_ranks  # dp·cp
        self.recorded_microbatches = pipeline.n_microbatches
        self.measurable = False  # the first step also runs torch's shape-inference forward (saved, then freed)
        self._scaled_loss = self._scaled  # one object: the pipeline caches a torch schedule per loss fn

    def _scaled(self, logits, labels):
        return self.loss_fn(logits, labels) * self.grad_scale

    def forward_backward(self, tokens, labels, saved) -> torch.Tensor:
        # each micro-batch's loss is backpropagated whole, the schedule divides the sum by n after
        self.grad_scale = self.scaler.backward_scale(self.data_ranks, self.pipeline.n_microbatches)
        moe.set_aux_grad_scale(self.parts, self.grad_scale)
        with saved(True), self.autocast():
            loss = self.pipeline.forward_backward(tokens, labels, self._scaled_loss)
        self.measurable = True
        return loss / self.grad_scale

    def evaluate(self, tokens, labels) -> torch.Tensor:
        with self.autocast():
            return self.pipeline.evaluate(tokens, labels, self.loss_fn)
