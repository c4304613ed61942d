"""Data parallelism and ZeRO (Rajbhandari et al. 2020), with PyTorch's own wrappers.

=====  =========================================================================  ==========
zero   mechanism                                                                  sharded
=====  =========================================================================  ==========
0      ``DistributedDataParallel``: gradients all-reduced in ``bucket_mb``        nothing
       buckets overlapped with backward; ``no_sync`` while accumulating
1      FSDP2 ``fully_shard(reshard_after_forward=False)`` with gradient sync     optimizer
       off until the last micro-batch: full gradients accumulate locally, one
       reduce-scatter per step, each rank steps its shard
2      FSDP2 ``reshard_after_forward=False``: reduce-scatter every micro-batch    + gradients
3      FSDP2 ``reshard_after_forward=True``: parameters re-gathered for backward  + parameters
=====  =========================================================================  ==========

Hybrid sharding (``dp_replicate > 1``) gives FSDP2 a 2-D mesh: shard inside ``dp_shard``,
all-reduce across ``dp_replicate``. Context-parallel ranks hold the same parameters and see
other tokens of the same samples, so they join the reduction (``dp_cp``/``dp_shard_cp``).
Sharded parameters are DTensors with global shapes, so optimizer state saved through DCP
carries global names and reshards to any other layout — that is why ZeRO-1 is built on
FSDP2 and not on ``ZeroRedundancyOptimizer`` (whose state is a rank-0 consolidated blob).
Under ZeRO-1/2 FSDP2 still frees the gathered parameters after backward, so parameter
memory between steps is sharded as well; what distinguishes the stages is gradient memory
while accumulating and the number of all-gathers per step.

Bitwise resume under DDP. An all-reduce sums each element over the ranks in an order set by
the element's position in the buffer (a ring starts each chunk's reduction at another rank),
so the gradients DDP averages depend on how its buckets are laid out, not only on their
values. DDP's reducer, left to itself (``find_unused_parameters=False``), reduces the first
iteration of every process in one bucket in parameter order and then rebuilds its buckets in
the order the gradients became ready: a run resumed from a checkpoint reduced its first step
in another layout than the uninterrupted run used for that step, and the weights parted in
the last bits (3e-8 two steps after the resume, 1.8e-5 after 24). DDP is therefore built with
``find_unused_parameters=True``, under which the reducer never rebuilds: the buckets are laid
out once, at construction, from the parameters (in reverse definition order, close to the
order backward produces them, so reduction still overlaps backward), and every step of every
process reduces in that layout. The price is a walk of the autograd graph after each
synchronising forward and a small all-reduce of used-parameter flags per step (not measured
here; small next to a transformer step). Each rank prints torch's one-time C++ warning that no
unused parameter was found (as pipelined DDP always did; it comes from the autograd thread's
C++ logging, which Python's ``warnings`` filters do not reach). Without the rebuild nothing
else here carries history across a resume (tests/train/test_resume_layouts.py: several
buckets, accumulated micro-batches, experts in DDP and under expert parallel, whose gradients
``reduce_expert_grads`` sums in one flat all-reduce in parameter order; gradient-as-bucket
views and static graph are not used). The pipeline's shape-inference forward was a second
history of DDP's (``pipeline._Stage``).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from luban.parallel.expert_parallel import expert_params
from luban.parallel.layout import ParallelLayout, fsdp_casts
from luban.parallel.mesh import LayoutMesh
from luban.parallel.precision import FSDP_PARAM_DTYPE

# DDP's flag for syncing buffers in every forward: torch 2.13 renamed ``broadcast_buffers`` (deprecated
# there) to ``forward_sync_buffers``; torch 2.11 and 2.12 have only the old name
NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                  if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
                  else {"broadcast_buffers": False})


def data_parallel_size(layout: ParallelLayout) -> int:
    """Ranks that hold the same parameters and reduce gradients together (dp x cp)."""
    return layout.dp * layout.cp


def uses_fsdp(layout: ParallelLayout) -> bool:
    """FSDP2 wraps the model parts: zero >= 1 over dp x cp > 1 ranks, and ``offload = params``
    always (FSDP2's ``CPUOffloadPolicy`` is the offload, also over one data-parallel rank and in
    one process: without FSDP2 the parameters stayed on the device, silently)."""
    return layout.zero >= 1 and (data_parallel_size(layout) > 1 or layout.offload == "params")


def apply_data_parallel(module: nn.Module, layout: ParallelLayout, mesh: LayoutMesh, device: torch.device) -> nn.Module:
    """Wrap one model part (a whole model or one pipeline stage); returns the module to call."""
    if data_parallel_size(layout) == 1 and not uses_fsdp(layout):
        return module
    experts = expert_params(module)  # reduced over the expert-data-parallel group instead
    if layout.zero == 0:
        if experts:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                module, [n for n, p in module.named_parameters() if any(p is e for e in experts)])
        # find_unused_parameters: the buckets of the first iteration are those of every later
        # one (no rebuild; see the module doc: bitwise resume; and under pp, where the schedule
        # runs several backward passes per step, a rebuild would record every micro-batch's
        # gradient order and fail).
        # No buffer sync per forward: the only buffers are MoE routers' balancing bias (updated
        # identically on every rank from all-reduced loads) and per-rank load counters.
        return DistributedDataParallel(module, process_group=mesh["dp_cp"].get_group(), **NO_BUFFER_SYNC,
                                       bucket_cap_mb=layout.bucket_mb, find_unused_parameters=True,
                                       device_ids=[torch.cuda.current_device()] if device.type == "cuda" else None)
    dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if layout.dp_replicate > 1 else mesh["dp_shard_cp"]
    options = dict(mesh=dp_mesh, reshard_after_forward=layout.zero == 3,
                   mp_policy=MixedPrecisionPolicy(param_dtype=FSDP_PARAM_DTYPE[layout.precision],
                                                  reduce_dtype=torch.float32),
                   offload_policy=(CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
                                   if layout.offload == "params" else OffloadPolicy()),
                   ignored_params=set(experts) or None)
    layers = getattr(module, "layers", None)
    for block in (layers.values() if isinstance(layers, nn.ModuleDict) else ()):
        fully_shard(block, **options)
    fully_shard(module, **options)
    return module


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 and DTensor modify modules in place)."""
    return getattr(module, "module", module)


def set_gradient_sync(module: nn.Module, layout: ParallelLayout, sync: bool):
    """Context for one micro-batch's backward: reduce now (``sync``) or keep accumulating."""
    if isinstance(module, DistributedDataParallel) and not sync:
        return module.no_sync()
    if isinstance(module, FSDPModule) and layout.zero == 1:
        module.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def reshard(module: nn.Module) -> None:
    """Free the parameters FSDP2 gathered for a forward without backward (evaluation under
    ZeRO-1/2 would otherwise keep them whole until the next backward)."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def uses_autocast(layout: ParallelLayout) -> bool:
    """Autocast around the forward, except where FSDP2 casts the parameters itself (bf16 under
    FSDP2: ``precision.FSDP_PARAM_DTYPE``)."""
    return not (uses_fsdp(layout) and fsdp_casts(layout.precision))
