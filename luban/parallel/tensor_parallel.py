"""Tensor parallelism (Shoeybi et al. 2019, Megatron-LM) and sequence parallelism
(Korthikanti et al. 2022) with DTensor: ``parallelize_module`` over the ``tp`` mesh.

Per block: q/k/v and the MLP's up/gate projections are column-parallel (each rank owns a
slice of the heads / hidden units), the output projections are row-parallel (one all-reduce
per sub-layer forward and backward). With ``sp`` the norms and the residual stream are
sharded along the sequence (``SequenceParallel``): the all-reduce becomes a reduce-scatter
after each sub-layer plus an all-gather before the next (``PrepareModuleInput``), and norm
activations shrink by tp. The token embedding is vocab-parallel (``RowwiseParallel`` on an
``nn.Embedding`` masks out-of-shard ids), the LM head is column-parallel over the vocabulary
and the loss is computed on the vocab-sharded logits with ``loss_parallel`` (no rank ever
holds full logits). The model returns those logits as a ``DTensor`` (``Shard(-1)``), the way
torchtitan feeds ``loss_parallel``: not its local tensor, because ``to_local()`` returns a
*view*, and a view as the output of an FSDP2-wrapped model (tp with dp·cp > 1, zero >= 1)
is what FSDP2 warns about ("returned a view tensor ... will silently drop the pre-backward
hook": an in-place op on it would replace the autograd node its pre-backward hook is on).
Tied embeddings stay tied: both are ``Shard(0)`` of one DTensor. qk-norm weights (one per
layer for all heads, applied to this rank's heads) are replicated over tp with their input
sharded on the head dimension, so their gradients are summed over tp.
A mixture-of-experts feed-forward is not tensor-parallel: its router and experts are
replicated over tp and every tp rank runs it on the whole sequence (with ``sp`` the input is
gathered and the output cut back to this rank's sequence shard); experts are spread by
expert parallel instead (``luban.parallel.expert_parallel``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                               RowwiseParallel, SequenceParallel, loss_parallel, parallelize_module)

from luban.model.moe import MoE

from luban.model.transformer import Transformer


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, sp: bool) -> None:
    """Shard ``model`` (a whole model or a pipeline stage of one) in place over ``tp_mesh``."""
    residual = Shard(1) if sp else Replicate()  # layout of the residual stream between sub-layers
    plan = {}
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if sp:  # the stage's first block takes the (replicated) embedding and keeps its sequence shard
            first = next(iter(model.layers))
            plan[f"layers.{first}"] = PrepareModuleInput(input_layouts=(Replicate(), None),
                                                         desired_input_layouts=(Shard(1), None), use_local_output=True)
    for name, block in model.layers.items():
        p = f"layers.{name}"
        for proj in ("wq", "wk", "wv"):
            plan[f"{p}.attn.{proj}"] = ColwiseParallel()
        plan[f"{p}.attn.wo"] = RowwiseParallel(output_layouts=residual)
        if block.attn.qk_norm:  # one weight for every head, each rank normalises its own heads: the weight
            # replicated over tp and its input sharded on the head dim, so its gradient is summed over tp
            # (as a plain parameter each rank kept its heads' share: the copies parted, the norm was off)
            for norm in ("q_norm", "k_norm"):
                plan[f"{p}.attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        moe = isinstance(block.mlp, MoE)
        if not moe:
            for proj in ("w_gate", "w_up") if block.mlp.swiglu else ("w_up",):
                plan[f"{p}.mlp.{proj}"] = ColwiseParallel()
            plan[f"{p}.mlp.w_down"] = RowwiseParallel(output_layouts=residual)
        if sp:
            plan[f"{p}.norm1"] = SequenceParallel()
            plan[f"{p}.norm2"] = SequenceParallel()
            plan[f"{p}.attn"] = PrepareModuleInput(input_layouts=(Shard(1), None),
                                                   desired_input_layouts=(Replicate(), None), use_local_output=True)
            if moe:  # whole sequence in, this rank's sequence shard out
                plan[f"{p}.mlp"] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                    output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
            else:
                plan[f"{p}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                      use_local_output=True)
    if model.norm is not None and sp:
        plan["norm"] = SequenceParallel()
    if model.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    tied = model.tok_emb is not None and model.lm_head is not None and model.lm_head.weight is model.tok_emb.weight
    parallelize_module(model, tp_mesh, plan)
    if tied:
        model.lm_head.weight = model.tok_emb.weight


def vocab_parallel_loss(tp_mesh: DeviceMesh, vocab: int):
    """Mean cross-entropy of vocab-sharded logits: the model's ``DTensor`` [b, s, V] ``Shard(2)``,
    or a local tensor [b, s, V/tp] (V may not divide by tp); call it, and the backward, under
    ``loss_parallel()``."""
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not isinstance(logits, DTensor):
            shape = (*logits.shape[:-1], vocab)
            stride = (shape[1] * vocab, vocab, 1)
            logits = DTensor.from_local(logits, tp_mesh, [Shard(2)], run_check=False, shape=shape, stride=stride)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    return loss_fn


__all__ = ["apply_tensor_parallel", "vocab_parallel_loss", "loss_parallel"]
