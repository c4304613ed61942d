"""Framework overhead on CPU: ATen operations per layer and per micro-batch of luban's model.

At the small shapes luban trains on a CPU, a step's time is mostly the fixed cost of each
operation (Python, autograd, dispatcher, kernel entry and OpenMP fork/join), not its FLOPs. The
planner splits that cost into a property of the machine, seconds per ATen operation
(``luban plan probe`` measures it, ``op_overhead_s``), and a property of the model, the number
of operations its forward and backward dispatch, counted here with a ``TorchDispatchMode`` on a
shrunk copy of the configuration: the same structure (architecture, norm, activation, position,
biases, tied head, head ratio), tiny widths. One count per configuration, cached.
"""

from __future__ import annotations

import functools

from luban.model.config import ModelConfig

TINY = dict(head_dim=8, seq_len=16, vocab=64)  # widths of the shrunk copy; the op count does not depend on them


def shrink(cfg: ModelConfig, layers: int) -> ModelConfig:
    """``cfg``'s structure at tiny widths with ``layers`` layers; a MoE model's copy has only MoE
    layers (``model_overhead_counts`` averages them with its dense layers')."""
    kv = max(1, cfg.kv_heads * 2 // cfg.heads)  # keeps grouped-query attention grouped
    moe = {"dense_layers": 0, "expert_ffn_hidden": 24} if cfg.moe else {}
    return cfg.replace(hidden=16, heads=2, kv_heads=kv, ffn_hidden=24, layers=layers, **moe, **TINY)


def count_ops(cfg: ModelConfig, micro_batch: int = 1) -> int:
    """ATen operations dispatched by one forward + backward (loss included) of ``cfg``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from luban.model.transformer import build_model, lm_loss

    class Counter(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab, (micro_batch, cfg.seq_len))
    with Counter() as counter:
        lm_loss(model(x), x).backward()
    return counter.ops


def count_tensors(cfg: ModelConfig) -> int:
    """Parameter tensors of ``cfg`` (the optimizer step and the gradient norm touch each once)."""
    import torch

    from luban.model.transformer import Transformer

    with torch.device("meta"):
        return len(list(Transformer(cfg).parameters()))


@functools.lru_cache(maxsize=64)
def model_overhead_counts(cfg: ModelConfig) -> dict:
    """Per layer and for the rest of the model (embedding, final norm, head, loss): ATen ops of
    one forward + backward, and parameter tensors; from 1- and 2-layer shrunk copies."""
    counts = {}
    for kind, count in (("ops", count_ops), ("tensors", count_tensors)):
        one, two = count(shrink(cfg, 1)), count(shrink(cfg, 2))
        counts[f"layer_{kind}"], counts[f"rest_{kind}"] = two - one, 2 * one - two
    if cfg.moe and cfg.dense_layers:  # the average layer, as the planner's other per-layer terms
        dense = model_overhead_counts(cfg.replace(experts=0, shared_experts=0, dense_layers=0))
        for kind in ("ops", "tensors"):
            key = f"layer_{kind}"
            counts[key] = (cfg.moe_layers * counts[key] + cfg.dense_layers * dense[key]) / cfg.layers
    return counts
