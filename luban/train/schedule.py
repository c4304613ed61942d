"""Learning-rate schedule: linear warmup then cosine decay to ``min_lr`` (Loshchilov & Hutter 2017).

A pure function of the step, so resuming needs only the step number.
"""

import math


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total``."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))
