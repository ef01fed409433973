"""Parallel degrees and the pure rank math over them (no torch, no ray).

Ranks are laid out (pp, dp, cp, tp) with tp fastest:
``rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i``. So a TP group is ``tp`` consecutive
ranks (one node), a context-parallel ring the ``cp × tp`` ranks next to it, and a pipeline
stage is ``dp * cp * tp`` consecutive ranks.

Expert parallel folds over dp × cp (it adds no ranks): the flattened (dp, cp) index splits as
edp × ep with ep fastest, so an EP group is ``ep`` consecutive (replica, cp) positions; with
cp > 1, ep must be a multiple of cp (each EP group whole CP rings). Hybrid
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
    CP = "cp"
    TP = "tp"


AXES: tuple[Axis, ...] = (Axis.PP, Axis.DP, Axis.CP, Axis.TP)


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallel, folded over dp × cp
    cp: int = 1  # context parallel: each sequence split over cp ranks

    def __post_init__(self) -> None:
        for name in (*(a.value for a in AXES), "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"parallel degree {name}={v!r} must be a positive integer")
        if (self.dp * self.cp) % self.ep or self.ep % self.cp and self.ep > 1:
            raise ValueError(f"ep={self.ep} must divide dp × cp = {self.dp * self.cp} and be a "
                             f"multiple of cp={self.cp}: expert-parallel groups are carved out of "
                             "the data-parallel replicas, whole context-parallel rings each")

    @property
    def edp(self) -> int:
        """Replicas of each expert: the dp × cp ranks left over by expert parallel."""
        return self.dp * self.cp // self.ep

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.tp)

    def degree(self, axis: Axis) -> int:
        return getattr(self, Axis(axis).value)

    def coords(self, rank: int) -> dict[Axis, int]:
        """This rank's index along every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        out, rest = {}, rank
        for axis in reversed(AXES):
            rest, out[axis] = divmod(rest, self.degree(axis))
        return {a: out[a] for a in AXES}

    def rank_of(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def groups(self, axis: Axis) -> list[list[int]]:
        """Every group of ranks that differ only along ``axis`` (ordered by that axis)."""
        axis = Axis(axis)
        by_rest: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            by_rest.setdefault(tuple(c[a] for a in AXES if a is not axis), []).append(rank)
        return list(by_rest.values())

    def as_dict(self) -> dict[str, int]:
        out = {"pp": self.pp, "dp": self.dp, "tp": self.tp, "world_size": self.world_size}
        extra = {k: getattr(self, k) for k in ("ep", "cp") if getattr(self, k) > 1}
        return {**out, **extra}


def replicates(dp: int, dp_replicate: int, pp: int, tp: int, cp: int, moe: bool) -> bool:
    """Whether a layout runs as DDP: hybrid sharding whose shard groups are single ranks
    (dp_replicate = dp > 1), without pipeline, tensor or context parallel and dense (those
    keep FSDP2's HSDP: its per-stage hooks, DTensor parameters and expert meshes)."""
    return dp > 1 and dp_replicate == dp and pp == tp == cp == 1 and not moe
