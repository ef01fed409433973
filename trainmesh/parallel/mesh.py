"""The device mesh one rank trains on: a DeviceMesh over ("pp", "dp", "tp"), with context
parallel ("pp", "dp", "cp", "tp"), with expert parallel ("pp", "edp", "ep", "tp") (with cp:
("pp", "edp", "ep_dp", "cp", "tp"), "ep" = ("ep_dp", "cp")), or with hybrid sharding
("pp", "dp_replicate", "dp_shard"[, "cp"], "tp") (beside expert parallel ("pp",
"dp_replicate", "edp_shard", "ep"[_dp, "cp"], "tp"), "dp_shard"[_cp] = ("edp_shard",
"ep"[_dp, "cp"])), plus its dims.
"dp" is every data-parallel replica (flattened where it is split); "ep" is one expert-parallel
group, "edp" the replicas of one expert; "dp_cp" every rank that holds the same parameters of
a stage (the replicas and their context-parallel peers), over which gradients reduce; ZeRO-3
shards over ``zero_mesh``: "dp" (cp = 1) or "dp_cp", or for hybrid sharding the 2-D
("dp_replicate", "dp_shard"[_cp]), FSDP2's HSDP, and the experts over ``expert_mesh``. "dp_tp"
is every rank of a pipeline stage (the ranks that split an MoE block's tokens).

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
    # The node of each global rank (an index; empty: one node). What a relayed expert
    # dispatch reads (``parallel/expert.py``); nothing else depends on it.
    nodes: tuple[int, ...] = ()

    @classmethod
    def build(cls, dims: ParallelDims, device_type: str, rank: int, moe: bool = False,
              dp_replicate: int = 1, nodes: tuple[int, ...] = ()) -> Mesh:
        """``_layout``'s mesh, on ``nodes`` (the node of each global rank; empty: one)."""
        if nodes and len(nodes) != dims.world_size:
            raise ValueError(f"{len(nodes)} ranks' nodes for a world of {dims.world_size}")
        mesh = cls._layout(dims, device_type, rank, moe, dp_replicate)
        mesh.nodes = tuple(nodes)
        return mesh

    @classmethod
    def _layout(cls, dims: ParallelDims, device_type: str, rank: int, moe: bool,
                dp_replicate: int) -> Mesh:
        """Collective over the default process group: every rank must call it. Each view is a
        process group to set up, which a rank's start pays for: only those the layout uses
        exist ("dp_tp" only for an MoE model, ``moe``; "dp_cp" only with cp > 1).
        ``dp_replicate`` > 1: hybrid sharding, the dp axis split in (replicate, shard) with
        shard fastest, so a shard group is consecutive replicas (the nearest ranks)."""
        cp = (dims.cp,) if dims.cp > 1 else ()
        cpn = ("cp",) if cp else ()
        if dp_replicate > 1 and dims.ep > 1:
            return cls._hybrid_expert(dims, device_type, rank, dp_replicate)
        if dp_replicate > 1:
            if dims.dp % dp_replicate:
                raise ValueError(f"dp_replicate={dp_replicate} must divide dp={dims.dp}")
            dm = init_device_mesh(device_type, (dims.pp, dp_replicate, dims.dp // dp_replicate,
                                                *cp, dims.tp),
                                  mesh_dim_names=("pp", "dp_replicate", "dp_shard", *cpn, "tp"))
            dm["dp_replicate", "dp_shard"]._flatten("dp")
            if cp:
                dm["dp_shard", "cp"]._flatten("dp_shard_cp")
                dm["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
            if moe:
                dm[("dp_replicate", "dp_shard", *cpn, "tp")]._flatten("dp_tp")
                if cp and dims.tp > 1:
                    dm["cp", "tp"]._flatten("cp_tp")
            return cls(dims=dims, device_mesh=dm, rank=rank, dp_replicate=dp_replicate)
        if dims.ep == 1:
            dm = init_device_mesh(device_type, (dims.pp, dims.dp, *cp, dims.tp),
                                  mesh_dim_names=("pp", "dp", *cpn, "tp"))
            if cp:
                dm["dp", "cp"]._flatten("dp_cp")
            if moe:
                dm[("dp", *cpn, "tp")]._flatten("dp_tp")
                if cp and dims.tp > 1:
                    dm["cp", "tp"]._flatten("cp_tp")
            return cls(dims=dims, device_mesh=dm, rank=rank)
        if not cp:
            dm = init_device_mesh(device_type, (dims.pp, dims.edp, dims.ep, dims.tp),
                                  mesh_dim_names=("pp", "edp", "ep", "tp"))
            dm["edp", "ep"]._flatten("dp")
            dm["edp", "ep", "tp"]._flatten("dp_tp")
            return cls(dims=dims, device_mesh=dm, rank=rank)
        # ep = k × cp: each EP group is k replicas' whole CP rings
        k = dims.ep // dims.cp
        dm = init_device_mesh(device_type, (dims.pp, dims.dp // k, k, dims.cp, dims.tp),
                              mesh_dim_names=("pp", "edp", "ep_dp", "cp", "tp"))
        dm["ep_dp", "cp"]._flatten("ep")
        dm["edp", "ep_dp"]._flatten("dp")
        dm["edp", "ep_dp", "cp"]._flatten("dp_cp")
        dm["edp", "ep_dp", "cp", "tp"]._flatten("dp_tp")
        if dims.tp > 1:
            dm["cp", "tp"]._flatten("cp_tp")
        return cls(dims=dims, device_mesh=dm, rank=rank)

    @classmethod
    def _hybrid_expert(cls, dims: ParallelDims, device_type: str, rank: int,
                       dp_replicate: int) -> Mesh:
        """Hybrid sharding beside expert parallel: ("pp", "dp_replicate", "edp_shard", "ep",
        "tp"), each shard group of dp / dp_replicate replicas holding whole EP groups, so an
        expert is split over "ep", sharded over "edp_shard" (the rest of its shard group) and
        replicated over "dp_replicate"; "dp_shard" = ("edp_shard", "ep") is the other
        parameters' shard group. With context parallel an EP group is k = ep / cp replicas'
        whole rings: ("pp", "dp_replicate", "edp_shard", "ep_dp", "cp", "tp"), "ep" =
        ("ep_dp", "cp"), and the other parameters shard over "dp_shard_cp" = ("edp_shard",
        "ep_dp", "cp")."""
        k, cp, shard = dims.ep // dims.cp, dims.cp, dims.dp // dp_replicate
        if dims.dp % dp_replicate or shard % k:
            raise ValueError(f"dp_replicate={dp_replicate} beside ep={dims.ep} needs dp={dims.dp} "
                             f"/ dp_replicate to be a multiple of ep / cp = {k}")
        if cp == 1:
            dm = init_device_mesh(device_type, (dims.pp, dp_replicate, shard // k, k, dims.tp),
                                  mesh_dim_names=("pp", "dp_replicate", "edp_shard", "ep", "tp"))
            dm["edp_shard", "ep"]._flatten("dp_shard")
            dm["dp_replicate", "edp_shard", "ep"]._flatten("dp")
            dm["dp_replicate", "edp_shard", "ep", "tp"]._flatten("dp_tp")
            return cls(dims=dims, device_mesh=dm, rank=rank, dp_replicate=dp_replicate)
        dm = init_device_mesh(device_type, (dims.pp, dp_replicate, shard // k, k, cp, dims.tp),
                              mesh_dim_names=("pp", "dp_replicate", "edp_shard", "ep_dp", "cp", "tp"))
        dm["ep_dp", "cp"]._flatten("ep")
        dm["edp_shard", "ep_dp", "cp"]._flatten("dp_shard_cp")
        dm["dp_replicate", "edp_shard", "ep_dp"]._flatten("dp")
        dm["dp_replicate", "edp_shard", "ep_dp", "cp"]._flatten("dp_cp")
        dm["dp_replicate", "edp_shard", "ep_dp", "cp", "tp"]._flatten("dp_tp")
        if dims.tp > 1:
            dm["cp", "tp"]._flatten("cp_tp")
        return cls(dims=dims, device_mesh=dm, rank=rank, dp_replicate=dp_replicate)

    @property
    def expert_mesh(self) -> DeviceMesh:
        """What ZeRO-3 shards the experts over (each already split over "ep"): "edp", the
        replicas of each expert, or under hybrid sharding ("dp_replicate", "edp_shard")."""
        if self.dp_replicate > 1:
            return self.device_mesh["dp_replicate", "edp_shard"]
        return self.device_mesh["edp"]

    @property
    def zero_mesh(self) -> DeviceMesh:
        """What ZeRO-3 shards non-expert parameters over: "dp" ("dp_cp" with context parallel:
        parameters are replicated across cp), or for hybrid sharding the 2-D ("dp_replicate",
        "dp_shard"[_cp]) (FSDP2 shards over the second, replicates over the first)."""
        cp = self.dims.cp > 1
        if self.dp_replicate > 1:
            return self.device_mesh["dp_replicate", "dp_shard_cp" if cp else "dp_shard"]
        return self.device_mesh["dp_cp" if cp else "dp"]

    @property
    def replicas(self) -> int:
        """Ranks of a stage holding the same parameters: dp × cp."""
        return self.dims.dp * self.dims.cp

    def replica_group(self):
        """The process group over them ("dp", or "dp_cp"); None for one."""
        if self.replicas == 1:
            return None
        return self[("dp_cp" if self.dims.cp > 1 else "dp")].get_group()

    def __getitem__(self, axis: Axis | str) -> DeviceMesh:
        """The 1-D mesh of ``axis`` through this rank: pp, dp, cp, tp, or ep, edp, dp_cp, dp_tp,
        or dp_replicate, dp_shard (hybrid sharding; beside expert parallel edp_shard, and no
        edp: ``expert_mesh``)."""
        return self.device_mesh[axis.value if isinstance(axis, Axis) else axis]

    def coord(self, axis: Axis | str) -> int:
        return self.dims.coords(self.rank)[Axis(axis)]

    def size(self, axis: Axis | str) -> int:
        return self.dims.degree(Axis(axis))
