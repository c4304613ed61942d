"""Pipeline parallelism with ``torch.distributed.pipelining``.

Stages are built by hand (no tracing): a ``PipelineModel`` — anything with
``build_stage(stage_id, num_stages) -> nn.Module``, like the Builder of HAI-platform — returns
the module of one stage; ``Pipeline`` builds this rank's stages, wraps them in
``PipelineStage`` and drives a schedule with ``forward_backward(inputs, labels, loss_fn)``.
luban's transformer is one such model (``TransformerPipeline``): its stages keep the global
parameter names (layers are keyed by global index), so checkpoints reshard across ``pp``.

The schedules, their torch classes and stage placement are the registry
``luban.parallel.schedules`` (one entry per schedule, shared with ``check_layout`` and the
planner).

The split-backward schedules (zero-bubble, dualpipev) find a stage's weights by listing
``submod.parameters()`` when the input pass starts and again at the weight pass; under
FSDP2 with ``reshard_after_forward`` (ZeRO-3) those are then the *sharded* parameters, not
the unsharded ones the forward used, so torch would silently drop the weight gradients of
every micro-batch whose stage was resharded at that moment. ``_Stage`` unshards the stage
first (``_unshard_stage``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel

from luban.model import moe
from luban.model.config import ModelConfig
from luban.model.transformer import Transformer, init_weights
from luban.parallel import schedules
from luban.parallel.schedules import head_layers, stage_layer_counts
from luban.parallel.tied import tie_stage


class PipelineModel(Protocol):
    """A model that can build any one of its pipeline stages."""

    def build_stage(self, stage_id: int, num_stages: int) -> nn.Module: ...


def split_layers(cfg: ModelConfig, num_stages: int, pp_split: tuple[int, ...] = ()) -> list[range]:
    """Contiguous layer ranges per stage: ``pp_split`` if given, else the closed-form balanced
    split of ``luban.parallel.schedules`` (the LM head counted on the last stage)."""
    counts = list(pp_split) if pp_split else stage_layer_counts(cfg.layers, num_stages, head_layers(cfg))
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class TransformerPipeline:
    """luban's transformer as a ``PipelineModel``: stage ``i`` holds its layer range, the first
    stage the embeddings, the last the final norm and LM head (a tied head on another stage
    than the embedding is a second copy: ``luban.parallel.tied``)."""

    def __init__(self, cfg: ModelConfig, seed: int, device: torch.device, pp_split=()):
        self.cfg, self.seed, self.device, self.pp_split = cfg, seed, device, pp_split

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
        tie_stage(model, self.cfg, self.seed)
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

    def _forward_metadata_inference(self, *args, **kwargs):
        """torch runs the stage forward once on the first micro-batch (or on empty tensors) to
        infer shapes: that forward must not count as MoE expert load, and under DDP it runs in
        ``no_sync``. Outside it, DDP's forward arms the reducer for a backward that never
        comes (``prepare_for_backward``), the first real micro-batch's backward then all-reduces
        its partial gradients (the stage runs that backward under ``no_sync``, but ``no_sync`` only
        keeps a forward from arming the reducer, it does not disarm it), and the first step of
        every process — a resumed one's too — summed in another order than later steps: resume
        was not bitwise."""
        with self._inferring():
            return super()._forward_metadata_inference(*args, **kwargs)

    def _shape_inference(self, *args, **kwargs):
        """torch 2.11's name for the same forward (``_forward_metadata_inference`` since 2.12)."""
        with self._inferring():
            return super()._shape_inference(*args, **kwargs)

    def _get_init_p2p_neighbors_ops(self):
        """The first batch of sends that connects neighbouring stages, without those to this rank itself:
        a V-shaped schedule (dualpipev) holds stages 1 and 2 on one rank, and torch 2.11 sends between
        them through the group (gloo refuses: "Pair is not connected"); torch 2.12 warms up otherwise."""
        me = dist.get_rank(self.group)
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != me]

    @contextlib.contextmanager
    def _inferring(self):
        quiet = self.submod.no_sync() if isinstance(self.submod, DistributedDataParallel) else contextlib.nullcontext()
        with moe.not_counted(self.submod), quiet:
            yield

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
        self.schedule = schedules.get(schedule)
        pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
        self.group, self.n_microbatches, self.virtual_stages = pp_mesh.get_group(), n_microbatches, virtual_stages
        self.num_stages = self.schedule.stages(pp, virtual_stages)
        self.stage_ids = self.schedule.stage_ids(pp_rank, pp, virtual_stages)
        self.parts, self.stages = [], []
        for sid in self.stage_ids:
            module = model.build_stage(sid, self.num_stages)
            module = prepare(module, sid) if prepare else module
            self.parts.append(module)
            self.stages.append(_Stage(module, sid, self.num_stages, device, group=self.group))
        self.schedule_cls = self.schedule.torch_class()
        self._schedules: dict[int, object] = {}
        self.has_first = 0 in self.stage_ids
        self.has_last = self.num_stages - 1 in self.stage_ids

    def _schedule(self, loss_fn):
        if id(loss_fn) not in self._schedules:
            stages = self.stages[0] if self.schedule.single_stage else self.stages
            self._schedules[id(loss_fn)] = (self.schedule_cls(stages, self.n_microbatches, loss_fn=loss_fn), loss_fn)
        return self._schedules[id(loss_fn)][0]

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """Run all micro-batches of ``inputs`` forward and backward (gradients accumulate as the
        mean over micro-batches); return the mean loss on every pp rank."""
        losses: list = []
        # contiguous: the loader's inputs are a view (tokens[:, :-1]) whose strides torch 2.11's stage
        # check compares with the contiguous micro-batch it expects ("stride mismatch")
        args = (inputs.contiguous(),) if self.has_first else ()
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
        pp_rank = self.schedule.rank_of(stage, dist.get_world_size(self.group), self.virtual_stages)
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
