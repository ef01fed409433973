"""Rank actors kept across the test modules on the local instance: each run re-forms the same
processes for its mesh (the warm-recovery path: new ranks, a new process group, a new model
part). A smaller mesh leaves the processes it does not use parked (idle, their reservations
kept) and a larger one takes them back, so the pool starts its processes once (a mesh larger
than all of them, or another environment, starts a new group). Importing torch in a new actor
is the slowest part of a small multi-rank test on 2 cores."""

from __future__ import annotations

import os

from trainmesh.controller.ray_group import RayWorkerGroup, placement_for
from trainmesh.parallel.dims import ParallelDims
from trainmesh.planning.topology import Topology
from trainmesh.testing.probes import ProbedRank

# The test process's Triton mode too (conftest), so kernel tests share the pool's actors.
ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
       "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0")}
# Pipeline point-to-point under NCCL's rules (testing/nccl_rules.py) for every parallel test:
# what passes here cannot deadlock or mismatch messages on GPUs (gloo's own semantics are the
# fault matrix's and the demo's); and ``probes.execute`` on every rank.
RANK = ProbedRank


class RankPool:
    def __init__(self, max_ranks: int = 8):
        self.max_ranks = max_ranks  # beyond this (or another env), a group of its own
        self.group: RayWorkerGroup | None = None
        self.env: dict[str, str] = {}
        self.parked: list[tuple] = []  # (actor, slot, node, seat, proc) of processes not in the mesh

    def group_for(self, spec, dims: ParallelDims, env: dict[str, str] | None = None) -> RayWorkerGroup:
        """A worker group for ``spec``'s mesh, with the process group formed; call ``release``
        on it when done (it stays running for the next test when it came from the pool)."""
        env = {**ENV, **(env or {})}
        if dims.world_size <= self.max_ranks:  # the pool's ranks take half a logical CPU each:
            # up to 8 of them leave room on the shared instance for a 4-rank job beside them
            spec = spec.model_copy(update={"runtime": spec.runtime.model_copy(
                update={"cpus_per_rank": 0.5})})
        placement = placement_for(spec, dims, Topology.uniform(1, dims.world_size, "cpu"))
        if dims.world_size > self.max_ranks:
            # A group of its own beside the pool (the shared instance has CPUs for both; the
            # pool's idle actors use no core).
            return RayWorkerGroup(spec, dims, placement, env, rank_cls=RANK)
        # Growing past the processes started would need the node's whole bundle again while
        # the kept ranks hold part of it: start afresh instead (the largest mesh first).
        if self.group is not None and (env != self.env or dims.world_size > (
                self.group.group.world_size + len(self.parked))):
            self.close()
        if self.group is None:
            self.group, self.env = RayWorkerGroup(spec, dims, placement, env, rank_cls=RANK), env
        else:
            self._take_parked(dims.world_size)
            # Each process takes another rank than it had (old rank r+1 becomes rank r), as
            # survivors do in a warm recovery: anything a process keeps from its last mesh
            # (DTensor's caches: rank_worker._forget_dtensor_caches) breaks the run here.
            self.group.spec, self.group.timeout = spec, spec.runtime.collective_timeout_s
            world = dims.world_size
            self.group.reform([(r + 1) % world for r in range(world)], placement, timeout_s=120)
        return self.group

    def _take_parked(self, world: int) -> None:
        """Make the group ``world`` processes before a re-form keeps all of them: park those a
        smaller mesh does not use (a re-form would end them), take parked ones back for a
        larger one. (All hold bundles of the pool's first placement group, which the running
        ranks keep alive.)"""
        g = self.group.group
        fields = ("workers", "slots", "nodes", "seats", "procs")
        rows = list(zip(*(getattr(g, f) for f in fields), strict=True))
        rows, self.parked = rows[:world], rows[world:] + self.parked
        rows, self.parked = rows + self.parked[:world - len(rows)], self.parked[world - len(rows):]
        for f, column in zip(fields, zip(*rows, strict=True), strict=True):
            setattr(g, f, list(column))

    def release(self, group: RayWorkerGroup) -> None:
        """Done with ``group``: a group of the pool stays for the next test, another ends."""
        if group is not self.group:
            group.shutdown()

    def close(self) -> None:
        """End the pool's actors (a test that starts its own ranks calls this first)."""
        if self.group is not None:
            self._take_parked(self.group.group.world_size + len(self.parked))  # all of them
            self.group.shutdown()
            self.group = None


def next_generation(group) -> int:
    """A snapshot generation above every one the group's processes hold. The pool's processes
    keep other modules' in-memory snapshots, and each keeps its newest two by name (generation,
    then step): a snapshot named below them is dropped as it is taken."""
    return 1 + max((int(d.split("-")[0]) for inv in group.memory_inventory() for d in inv), default=-1)
