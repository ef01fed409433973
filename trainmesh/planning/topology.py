"""The cluster as the planner sees it: nodes, accelerators per node, and the device's facts.

Read from a live Ray cluster (:func:`topology_from_ray`) or described by hand
(:meth:`Topology.uniform`) to plan a cluster you do not have. No torch here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trainmesh.planning.devices import DeviceSpec, device_spec


@dataclass(frozen=True)
class Node:
    node_id: str
    accelerators: int
    host_memory_gib: float | None = None  # what Ray lets tasks and actors use there


@dataclass(frozen=True)
class Topology:
    nodes: tuple[Node, ...]
    device: DeviceSpec

    @classmethod
    def uniform(cls, nodes: int, per_node: int, device: str | DeviceSpec) -> Topology:
        if nodes < 1 or per_node < 1:
            raise ValueError(f"need at least one node and one accelerator per node, got "
                             f"nodes={nodes}, per_node={per_node}")
        dev = device if isinstance(device, DeviceSpec) else device_spec(device)
        return cls(tuple(Node(f"node-{i}", per_node) for i in range(nodes)), dev)

    @functools.cached_property  # (a frozen dataclass: computed once; the planner asks often)
    def world_size(self) -> int:
        return sum(n.accelerators for n in self.nodes)

    @functools.cached_property
    def per_node(self) -> int:
        """Accelerators on the smallest node."""
        return min(n.accelerators for n in self.nodes)

    @functools.cached_property
    def largest_node(self) -> int:
        """Accelerators on the largest node: TP degrees are its divisors."""
        return max(n.accelerators for n in self.nodes)

    @property
    def host_memory_gib(self) -> float | None:
        """Host memory of the smallest node (None: unknown)."""
        known = [n.host_memory_gib for n in self.nodes if n.host_memory_gib is not None]
        return min(known) if known else None

    def with_host_memory(self, gib: float | None) -> Topology:
        if gib is None:
            return self
        return dataclasses.replace(self, nodes=tuple(dataclasses.replace(n, host_memory_gib=gib)
                                                     for n in self.nodes))

    def with_overrides(self, overrides: Mapping[str, Any]) -> Topology:
        """Replace device facts (``memory_gib``, ``peak_tflops``, ...) that are not None."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return dataclasses.replace(self, device=dataclasses.replace(self.device, **given))

    def usable(self, unit: int) -> Topology:
        """Only nodes' whole multiples of ``unit`` accelerators (e.g. a TP group)."""
        made = self.__dict__.setdefault("_usable", {})  # (frozen: kept beside the fields)
        if unit not in made:
            nodes = tuple(Node(n.node_id, n.accelerators // unit * unit) for n in self.nodes
                          if n.accelerators >= unit)
            made[unit] = dataclasses.replace(self, nodes=nodes)
        return made[unit]

    def allocate(self, unit: int, world: int) -> tuple[int, ...]:
        """Ranks per node for ``world`` ranks in whole groups of ``unit`` (a TP group never
        crosses a node): the largest nodes first, each filled before the next. The nodes
        left out, and any remainder below ``unit``, stay idle (spares)."""
        counts, left = [], world
        for n in sorted(self.usable(unit).nodes, key=lambda n: -n.accelerators):
            if left <= 0:
                break
            take = min(n.accelerators, left)
            counts.append(take)
            left -= take
        if left > 0 or world % unit:
            raise ValueError(f"{world} ranks in groups of {unit} do not fit on nodes with "
                             f"{[n.accelerators for n in self.nodes]} accelerators")
        return tuple(counts)


def topology_from_nodes(ray_nodes: Iterable[Mapping[str, Any]], device: str | None,
                        cpus_per_rank: float = 1.0) -> Topology:
    """From ``ray.nodes()`` records: GPUs per alive node; a CPU-only cluster counts ranks as
    CPUs / cpus_per_rank. ``device`` names the accelerator when Ray's label is not enough."""
    alive = [n for n in ray_nodes if n.get("Alive", n.get("alive", True))]
    gpus = [int(n.get("Resources", {}).get("GPU", 0)) for n in alive]
    if any(gpus) and device != "cpu":
        nodes = tuple(Node(n["NodeID"], g, _host_gib(n)) for n, g in zip(alive, gpus, strict=True) if g > 0)
        name = device or _accelerator_label(alive) or "h100"
    else:
        nodes = tuple(Node(n["NodeID"], int(n.get("Resources", {}).get("CPU", 0) // cpus_per_rank),
                           _host_gib(n)) for n in alive)
        nodes = tuple(n for n in nodes if n.accelerators > 0)
        name = device or "cpu"
    if not nodes:
        raise RuntimeError("the Ray cluster has no alive node with GPUs or CPUs to run ranks on")
    return Topology(nodes, device_spec(name))


def _host_gib(node: Mapping[str, Any]) -> float | None:
    mem = node.get("Resources", {}).get("memory")
    return None if mem is None else mem / 2**30


def _accelerator_label(nodes: list[Mapping[str, Any]]) -> str | None:
    """Ray advertises ``accelerator_type:H100`` style resources on GPU nodes."""
    for n in nodes:
        for key in n.get("Resources", {}):
            if key.startswith("accelerator_type:"):
                label = key.split(":", 1)[1].lower()
                for known in ("h200", "h100", "b200", "l40s"):
                    if known in label:
                        return known
                if "a100" in label:
                    return "a100-80gb" if "80" in label else "a100-40gb"
    return None


def topology_from_ray(device: str | None = None, cpus_per_rank: float = 1.0) -> Topology:
    import ray

    return topology_from_nodes(ray.nodes(), device, cpus_per_rank)
