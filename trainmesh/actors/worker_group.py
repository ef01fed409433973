"""A group of RankWorker actors placed by a placement group, one bundle per node."""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from trainmesh.actors.rank_worker import RankWorker
from trainmesh.parallel.layout import Placement


class PlacementTimeout(RuntimeError):
    pass


class WorkerGroup:
    """Starts one actor per rank and calls methods on all of them together."""

    def __init__(self, placement: Placement, env_vars: dict[str, str], ready_timeout_s: float,
                 cpu_threads: int = 1):
        self.placement = placement
        self.pg = placement_group(list(placement.bundles), strategy=placement.strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=ready_timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise PlacementTimeout(
                f"placement group {list(placement.bundles)} ({placement.strategy}) was not "
                f"placed within {ready_timeout_s:.0f} s: the cluster lacks the resources; "
                "lower the parallel degrees or add nodes")
        world = len(placement.rank_bundle)
        res = placement.resources_per_rank
        cls = ray.remote(RankWorker)
        self.workers = [
            cls.options(
                num_cpus=res.get("CPU", 0), num_gpus=res.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=b),
                runtime_env={"env_vars": env_vars},
            ).remote(rank, world, cpu_threads)
            for rank, b in enumerate(placement.rank_bundle)
        ]

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list:
        """Call ``method`` on every rank; results in rank order."""
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        return ray.get(refs, timeout=timeout_s)

    def setup_process_group(self, device: str, timeout_s: float) -> str:
        host, port = ray.get(self.workers[0].create_store.remote(timeout_s))
        backends = self.call("init_process_group", host, port, device, timeout_s)
        return backends[0]

    def shutdown(self) -> None:
        """End every rank and release the placement group (safe to call twice)."""
        if self.pg is None:
            return
        try:
            self.call("shutdown", timeout_s=30)
        except Exception:  # noqa: BLE001 - best effort: dead ranks are killed below anyway
            pass
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.pg)
        self.pg = None
