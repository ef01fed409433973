"""Ready rank processes: started ahead of need on the nodes of a job's ranks and
on spares enough to replace one of them (``controller/elastic.ready_nodes``), so that a refill, a
new node's ranks or a cold restart take a process that has torch and the parallel stack
imported (``RankWorker.warm``) instead of starting one — a new rank process imports torch and
DTensor (~2 s of a core) and, on a GPU node, later pays its CUDA context.

A ready process holds no resources: it takes none of the accelerators running ranks need, and
it must not, since Ray cannot give an actor resources after it started. When it becomes a rank,
a *seat* (``Seat``: a bare actor, no torch) takes the rank's reservation — its bundle's CPUs and
accelerator — and tells which accelerator Ray gave it; the ready process uses that one
(``RankWorker.adopt``). Ray's books stay true, the seat's process starts in a fraction of a
rank's time, and the two end together (``WorkerGroup.end``)."""

from __future__ import annotations

from collections.abc import Iterable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from trainmesh.actors.rank_worker import RankWorker


class ReadyRank(RankWorker):
    """A rank process started ahead of need (its own class: Ray names its process
    ``ray::ReadyRank``, also once it is a rank, so a node's ready processes can be told from
    its ranks: a rank is a ``RankWorker`` or a ``Seat``)."""


class Seat:
    """A rank's reservation, held for the ready process that works in it."""

    def accelerators(self) -> list:
        return list(ray.get_gpu_ids())


class ReadyPool:
    """Up to ``per_node`` ready processes on each node it is asked to fill, for one job (their
    environment is the job's ranks'). Owned by the controller: it outlives the worker groups of
    cold restarts."""

    def __init__(self, per_node: int, env_vars: dict[str, str], cpu_threads: int,
                 concurrency_groups: dict[str, int], rank_cls: type[RankWorker] | None = None):
        """``rank_cls``: the ranks' class (default ``RankWorker``); its ready processes are of
        a subclass of it named ``ReadyRank``."""
        self.per_node, self._env_vars, self._cpu_threads = per_node, env_vars, cpu_threads
        self._groups = concurrency_groups
        self._cls = ReadyRank if rank_cls in (None, RankWorker) else type(
            "ReadyRank", (rank_cls,), {"__doc__": ReadyRank.__doc__})
        # node: [(actor, ref of its warm-up, ref of its node_info)]
        self._ready: dict[str, list[tuple]] = {}
        self.accelerators: dict[str, int] = {}  # node: its accelerators, as the last fill knew

    def fill(self, nodes: Iterable[str], accelerators: dict[str, int] | None = None) -> None:
        """Start processes (without waiting for them) until each of ``nodes`` has ``per_node``
        ready; those on other nodes (dead, drained, given back) and those that died are ended.
        ``accelerators``: each node's, for placements that prefer these nodes."""
        self.accelerators.update(accelerators or {})
        nodes = set(nodes)
        for node in [n for n in self._ready if n not in nodes]:
            self._end(self._ready.pop(node))
        cls = ray.remote(concurrency_groups=self._groups)(self._cls)
        for node in sorted(nodes):
            have = self._ready.setdefault(node, [])
            dead = [h for h in have if _failed(h[1]) or _failed(h[2])]
            self._end(dead)
            have[:] = [h for h in have if h not in dead]
            for _ in range(self.per_node - len(have)):
                actor = cls.options(
                    num_cpus=0, num_gpus=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                    runtime_env={"env_vars": self._env_vars},
                ).remote(-1, 0, self._cpu_threads)
                # (node_info: on the control thread, answered while the warm-up runs)
                have.append((actor, actor.warm.remote(), actor.node_info.remote()))

    def nodes(self, accelerators: float = 0) -> set[str]:
        """The nodes holding ready processes now (with at least ``accelerators``, where known)."""
        return {node for node, have in self._ready.items()
                if have and self.accelerators.get(node, accelerators) >= accelerators}

    def drop(self, nodes) -> None:
        """End the ready processes on ``nodes`` (dead, draining: new ranks must not go there)."""
        for node in set(nodes) & set(self._ready):
            self._end(self._ready.pop(node))

    def take_all(self, nodes: list[str], alive_s: float = 10.0) -> list[tuple | None]:
        """For each of ``nodes`` (a node once per rank to place there), a ready process there
        that answers (warmed ones first; one still starting is waited for up to ``alive_s``,
        time its adoption would wait anyway; one that died or does not answer is ended), now
        the caller's, with its pid; None where there is none. Every candidate is asked at once
        and the answers waited for once, a round per candidate that failed to answer."""
        out: list[tuple | None] = [None] * len(nodes)
        for node in set(nodes):
            self._ready.get(node, []).sort(key=lambda h: not ray.wait([h[1]], timeout=0)[0])
        todo = list(range(len(nodes)))
        while todo:
            asked: dict[int, tuple] = {}  # index: (actor, its node_info ref)
            for i in todo:
                have = self._ready.get(nodes[i], [])
                while have:
                    actor, warm, _ = have.pop(0)
                    if _failed(warm):
                        ray.kill(actor)
                        continue
                    asked[i] = (actor, actor.node_info.remote())  # (its control thread: it
                    break  # answers while the warm-up runs)
            if not asked:
                break
            ray.wait([ref for _, ref in asked.values()], num_returns=len(asked), timeout=alive_s)
            todo = []
            for i, (actor, ref) in asked.items():
                try:
                    out[i] = actor, ray.get(ref, timeout=0)["pid"]
                except Exception:  # noqa: BLE001 - dead or not there: the next one
                    ray.kill(actor)
                    todo.append(i)
        return out

    def shutdown(self) -> None:
        for have in self._ready.values():
            self._end(have)
        self._ready = {}

    @staticmethod
    def _end(have: list[tuple]) -> None:
        for actor, *_ in have:
            ray.kill(actor)


def _failed(ref) -> bool:
    """Whether a ready process's call failed (its node died, the process crashed)."""
    if not ray.wait([ref], timeout=0)[0]:
        return False
    try:
        ray.get(ref)
        return False
    except Exception:  # noqa: BLE001 - any failure: not ready
        return True
