"""Expert parallel's regrouping of received rows ([source rank][local expert] -> [expert][source]).

2026-12-02: ``_regroup`` built the permutation on the host from two ``int()`` reads of the grid per
block: 2·ep·(E/ep) waits for the device per MoE layer and micro-batch on a GPU, and an index made on
the host for rows on the device. It is now computed on the grid's device from the total the
dispatch already has on the host."""

from __future__ import annotations

import pytest
import torch

from luban.parallel.expert_parallel import _regroup
from tests.model.test_devices import foreign_host


def _blocks(grid: list[list[int]]) -> list[int]:
    """The permutation written out: block (source s, expert e) starts where the rows before it end."""
    sizes = [n for row in grid for n in row]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    ep, local = len(grid), len(grid[0])
    return [starts[s * local + e] + i for e in range(local) for s in range(ep) for i in range(grid[s][e])]


@pytest.mark.parametrize("ep, local", [(1, 1), (1, 3), (2, 1), (2, 2), (4, 3)])
def test_regroup_puts_each_experts_rows_together_in_source_order(ep, local):
    g = torch.Generator().manual_seed(ep * 10 + local)
    for _ in range(30):
        grid = torch.randint(0, 4, (ep, local), generator=g) * torch.randint(0, 2, (ep, local), generator=g)
        assert _regroup(grid, int(grid.sum())).tolist() == _blocks(grid.tolist()), grid


def test_regroup_makes_no_tensor_off_the_grids_device():
    """Every tensor made without a device lands on ``meta`` here: one of them reaching the answer is a
    host tensor on a GPU's path."""
    grid = torch.tensor([[2, 0, 1], [0, 3, 1]])
    with foreign_host():
        order = _regroup(grid, 7)
    assert order.device == grid.device and order.tolist() == _blocks(grid.tolist())
    empty = torch.zeros(2, 2, dtype=torch.long)  # no row received at all
    with foreign_host():
        assert _regroup(empty, 0).device == grid.device


def test_dispatch_reads_the_host_once_per_layer(tmp_path, monkeypatch):
    """2026-12-03: ``EPDispatch`` read the device three times per MoE layer (the send sizes, the
    receive sizes, the loop's per-expert sizes: each ``tolist`` a wait for the device on a GPU).
    Now one read of the exchanged counts gives all three. On one gloo rank (ep = 1), the loop path."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from luban.model.config import ModelConfig
    from luban.model.moe import Experts
    from luban.parallel.expert_parallel import EPDispatch

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
        cfg = ModelConfig(hidden=16, layers=1, heads=2, experts=4, experts_per_token=2)
        experts = Experts(cfg)
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.1)
        counts = torch.tensor([3, 0, 2, 1])
        rows = torch.randn(int(counts.sum()), 16)
        reads = []
        real = torch.Tensor.tolist
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.numel()) or real(t))
        out = EPDispatch(mesh, 4)(experts, rows, counts)
        assert len(reads) == 1, reads
        monkeypatch.undo()
        assert torch.allclose(out, experts.loop(rows, counts.tolist()), atol=1e-6)  # one process's answer
    finally:
        dist.destroy_process_group()
