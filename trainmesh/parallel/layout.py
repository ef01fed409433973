"""Rank layout on nodes: one bundle per node, ranks (pp, dp, tp) tp-fastest. Pure data; the
worker group turns it into a Ray placement group."""

from __future__ import annotations

from dataclasses import dataclass

from trainmesh.parallel.dims import ParallelDims


@dataclass(frozen=True)
class Placement:
    """Bundles (one per node) and, for every rank, the bundle it lives in."""

    bundles: tuple[dict[str, float], ...]
    rank_bundle: tuple[int, ...]
    resources_per_rank: dict[str, float]

    @property
    def strategy(self) -> str:
        return "STRICT_SPREAD" if len(self.bundles) > 1 else "PACK"



def plan_placement(dims: ParallelDims, ranks_per_node: int,
                   resources_per_rank: dict[str, float]) -> Placement:
    """Fill nodes with consecutive ranks. With ``ranks_per_node`` a multiple of tp, every TP
    group is inside one node; with it a multiple of dp × tp, every pipeline stage is too."""
    world = dims.world_size
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be at least 1")
    per_node = min(ranks_per_node, world)
    if per_node % dims.tp and dims.tp <= ranks_per_node:
        raise ValueError(f"{per_node} ranks per node would split TP groups of {dims.tp}")
    n_nodes = -(-world // per_node)
    bundles = []
    for b in range(n_nodes):
        n = min(per_node, world - b * per_node)
        bundles.append({k: v * n for k, v in resources_per_rank.items() if v})
    rank_bundle = tuple(r // per_node for r in range(world))
    return Placement(bundles=tuple(bundles), rank_bundle=rank_bundle,
                     resources_per_rank=dict(resources_per_rank))
