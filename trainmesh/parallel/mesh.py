"""The device mesh one rank trains on: a DeviceMesh over ("pp", "dp", "tp"), or with expert
parallel ("pp", "edp", "ep", "tp"), or with hybrid sharding ("pp", "dp_replicate",
"dp_shard", "tp"), plus its dims. There "dp" is ("edp", "ep") or ("dp_replicate", "dp_shard")
flattened (every data-parallel replica); "ep" is one expert-parallel group, "edp" the replicas
of one expert; ZeRO-3 shards over ``zero_mesh``: all of "dp", or for hybrid sharding the 2-D
("dp_replicate", "dp_shard"), FSDP2's HSDP. "dp_tp" is every rank of a pipeline stage (the
ranks that split an MoE block's tokens).

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

    dp_replicate: int = 1  # hybrid sharding: ZeRO-3 groups of dp / dp_replicate replicas

    @classmethod
    def build(cls, dims: ParallelDims, device_type: str, rank: int, moe: bool = False,
              dp_replicate: int = 1) -> Mesh:
        """Collective over the default process group: every rank must call it. Without expert
        parallel the mesh is ("pp", "dp", "tp"), and "dp_tp" exists only for an MoE model
        (``moe``): each view is a process group to set up, which a rank's start pays for.
        ``dp_replicate`` > 1: hybrid sharding, the dp axis split in (replicate, shard) with
        shard fastest, so a shard group is consecutive replicas (the nearest ranks)."""
        if dp_replicate > 1:
            if dims.ep > 1 or dims.dp % dp_replicate:
                raise ValueError(f"dp_replicate={dp_replicate} needs ep=1 and to divide "
                                 f"dp={dims.dp}")
            dm = init_device_mesh(device_type, (dims.pp, dp_replicate, dims.dp // dp_replicate,
                                                dims.tp),
                                  mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
            dm["dp_replicate", "dp_shard"]._flatten("dp")
            if moe:
                dm["dp_replicate", "dp_shard", "tp"]._flatten("dp_tp")
            return cls(dims=dims, device_mesh=dm, rank=rank, dp_replicate=dp_replicate)
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

    @property
    def zero_mesh(self) -> DeviceMesh:
        """What ZeRO-3 shards non-expert parameters over: "dp", or for hybrid sharding the 2-D
        ("dp_replicate", "dp_shard") (FSDP2 shards over the second, replicates over the first)."""
        if self.dp_replicate > 1:
            return self.device_mesh["dp_replicate", "dp_shard"]
        return self.device_mesh["dp"]

    def __getitem__(self, axis: Axis | str) -> DeviceMesh:
        """The 1-D mesh of ``axis`` through this rank: pp, dp, tp, or ep, edp, dp_tp, or
        dp_replicate, dp_shard (hybrid sharding)."""
        return self.device_mesh[axis.value if isinstance(axis, Axis) else axis]

    def coord(self, axis: Axis | str) -> int:
        return self.dims.coords(self.rank)[Axis(axis)]

    def size(self, axis: Axis | str) -> int:
        return self.dims.degree(Axis(axis))
