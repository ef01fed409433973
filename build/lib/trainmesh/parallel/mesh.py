"""The device mesh one rank trains on: a DeviceMesh over ("pp", "dp", "tp") plus its dims.

Passed explicitly to everything that needs a group; there are no module-level groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainmesh.parallel.dims import AXES, Axis, ParallelDims


@dataclass
class Mesh:
    dims: ParallelDims
    device_mesh: DeviceMesh
    rank: int

    @classmethod
    def build(cls, dims: ParallelDims, device_type: str, rank: int) -> Mesh:
        """Collective over the default process group: every rank must call it."""
        dm = init_device_mesh(device_type, dims.shape, mesh_dim_names=tuple(a.value for a in AXES))
        return cls(dims=dims, device_mesh=dm, rank=rank)

    def __getitem__(self, axis: Axis | str) -> DeviceMesh:
        return self.device_mesh[Axis(axis).value]

    def coord(self, axis: Axis | str) -> int:
        return self.dims.coords(self.rank)[Axis(axis)]

    def size(self, axis: Axis | str) -> int:
        return self.dims.degree(Axis(axis))
