"""The device mesh: how the ranks of a layout are arranged (``torch.distributed.DeviceMesh``).

The world mesh has one named dimension per parallel degree, outermost first in the order of
``layout.mesh_order`` (default ``pp,dp,cp,tp``: tensor parallel innermost, so its per-layer
collectives stay among neighbouring ranks, i.e. inside a node; Narayanan et al. 2021,
Sec. 3.3). ``dp`` is split into ``dp_replicate`` (outer) and ``dp_shard`` for hybrid
sharding. Flattened views serve the collectives that span several dimensions:

* ``dp_cp``       = dp_replicate x dp_shard x cp: ranks holding the same parameters (DDP
                    all-reduce group; loss averaging);
* ``dp_shard_cp`` = dp_shard x cp: the FSDP2 shard dimension (cp ranks see different tokens
                    of the same samples, so their gradients are summed like dp's);
* ``ep``, ``edp``  = dp_cp cut into consecutive groups of ``ep`` (expert parallel) and the
                    groups of ranks at the same position in them (expert-data-parallel:
                    same experts, their gradients are summed).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from luban.parallel.layout import ParallelLayout


def mesh_dims(layout: ParallelLayout) -> list[tuple[str, int]]:
    """(name, size) of every mesh dimension, outermost first."""
    sizes = {"pp": [("pp", layout.pp)], "cp": [("cp", layout.cp)], "tp": [("tp", layout.tp)],
             "dp": [("dp_replicate", layout.dp_replicate), ("dp_shard", layout.dp_shard)]}
    return [dim for name in layout.mesh_order.split(",") for dim in sizes[name]]


class LayoutMesh:
    """The world ``DeviceMesh`` plus its flattened views, kept here because slicing a
    flattened dimension from the root mesh is deprecated. ``mesh[names]`` returns a submesh."""

    def __init__(self, layout: ParallelLayout, device: torch.device):
        dims = mesh_dims(layout)
        self.order = [n for n, _ in dims]
        self.world = init_device_mesh(device.type, tuple(s for _, s in dims), mesh_dim_names=tuple(self.order))
        self.flat = {"dp_cp": self.world[self._ordered("dp_replicate", "dp_shard", "cp")]._flatten("dp_cp"),
                     "dp_shard_cp": self.world[self._ordered("dp_shard", "cp")]._flatten("dp_shard_cp")}
        self.cp = layout.cp
        if layout.ep > 1:  # consecutive dp_cp ranks form an ep group; same-position ranks an edp group
            experts = self.flat["dp_cp"]._unflatten(0, (layout.dp * layout.cp // layout.ep, layout.ep), ("edp", "ep"))
            self.flat.update(ep=experts["ep"], edp=experts["edp"])

    def _ordered(self, *names: str) -> tuple[str, ...]:
        """Submesh dimension names in mesh order (a slice must follow the mesh's order)."""
        return tuple(sorted(names, key=self.order.index))

    def __getitem__(self, names) -> DeviceMesh:
        if names in self.flat:
            return self.flat[names]
        if names == ("dp_replicate", "dp_shard_cp") and self.cp == 1:
            return self.world["dp_replicate", "dp_shard"]
        return self.world[names]


def build_mesh(layout: ParallelLayout, device: torch.device) -> LayoutMesh:
    """The world mesh of ``layout`` with the flattened ``dp_cp`` and ``dp_shard_cp`` views."""
    return LayoutMesh(layout, device)


def coordinate(mesh: LayoutMesh, name: str) -> int:
    """This rank's index along a (possibly flattened) mesh dimension."""
    return mesh[name].get_local_rank()
