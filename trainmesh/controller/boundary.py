"""What the controller asks at every step boundary besides the checkpoint cadence, and while a
segment of steps runs (to end it early): did a node give notice (a preemption), and have
accelerators come that a re-plan would use (a scale-up)? Both read the cluster, so each is
asked at most so often."""

from __future__ import annotations

import time
from collections.abc import Callable

from trainmesh.controller.elastic import should_scale_up
from trainmesh.controller.ray_group import draining_nodes
from trainmesh.planning.job_plan import PlanError, replan_job
from trainmesh.planning.topology import Topology
from trainmesh.spec.job import JobSpec

DRAIN_CHECK_S = 1.0
GROW_CHECK_S = 5.0


class StepBoundary:
    def __init__(self, spec: JobSpec, available: Callable[[], Topology]):
        self.spec, self._available = spec, available
        self._draining: set[str] = set()  # nodes Ray is draining, as last read from the GCS
        self._drain_checked = self._grow_checked = float("-inf")

    def notified(self, stats: list[dict], rank_nodes: list[str]) -> list[int]:
        """Ranks with a preemption notice: a SIGTERM to the rank, or its node being drained
        (the GCS is asked at most every DRAIN_CHECK_S, not at every step)."""
        self.draining(rank_nodes)
        return [r for r, s in enumerate(stats)
                if s.get("preempted") or rank_nodes[r] in self._draining]

    def draining(self, rank_nodes: list[str]) -> bool:
        """Whether Ray drains a node of ``rank_nodes`` (the GCS asked at most every
        DRAIN_CHECK_S)."""
        now = time.monotonic()
        if now >= self._drain_checked + DRAIN_CHECK_S:
            self._draining, self._drain_checked = set(draining_nodes()), now
        return bool(self._draining & set(rank_nodes))

    def may_grow(self, world_size: int, checkpointing: bool) -> bool:
        """Whether nodes have come that a re-plan would use (asked at checkpoints and at most
        every GROW_CHECK_S between them); only where the spec allows growing: auto
        parallelism or a max_world_size."""
        el = self.spec.elastic
        if not (self.spec.parallelism.auto or el.max_world_size):
            return False
        if not checkpointing and time.monotonic() < self._grow_checked + GROW_CHECK_S:
            return False
        self._grow_checked = time.monotonic()
        try:  # what a re-plan would use now (spares need not mean a bigger mesh)
            planned = replan_job(self.spec, self._available()).dims.world_size
        except PlanError:
            return False
        return should_scale_up(world_size, planned, el)
