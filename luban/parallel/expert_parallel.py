"""Expert parallelism: the routed experts of every MoE layer sharded over an ``ep`` group,
tokens moved to their experts and back by all-to-all (GShard, Lepikhin et al. 2020;
DeepSpeed-MoE; Megatron-Core's "alltoall" token dispatcher).

Rank arrangement. EP borrows its ranks from data parallel, as Megatron-Core and torchtitan
do: the ``dp_cp`` ranks of a stage (all holding the same non-expert parameters, each seeing
other tokens) are cut into consecutive groups of ``ep`` (``ep`` divides dp·cp, the world
size stays dp·tp·pp·cp)::

    dp_cp ranks  0 1 2 3 | ep = 2:  ep groups {0,1} {2,3}  (experts 0..E/2-1 on 0 and 2,
                                                            E/2..E-1 on 1 and 3)
                                    edp groups {0,2} {1,3} (expert-data-parallel: same experts)

* Parameters: each expert weight ``[E, ...]`` becomes a ``DTensor`` ``Shard(0)`` over the ep
  mesh: a rank computes with its local ``[E/ep, ...]`` slice, and the model and optimizer
  state dicts carry global shapes under the usual names, so DCP reshards checkpoints across
  any change of ep (ep2 -> ep4, ep -> none) like it does across tp.
* Gradients: non-expert parameters are reduced over dp·cp by DDP/FSDP2 as before; the expert
  parameters are left out of those wrappers (DDP's ignore list, FSDP2's ``ignored_params``)
  and ``reduce_expert_grads`` sums each expert's gradient over its edp group and divides by
  dp·cp (each rank's loss is the mean over its own tokens; a rank's expert gradient already
  sums the contributions of every token its ep peers sent it). Experts are therefore
  replicated over edp, not ZeRO-sharded (their optimizer state is divided by ep, not by dp).
* Dispatch (``EPDispatch``, installed as ``MoE.dispatch``): the MoE layer sorts its token
  copies by global expert; one all-to-all exchanges the per-expert counts, a second the rows
  (uneven splits), the received rows are regrouped by local expert for the expert GEMMs, and
  the reverse permutation and all-to-all bring the outputs home. Routing, the aux loss and the
  load counts stay on the token's own rank, so they are exactly those of the model without EP.
* Collective: all-to-all with uneven split sizes, which gloo implements on CPU in torch 2.13
  (checked: ``all_to_all_single`` with uneven splits, and the list form ``all_to_all``) and
  NCCL on GPU. The counts go through a plain ``dist.all_to_all_single``; the rows through
  the differentiable functional collective ``all_to_all_single_autograd`` (its backward is
  the all-to-all with the splits swapped), as context parallel's ring does.
* Composition: tensor parallel replicates the MoE over tp (``luban.parallel.tensor_parallel``),
  so each tp rank dispatches within the ep group of its own tp coordinate; pipeline stages
  hold their own layers' experts, and the ep peers of a stage run the same schedule, so their
  all-to-alls pair up; context parallel ranks are dp-like for experts.
* Initialisation: the stage is built and initialised whole (seeded per expert by
  ``luban.model.transformer.init_weights``), then each rank keeps its slice; peak memory at
  build time is one stage's full experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from luban.model.moe import Experts, MoE


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows: ``send[i]`` rows go to rank i, ``recv[i]`` come from it."""
    out = funcol.all_to_all_single_autograd(x.contiguous(), recv, send, group)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


class EPDispatch:
    """``MoE.dispatch`` under expert parallel: rows sorted by global expert -> expert outputs in the same order."""

    def __init__(self, ep_mesh: DeviceMesh, num_experts: int):
        self.group, self.ep = ep_mesh.get_group(), ep_mesh.size()
        self.local = num_experts // self.ep

    # Eager under torch.compile: the split sizes are read on the host (data-dependent), as in Experts.loop
    @torch.compiler.disable
    def __call__(self, experts: Experts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The counts are exchanged under a capacity cut too: the rows a rank receives are its peers'
        counts, which it cannot assume equal to its own (a peer's micro-batch may hold other tokens)."""
        ep, local = self.ep, self.local
        counts = counts.to(torch.long)
        recv_counts = torch.empty_like(counts)  # [source rank, local expert], flattened
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        # one host read for the layer (it was three: the send sizes, the receive sizes, the loop's
        # per-expert sizes, each a wait for the device on a GPU); the sums are taken on the host
        host = torch.cat([counts, recv_counts]).tolist()
        mine, theirs = host[:ep * local], host[ep * local:]  # each [rank][local expert]
        send = [sum(mine[r * local:(r + 1) * local]) for r in range(ep)]
        recv = [sum(theirs[r * local:(r + 1) * local]) for r in range(ep)]
        received = _all_to_all(rows, send, recv, self.group)
        # received is grouped by source rank, then local expert; the GEMMs want local expert first
        recv_grid = recv_counts.view(ep, local)
        order = _regroup(recv_grid, sum(recv))
        per_expert = recv_grid.sum(0)  # the grouped GEMMs' counts stay on the device, the loop's are the list
        out = experts(received[order], per_expert, [sum(theirs[e::local]) for e in range(local)])
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _all_to_all(out[back], recv, send, self.group)


def _regroup(grid: torch.Tensor, total: int) -> torch.Tensor:
    """Row indices that reorder blocks laid out [source][expert] (sizes ``grid``, ``total`` rows in all,
    known on the host) as [expert][source], computed on the grid's device: no host read (it read two
    entries of the grid per block, 2·ep·E/ep waits for the device per MoE layer on a GPU)."""
    sizes = grid.t().flatten()  # the blocks in the order wanted: [expert][source]
    starts = (grid.flatten().cumsum(0) - grid.flatten()).view_as(grid).t().flatten()  # where each block lies
    block = torch.repeat_interleave(torch.arange(sizes.numel(), device=grid.device), sizes, output_size=total)
    first = sizes.cumsum(0) - sizes  # each block's first row in the output
    return starts[block] + torch.arange(total, device=grid.device) - first[block]


def apply_expert_parallel(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts of ``module`` (a model or a stage) over ``ep_mesh``, in place."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for layer in module.modules():
        if not isinstance(layer, MoE):
            continue
        local = layer.num_experts // ep
        experts = layer.experts
        experts.expert_offset = rank * local
        for name, param in list(experts.named_parameters(recurse=False)):
            shard = param.detach()[rank * local:(rank + 1) * local].clone()
            setattr(experts, name, nn.Parameter(DTensor.from_local(shard, ep_mesh, [Shard(0)], run_check=False)))
        layer.dispatch = EPDispatch(ep_mesh, layer.num_experts)


def expert_params(module: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel parameters of ``module`` (those the data-parallel wrappers leave out)."""
    return [p for m in module.modules() if isinstance(m, MoE) and m.dispatch is not None
            for p in m.experts.parameters()]


@torch.no_grad()
def reduce_expert_grads(parts, edp_group, data_ranks: int) -> None:
    """Sum expert gradients over the expert-data-parallel group and divide by dp·cp."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for part in parts for p in expert_params(part) if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])
    if dist.get_world_size(edp_group) > 1:
        dist.all_reduce(flat, group=edp_group)
    flat /= data_ranks
    for g, new in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(new.view_as(g))
