"""The in-memory checkpoint tier as the controller drives it: when to snapshot, each rank's
buddy on another node, and on a recovery the newest snapshot the survivors still hold in full
(else the newest storage checkpoint). The ranks' side: ``actors/rank_worker.py``
(``memory_*``) over ``checkpoint/memory_fs.py``."""

from __future__ import annotations

from typing import Any

from trainmesh.checkpoint.rng_states import job_states


def buddies(rank_nodes: list[str]) -> list[int | None]:
    """Rank r's buddy: the rank at r's position (wrapping) on the next node of a ring over the
    nodes, so any one node's loss leaves a copy of each of its ranks' snapshots; None when the
    job has one node (a snapshot then outlives a rank's process, not its node)."""
    order = list(dict.fromkeys(rank_nodes))
    if len(order) < 2:
        return [None] * len(rank_nodes)
    on = {n: [r for r, m in enumerate(rank_nodes) if m == n] for n in order}
    out: list[int | None] = []
    for r, n in enumerate(rank_nodes):
        nxt = on[order[(order.index(n) + 1) % len(order)]]
        out.append(nxt[on[n].index(r) % len(nxt)])
    return out


class MemoryTier:
    def __init__(self, every: int):
        self.every = every
        self.generation = 0  # one per build of the ranks' parts: snapshots of a mesh apart
        self.snapshots: dict[str, dict[str, Any]] = {}  # directory → step, files, rng, losses, mesh

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def snapshot(self, group, step: int, rank_nodes: list[str], losses: list[float],
                 mesh: dict) -> dict[str, float]:
        """Every rank snapshots; returns the metrics (seconds blocked: the slowest rank's)."""
        directory = f"{self.generation:04d}-{step:08d}"
        got = group.memory_snapshot(directory, buddies(rank_nodes))
        if all(r["bytes"] > 0 for r in got):  # a rank that skipped it (its last one still
            # being saved) leaves it incomplete: not recorded, and it evicts no older record
            self.snapshots[directory] = {"step": step, "ranks": len(got),
                                         "rng": job_states([r["rng"] for r in got]),
                                         "losses": list(losses[:step]), "mesh": mesh}
            for old in sorted(self.snapshots)[:-2]:  # the ranks keep the newest two as well
                del self.snapshots[old]
        return {"snapshot_blocked_s": max(r["blocked_s"] for r in got),
                "snapshot_bytes": float(sum(r["bytes"] for r in got))}

    def newest_complete(self, group, at_least: int) -> tuple[str, dict, dict[str, int]] | None:
        """The newest snapshot of step ≥ ``at_least`` of which some rank of ``group`` holds
        every rank's files — a rank's metadata (``__R.metadata``) is held only with its data
        (``memory_fs.commit``, ``put``): (directory, its record, file → the rank to read it
        from)."""
        if not self.snapshots:
            return None
        inventory = group.memory_inventory()
        for directory in sorted(self.snapshots, key=lambda d: self.snapshots[d]["step"], reverse=True):
            meta = self.snapshots[directory]
            if meta["step"] < at_least:
                break
            holders: dict[str, int] = {}
            for rank, held in enumerate(inventory):
                for name in held.get(directory, []):
                    holders.setdefault(name, rank)
            if {f"__{r}.metadata" for r in range(meta["ranks"])} <= set(holders):
                return directory, meta, holders
        return None


def restore_newest(group, ckpts, memory: MemoryTier, tracker,
                   start: bool = False) -> tuple[int, list, list, str] | None:
    """Restore the newest state there is: a complete in-memory snapshot at least as new as the
    newest storage checkpoint, else that checkpoint (verified on the ranks). Returns (step,
    losses, recoveries recorded with it, "memory" | "storage"), or None: start from scratch.
    ``start``: the job's start, where ``checkpoint.resume: never`` restores nothing (a
    recovery always restores the run's own newest state)."""
    complete = [] if start and ckpts.cfg.resume != "auto" else ckpts.store.verified_steps()
    found = memory.newest_complete(group, complete[-1] if complete else 0)
    if found is not None:
        directory, meta, holders = found
        group.memory_load(directory, holders, meta["step"], meta["rng"])
        ckpts.steps = complete
        tracker.event("resume", step=meta["step"], path=f"memory:{directory}", source="memory",
                      from_mesh=meta["mesh"])
        return meta["step"], meta["losses"], [], "memory"
    resume = ckpts.latest(group, start)
    if resume is None:
        return None
    directory, meta = resume
    uri, rng = ckpts.restored(directory)
    step = int(meta["step"])
    group.load(uri, step, rng)
    tracker.event("resume", step=step, path=uri, from_mesh=meta.get("mesh"), source="storage")
    return step, list(meta.get("losses", [])), list(meta.get("recoveries", [])), "storage"
