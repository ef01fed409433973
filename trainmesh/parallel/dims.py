"""Parallel degrees and the pure rank math over them (no torch, no ray).

Ranks are laid out (pp, dp, tp) with tp fastest: ``rank = (pp_i * dp + dp_i) * tp + tp_i``.
So a TP group is ``tp`` consecutive ranks (one node), and a pipeline stage is ``dp * tp``
consecutive ranks.

Expert parallel folds over dp (it adds no ranks): dp = edp × ep with ep fastest, so an EP
group is ``ep`` consecutive data-parallel replicas (``dp_i = edp_i * ep + ep_i``). Hybrid
sharding (``parallelism.dp_replicate``, the mesh's business: ``parallel/mesh.py``) splits dp
the same way, dp = dp_replicate × dp_shard with shard fastest: a ZeRO-3 shard group is
``dp_shard`` consecutive replicas, the nearest ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Axis(str, Enum):
    PP = "pp"
    DP = "dp"
    TP = "tp"


AXES: tuple[Axis, ...] = (Axis.PP, Axis.DP, Axis.TP)


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallel, folded over dp

    def __post_init__(self) -> None:
        for name in (*(a.value for a in AXES), "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"parallel degree {name}={v!r} must be a positive integer")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} does not divide dp={self.dp}: expert-parallel groups "
                             "are carved out of the data-parallel replicas")

    @property
    def edp(self) -> int:
        """Replicas of each expert: the data-parallel degree left over by expert parallel."""
        return self.dp // self.ep

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    def degree(self, axis: Axis) -> int:
        return getattr(self, Axis(axis).value)

    def coords(self, rank: int) -> dict[Axis, int]:
        """This rank's index along every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        tp_i = rank % self.tp
        dp_i = (rank // self.tp) % self.dp
        pp_i = rank // (self.tp * self.dp)
        return {Axis.PP: pp_i, Axis.DP: dp_i, Axis.TP: tp_i}

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def groups(self, axis: Axis) -> list[list[int]]:
        """Every group of ranks that differ only along ``axis`` (ordered by that axis)."""
        axis = Axis(axis)
        others = [a for a in AXES if a is not axis]
        out = []
        for i in range(self.degree(others[0])):
            for j in range(self.degree(others[1])):
                group = []
                for k in range(self.degree(axis)):
                    c = {others[0]: i, others[1]: j, axis: k}
                    group.append(self.rank_of(c[Axis.PP], c[Axis.DP], c[Axis.TP]))
                out.append(group)
        return out

    def as_dict(self) -> dict[str, int]:
        out = {"pp": self.pp, "dp": self.dp, "tp": self.tp, "world_size": self.world_size}
        return {**out, "ep": self.ep} if self.ep > 1 else out
