"""Rank layout on nodes: one bundle per node, ranks (pp, dp, tp) tp-fastest. Pure data; the
worker group turns it into a Ray placement group."""

from __future__ import annotations

from collections.abc import Sequence
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



def plan_placement(dims: ParallelDims, node_ranks: Sequence[int],
                   resources_per_rank: dict[str, float]) -> Placement:
    """Consecutive ranks fill the nodes in order, ``node_ranks[b]`` ranks in bundle ``b``.
    With every count a multiple of tp, each TP group is inside one node; with every count a
    multiple of dp × tp, each pipeline stage is too."""
    world = dims.world_size
    if sum(node_ranks) != world or any(n < 1 for n in node_ranks):
        raise ValueError(f"ranks per node {list(node_ranks)} do not add up to the world of "
                         f"{world} (tp×pp×dp)")
    if any(n % dims.tp for n in node_ranks):
        raise ValueError(f"ranks per node {list(node_ranks)} would split TP groups of {dims.tp}")
    bundles = tuple({k: v * n for k, v in resources_per_rank.items() if v} for n in node_ranks)
    rank_bundle = tuple(b for b, n in enumerate(node_ranks) for _ in range(n))
    return Placement(bundles=bundles, rank_bundle=rank_bundle,
                     resources_per_rank=dict(resources_per_rank))
