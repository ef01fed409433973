"""The device mesh one rank trains on: a DeviceMesh over ("pp", "dp", "tp"), or with expert
parallel ("pp", "edp", "ep", "tp"), plus its dims. There "dp" is ("edp", "ep") flattened
(every data-parallel replica, what ZeRO-3 shards non-expert parameters over); "ep" is one
expert-parallel group, "edp" the replicas of one expert. "dp_tp" is every rank of a pipeline
stage (the ranks that split an MoE block's tokens).

Passed explicitly to everything that needs a group; there are no module-level groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainmesh.parallel.dims import Axis, ParallelDims


@dataclass
class Mesh:
    dims: ParallelDims
    device_mesh: DeviceMesh
    rank: int

    @classmethod
    def build(cls, dims: ParallelDims, device_type: str, rank: int, moe: bool = False) -> Mesh:
        """Collective over the default process group: every rank must call it. Without expert
        parallel the mesh is ("pp", "dp", "tp"), and "dp_tp" exists only for an MoE model
        (``moe``): each view is a process group to set up, which a rank's start pays for."""
        if dims.ep == 1:
            dm = init_device_mesh(device_type, dims.shape, mesh_dim_names=("pp", "dp", "tp"))
            if moe:
                dm["dp", "tp"]._flatten("dp_tp")
            return cls(dims=dims, device_mesh=dm, rank=rank)
        dm = init_device_mesh(device_type, (dims.pp, dims.edp, dims.ep, dims.tp),
                              mesh_dim_names=("pp", "edp", "ep", "tp"))
        dm["edp", "ep"]._flatten("dp")
        dm["edp", "ep", "tp"]._flatten("dp_tp")
        return cls(dims=dims, device_mesh=dm, rank=rank)

    def __getitem__(self, axis: Axis | str) -> DeviceMesh:
        """The 1-D mesh of ``axis`` through this rank: pp, dp, tp, or ep, edp, dp_tp."""
        return self.device_mesh[axis.value if isinstance(axis, Axis) else axis]

    def coord(self, axis: Axis | str) -> int:
        return self.dims.coords(self.rank)[Axis(axis)]

    def size(self, axis: Axis | str) -> int:
        return self.dims.degree(Axis(axis))
