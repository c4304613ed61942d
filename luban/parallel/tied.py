"""Tied input embedding and LM head (Press & Wolf 2017) across pipeline stages: one object
owns everything the tie needs.

In the unsplit model the LM head *is* the token embedding (one parameter). When the pipeline
puts them on different stages, the last stage holds a second copy:

* built under the embedding's name, so both copies start equal (``tie_stage``);
* their gradients are summed before every step, so both copies stay equal (``sync_grads``;
  loop schedules over the group {first stage's rank, last stage's rank} of each pipeline,
  V schedules on the one rank that holds both ends);
* the copy is counted once in the global gradient norm (``norm_skip``);
* its optimizer state is saved under the embedding's name, the one the unsplit model uses,
  so checkpoints reshard across ``pp`` (``save_names``/``load_names``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from luban.model.config import ModelConfig
from luban.model.transformer import init_weights
from luban.parallel import schedules
from luban.parallel.data_parallel import unwrap
from luban.parallel.layout import ParallelLayout
from luban.parallel.memory import local as _local

EMBEDDING, HEAD = "tok_emb.weight", "lm_head.weight"


def tie_stage(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Tie a freshly initialised stage: the head *is* the embedding when the stage holds both;
    a head without the embedding is initialised under the embedding's name (the same values)."""
    if not cfg.tie_embeddings or model.lm_head is None:
        return
    if model.tok_emb is not None:
        model.lm_head.weight = model.tok_emb.weight
        return
    holder = nn.Module()
    holder.tok_emb = nn.Embedding(1, 1, device="meta")
    holder.tok_emb.weight = model.lm_head.weight
    init_weights(holder, cfg, seed)


def tie_group(pp_mesh: DeviceMesh) -> dist.ProcessGroup:
    """The group {rank of stage 0, rank of the last stage} of this rank's pipeline, for summing
    tied-embedding gradients (loop style; built collectively, every rank calls it)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pp_mesh.mesh.flatten().tolist())
    mine = pp_mesh.mesh.flatten().tolist()
    group = None
    for ranks in sorted({tuple(g) for g in gathered}):
        new = dist.new_group([ranks[0], ranks[-1]])
        if list(ranks) == mine:
            group = new
    return group


def _rename(optim_sd: dict, old: str, new: str) -> dict:
    """Flattened optimizer state keys (``state.<param>.<key>``, ``param_groups.<param>.<key>``)
    of parameter ``old`` renamed to ``new``."""
    return {k.replace(f".{old}.", f".{new}.", 1) if k.split(".", 1)[1].startswith(old + ".") else k: v
            for k, v in optim_sd.items()}


class TiedEmbedding:
    """The tied embedding copies on this rank's model parts (none unless pp > 1 splits them).
    Constructed on every rank (the loop schedules' group is built collectively)."""

    def __init__(self, parts: list[nn.Module], cfg: ModelConfig, layout: ParallelLayout, mesh):
        self.tied = cfg.tie_embeddings
        inner = [unwrap(p) for p in parts]
        split = self.tied and layout.pp > 1
        self.params: list[nn.Parameter] = []
        self.group = None
        if split:
            self.params = [m.tok_emb.weight for m in inner if m.tok_emb is not None]
            self.params += [m.lm_head.weight for m in inner if m.lm_head is not None]
            if schedules.get(layout.schedule).placement == schedules.LOOP:
                self.group = tie_group(mesh["pp"])
        self._heads = {id(m.lm_head.weight) for m in inner if split and m.lm_head is not None}

    def is_copy(self, part: nn.Module) -> bool:
        """``part`` holds a tied LM head without the embedding (the second copy)."""
        inner = unwrap(part)
        return self.tied and inner.tok_emb is None and inner.lm_head is not None

    def save_names(self, part: nn.Module, optim_sd: dict) -> dict:
        """``part``'s optimizer state dict with the copy's state under the embedding's name."""
        return _rename(optim_sd, HEAD, EMBEDDING) if self.is_copy(part) else optim_sd

    def load_names(self, part: nn.Module, optim_sd: dict) -> dict:
        """A checkpoint's optimizer state with the embedding's state under the copy's name, in
        tensors of its own: the optimizer keeps the tensors it loads, and on a V schedule the
        embedding's stage on the same rank loads the same ones (both copies' momentum and Adam
        moments were then one tensor, updated twice a step: resumed runs went astray)."""
        if not self.is_copy(part):
            return optim_sd
        return {k: v.clone() if isinstance(v, torch.Tensor) and k.split(".", 1)[1].startswith(HEAD + ".") else v
                for k, v in _rename(optim_sd, EMBEDDING, HEAD).items()}

    def norm_skip(self) -> set[int]:
        """ids of the parameters whose gradient the norm must not count again (the copies)."""
        return self._heads

    def sync_grads(self) -> None:
        """Sum the two copies' gradients (first stage's lookup, last stage's head)."""
        for p in self.params:  # a copy without a gradient still joins the sum its partner waits in
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [_local(p.grad) for p in self.params]
        if len(grads) == 2:  # V schedules: both stages on this rank
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif grads and grads[0].is_cpu and dist.get_backend(self.group) == "nccl":  # offload = params: host gradients
            summed = grads[0].cuda()
            dist.all_reduce(summed, group=self.group)
            grads[0].copy_(summed)
        elif grads:
            dist.all_reduce(grads[0], group=self.group)
