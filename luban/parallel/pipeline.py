"""Pipeline parallelism with ``torch.distributed.pipelining``.

Stages are built by hand (no tracing): a ``PipelineModel`` — anything with
``build_stage(stage_id, num_stages) -> nn.Module``, like the Builder of HAI-platform — returns
the module of one stage; ``Pipeline`` builds this rank's stages, wraps them in
``PipelineStage`` and drives a schedule with ``forward_backward(inputs, labels, loss_fn)``.
luban's transformer is one such model (``TransformerPipeline``): its stages keep the global
parameter names (layers are keyed by global index), so checkpoints reshard across ``pp``.

=================  ===============================  =====  =====================================
schedule           class                            style  paper
=================  ===============================  =====  =====================================
gpipe              ScheduleGPipe                    1/rank Huang et al. 2019
1f1b               Schedule1F1B                     1/rank Narayanan et al. 2019 (PipeDream-Flush)
interleaved-1f1b   ScheduleInterleaved1F1B          loop   Narayanan et al. 2021
zero-bubble        ScheduleInterleavedZeroBubble    loop   Qi et al. 2023 (split dI/dW backward)
dualpipev          ScheduleDualPipeV                V      DeepSeek-V3 2024 (DualPipe, V variant)
=================  ===============================  =====  =====================================

"loop": rank r holds stages r, r+pp, ...; "V": rank r holds stages r and 2pp-1-r, so the
first and the last stage share rank 0.

The split-backward schedules (zero-bubble, dualpipev) find a stage's weights by listing
``submod.parameters()`` when the input pass starts and again at the weight pass; under
FSDP2 with ``reshard_after_forward`` (ZeRO-3) those are then the *sharded* parameters, not
the unsharded ones the forward used, so torch would silently drop the weight gradients of
every micro-batch whose stage was resharded at that moment. ``_Stage`` unshards the stage
first (``_unshard_stage``).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, schedules

from luban.model import flops
from luban.model.config import ModelConfig
from luban.model.transformer import Transformer, init_weights

SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "loop"),
    "1f1b": ("Schedule1F1B", "loop"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "zero-bubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}


class PipelineModel(Protocol):
    """A model that can build any one of its pipeline stages."""

    def build_stage(self, stage_id: int, num_stages: int) -> nn.Module: ...


def stage_ids(pp_rank: int, pp: int, virtual_stages: int, style: str) -> list[int]:
    """The stage indices this pipeline rank holds."""
    if style == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(virtual_stages)]


def split_layers(cfg: ModelConfig, num_stages: int, pp_split: tuple[int, ...] = ()) -> list[range]:
    """Contiguous layer ranges per stage: ``pp_split`` if given, else minimising the most
    expensive stage by forward FLOPs per token (``luban.model.flops``), the LM head counted
    on the last stage. (Embedding lookups cost no FLOPs.)"""
    if pp_split:
        counts = list(pp_split)
    else:
        layer = flops.layer_matmul_flops(cfg) + flops.attention_core_flops(cfg, cfg.seq_len)
        head = flops.head_flops(cfg)
        counts = _balanced_counts([layer] * cfg.layers, num_stages, head)
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _balanced_counts(costs: list[float], n: int, last_extra: float) -> list[int]:
    """Split ``costs`` into ``n`` non-empty contiguous parts minimising the maximum part cost
    (the last part also pays ``last_extra``); dynamic programming over split points."""
    L = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max cost of splitting the first i layers into k parts
    best = [[inf] * (L + 1) for _ in range(n + 1)]
    arg = [[0] * (L + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for k in range(1, n + 1):
        for i in range(k, L - (n - k) + 1):
            extra = last_extra if k == n else 0.0
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j] + extra)
                if cost < best[k][i]:
                    best[k][i], arg[k][i] = cost, j
    counts, i = [], L
    for k in range(n, 0, -1):
        counts.append(i - arg[k][i])
        i = arg[k][i]
    return counts[::-1]


class TransformerPipeline:
    """luban's transformer as a ``PipelineModel``: stage ``i`` holds its layer range, the first
    stage the embeddings, the last the final norm and LM head (a tied head on another stage
    than the embedding is a second copy whose gradient the engine sums with the first)."""

    def __init__(self, cfg: ModelConfig, seed: int, recompute: str, device: torch.device, pp_split=()):
        self.cfg, self.seed, self.recompute, self.device, self.pp_split = cfg, seed, recompute, device, pp_split

    def build_stage(self, stage_id: int, num_stages: int) -> Transformer:
        keep = split_layers(self.cfg, num_stages, self.pp_split)[stage_id]
        with torch.device("meta"):
            model = Transformer(self.cfg)
        for name in [n for n in model.layers if int(n) not in keep]:
            del model.layers[name]
        if stage_id > 0:
            model.tok_emb = model.pos_emb = None
        if stage_id < num_stages - 1:
            model.norm = model.lm_head = None
        model.to_empty(device=self.device)
        init_weights(model, self.cfg, self.seed)  # seeded by name: identical to the unsplit model
        if self.cfg.tie_embeddings and model.lm_head is not None:
            if model.tok_emb is not None:
                model.lm_head.weight = model.tok_emb.weight
            else:  # a tied head without the embedding: initialise it under the embedding's name
                holder = nn.Module()
                holder.tok_emb = nn.Embedding(1, 1, device="meta")
                holder.tok_emb.weight = model.lm_head.weight
                init_weights(holder, self.cfg, self.seed)
        model.set_recompute(self.recompute)
        return model


def _unshard_stage(module: nn.Module) -> None:
    """All-gather every FSDP2 unit of a stage (a no-op for units already unsharded), so that
    ``module.parameters()`` are the unsharded parameters: the autograd leaves of its forward."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.unshard()


class _Stage(PipelineStage):
    """``PipelineStage`` whose split backward sees the parameters the forward used.

    torch's ``stage_backward_input`` maps each parameter's gradient accumulator into the
    autograd graph to find what the weight pass must compute, and ``stage_backward_weight``
    looks the results up by the parameters listed again; both list ``submod.parameters()``.
    FSDP2 swaps a module's registered parameters between sharded DTensors and unsharded
    tensors, and with ``reshard_after_forward=True`` a stage is sharded after its forward:
    the sharded parameters are not in the graph, the weight pass gets no parameter groups,
    and those weight gradients are lost, silently. Unsharding first costs no extra
    all-gather for the input pass (backward would gather each block anyway) and one for the
    weight pass only when a forward of this stage resharded it in between; FSDP's
    ``post_backward`` at the schedule's gradient reduction reshards as usual."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, *args, **kwargs):
        if backward_type in ("input", "weight"):
            _unshard_stage(self.submod)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, *args, **kwargs)


class Pipeline:
    """This rank's stages of ``model`` and a schedule over ``pp_mesh``.

    ``prepare(module, stage_id)`` may shard/wrap each stage module (tensor, data parallel)
    before it becomes a ``PipelineStage``; ``parts`` are the prepared modules."""

    def __init__(self, model: PipelineModel, pp_mesh: DeviceMesh, schedule: str, virtual_stages: int,
                 n_microbatches: int, device: torch.device,
                 prepare: Callable[[nn.Module, int], nn.Module] | None = None):
        cls_name, style = SCHEDULES[schedule]
        pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
        self.group, self.n_microbatches, self.style = pp_mesh.get_group(), n_microbatches, style
        self.num_stages = pp * (2 if style == "v" else virtual_stages)
        self.stage_ids = stage_ids(pp_rank, pp, virtual_stages, style)
        self.parts, self.stages = [], []
        for sid in self.stage_ids:
            module = model.build_stage(sid, self.num_stages)
            module = prepare(module, sid) if prepare else module
            self.parts.append(module)
            self.stages.append(_Stage(module, sid, self.num_stages, device, group=self.group))
        self.schedule_cls = getattr(schedules, cls_name)
        self._schedules: dict[int, object] = {}
        self.has_first = 0 in self.stage_ids
        self.has_last = self.num_stages - 1 in self.stage_ids

    def _schedule(self, loss_fn):
        if id(loss_fn) not in self._schedules:
            stages = self.stages[0] if len(self.stages) == 1 and self.schedule_cls in (
                schedules.ScheduleGPipe, schedules.Schedule1F1B) else self.stages
            self._schedules[id(loss_fn)] = (self.schedule_cls(stages, self.n_microbatches, loss_fn=loss_fn), loss_fn)
        return self._schedules[id(loss_fn)][0]

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """Run all micro-batches of ``inputs`` forward and backward (gradients accumulate as the
        mean over micro-batches); return the mean loss on every pp rank."""
        losses: list = []
        args = (inputs,) if self.has_first else ()
        self._schedule(loss_fn).step(*args, target=labels if self.has_last else None, losses=losses)
        return self._mean_loss(losses, inputs.device)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """Forward only, stage after stage, micro-batch after micro-batch (blocking p2p); the
        split-backward schedules have no forward-only mode. Mean loss on every pp rank."""
        modules = dict(zip(self.stage_ids, self.parts))
        losses = []
        for x, y in zip(inputs.tensor_split(self.n_microbatches), labels.tensor_split(self.n_microbatches)):
            for sid in range(self.num_stages):
                if sid not in modules:
                    continue
                if sid > 0 and sid - 1 not in modules:
                    x = self._recv(sid - 1, inputs.device)
                x = modules[sid](x)
                if sid == self.num_stages - 1:
                    losses.append(loss_fn(x, y))
                elif sid + 1 not in modules:
                    self._send(x, sid + 1)
        return self._mean_loss(losses, inputs.device)

    def _peer(self, stage: int) -> int:
        """Global rank holding ``stage``."""
        pp = dist.get_world_size(self.group)
        pp_rank = stage % pp if self.style == "loop" else min(stage, self.num_stages - 1 - stage)
        return dist.get_global_rank(self.group, pp_rank)

    def _send(self, x: torch.Tensor, stage: int) -> None:
        x = x.float().contiguous()
        header = torch.zeros(8, dtype=torch.int64, device=x.device)
        header[0], header[1:1 + x.ndim] = x.ndim, torch.tensor(x.shape)
        dist.send(header, self._peer(stage), group=self.group)
        dist.send(x, self._peer(stage), group=self.group)

    def _recv(self, stage: int, device) -> torch.Tensor:
        header = torch.zeros(8, dtype=torch.int64, device=device)
        dist.recv(header, self._peer(stage), group=self.group)
        x = torch.empty(header[1:1 + int(header[0])].tolist(), device=device)
        dist.recv(x, self._peer(stage), group=self.group)
        return x

    def _mean_loss(self, losses: list, device) -> torch.Tensor:
        local = torch.stack([l.detach().float() for l in losses]).mean() if self.has_last else torch.zeros((), device=device)
        if hasattr(local, "full_tensor"):
            local = local.full_tensor()
        dist.all_reduce(local, group=self.group)
        return local


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
