"""Elastic policy: pure decisions about failures and resizes (no Ray, no torch).

The controller asks; the policy answers with small frozen decision objects. The unit of
sizing is a whole model replica (tp × pp): a re-plan keeps whole replicas and re-plans dp.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from trainmesh.planning.topology import Node, Topology
from trainmesh.spec.job import ElasticConfig


@dataclass(frozen=True)
class Recovery:
    """One recovery, as logged to MLflow and summary.json."""

    step: int  # the step training resumed from
    cause: str
    old_mesh: dict
    new_mesh: dict
    downtime_s: float
    steps_lost: int
    mode: str = "cold"  # warm: the surviving rank actors were kept; cold: every rank restarted
    restored_from: str = "storage"  # memory (peers' in-memory snapshots), storage, none (step 0)
    failed_at: float = 0.0  # wall time the controller saw the failure
    # seconds: decide (health check, backoff, re-plan), reform (process group: new actors and
    # placement when cold), restore (build model parts, load the checkpoint), first_step; and
    # decide's parts after a failure: interrupted (attempts another failure cut short, if one
    # did), abort (survivors leave their communicators), stuck (the grace for ranks no abort
    # frees), health (who answers), plan (backoff and re-plan)
    phases: dict = field(default_factory=dict)
    # the new ranks that took a ready process ("ready"; their pids "ready_pids") and those that
    # started one ("started")
    processes: dict = field(default_factory=dict)
    # the controller thread's CPU seconds from the failure to the first step (what the
    # orchestration costs the controller, apart from the ranks' time it waits for)
    controller_cpu_s: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def line(self) -> str:
        """The console's line for it: what stopped training (a failure, or a resize: a
        preemption notice, nodes joining), the mesh before and after, warm or cold, where the
        state came from, the steps lost and the time training stood still."""
        causes = self.cause.split(", then ")  # (a stop that came while recovering from another)
        resize = all(c in ("preemption", "scale-up") for c in causes)
        what = {"preemption": "resized after a preemption notice",
                "scale-up": "resized onto the nodes that joined",
                "RayActorError": "recovered from a lost rank (its process or node gone)",
                "RayTaskError": "recovered from a rank's error",
                "GetTimeoutError": "recovered from a rank past its deadline",
                "HangDetected": "recovered from a hung rank",
                "PlacementTimeout": "recovered from a placement that timed out",
                }.get(self.cause, f"{'resized' if resize else 'recovered'} ({self.cause})")
        source = {"memory": "peers' in-memory snapshots", "storage": "its checkpoint in storage",
                  "none": "its initialisation"}.get(self.restored_from, self.restored_from)
        lost = "" if resize else f", {self.steps_lost} step(s) lost"
        return (f"{what}: {mesh_text(self.old_mesh)} → {mesh_text(self.new_mesh)}, {self.mode}, "
                f"step {self.step} restored from {source}{lost}, {self.downtime_s:.1f} s without "
                "training")


def mesh_text(mesh: dict) -> str:
    """A mesh as ``tp2·pp2·dp2·ep2 (8 ranks)``: its degrees above 1 (dp always)."""
    axes = [f"{k}{mesh[k]}" for k in ("tp", "pp", "dp", "cp", "ep") if mesh.get(k, 1) > 1 or k == "dp"]
    return f"{'·'.join(axes)} ({mesh.get('world_size', '?')} ranks)"


def recovery_phases(marks: dict[str, float]) -> dict[str, float]:
    """Seconds per recovery phase from the wall times marked on the way (``failed``,
    ``planned``, ``group``, ``restored``, ``first_step``; within deciding, after a failure,
    ``aborted``, ``released`` and ``checked``; within restoring ``built``; ``interrupted``:
    the last failure that struck while recovering), where both ends were marked. Deciding's
    parts (``interrupted_s``, ``abort_s``, ``stuck_s``, ``health_s``, ``plan_s``) add up to
    ``decide_s``, restoring's (``build_s``: the ranks' model parts; ``load_s``: finding and
    reading the newest state) to ``restore_s``."""
    phases = {}
    # a recovery interrupted by another failure: the attempts before it, then the last one's
    start = "interrupted" if "interrupted" in marks else "failed"
    for name, a, b in (("decide_s", "failed", "planned"), ("reform_s", "planned", "group"),
                       ("restore_s", "group", "restored"),
                       ("first_step_s", "restored", "first_step"),
                       ("interrupted_s", "failed", "interrupted"),
                       ("abort_s", start, "aborted"), ("stuck_s", "aborted", "released"),
                       ("health_s", "released", "checked"), ("plan_s", "checked", "planned"),
                       ("build_s", "group", "built"), ("load_s", "built", "restored")):
        if a in marks and b in marks:
            phases[name] = round(marks[b] - marks[a], 3)
    return phases


@dataclass(frozen=True)
class Retry:
    backoff_s: float


@dataclass(frozen=True)
class GiveUp:
    report: str


class JobFailed(RuntimeError):
    """The job cannot continue; the message says why and which knob to change."""


def on_failure(cfg: ElasticConfig, restarts_done: int, available: int,
               errors: list[str], in_a_row: int | None = None) -> Retry | GiveUp:
    """Retry while restarts and accelerators allow — at once after a first failure, then with
    a backoff doubling for every failure ``in_a_row`` (failures with no step completed between
    them; by default all of them) — else a report that groups identical rank errors and names
    the knob to change."""
    if restarts_done >= cfg.max_restarts:
        return GiveUp(failure_report(errors, f"gave up after {restarts_done} restarts; raise "
                                             "elastic.max_restarts to keep trying"))
    if available < cfg.min_world_size:
        return GiveUp(failure_report(
            errors, f"only {available} accelerators are left, below elastic.min_world_size="
                    f"{cfg.min_world_size}; lower elastic.min_world_size or add nodes"))
    k = restarts_done if in_a_row is None else in_a_row
    return Retry(backoff_s=0.0 if k == 0 else min(30.0, 0.5 * 2 ** (k - 1)))


def on_preemption(cfg: ElasticConfig, available: int, notice: str) -> Retry | GiveUp:
    """A node that gives notice is not a failure: no restart budget is spent (even at
    ``max_restarts: 0``) and there is no backoff; only too few accelerators end the job."""
    if available < cfg.min_world_size:
        return GiveUp(failure_report(
            [notice], f"only {available} accelerators are left after the preemption, below "
                      f"elastic.min_world_size={cfg.min_world_size}; lower "
                      "elastic.min_world_size or add nodes"))
    return Retry(backoff_s=0.0)


def failure_report(errors: list[str], verdict: str) -> str:
    counts = Counter(e.strip().splitlines()[-1][:300] if e.strip() else "unknown error"
                     for e in errors)
    lines = [verdict] + [f"  {n} rank(s): {msg}" for msg, n in counts.most_common()]
    return "\n".join(lines)


def bounded_topology(topo: Topology, cfg: ElasticConfig, dead_nodes: set[str]) -> Topology:
    """The alive nodes, capped at ``elastic.max_world_size`` accelerators."""
    nodes, total = [], 0
    cap = cfg.max_world_size or 10**9
    for n in topo.nodes:
        if n.node_id in dead_nodes or total >= cap:
            continue
        take = min(n.accelerators, cap - total)
        nodes.append(Node(n.node_id, take))
        total += take
    return dataclasses.replace(topo, nodes=tuple(nodes))


def warm_assignment(rank_bundle: tuple[int, ...], rank_nodes: list[str], alive: set[int],
                    refill: set[int] = frozenset()) -> list[int | None] | None:
    """Which old ranks' places the new ranks 0..n-1 take: ``result[r]`` is the old rank whose
    actor becomes new rank r (a survivor in ``alive``), or whose reservation a new actor fills
    (a rank in ``refill``: dead, or killed for being stuck, on a node that is fine); None where a
    new actor needs a new reservation (a bundle no surviving node can hold: new accelerators).
    None when no survivor is kept at all (restart cold).

    ``rank_bundle[r]`` is the bundle (one node) of new rank r; ``rank_nodes[o]`` the node of
    old rank o. Each bundle takes one node whose survivors (then refillable places) are enough,
    so a bundle's ranks (a TP group, a pipeline stage) share a node as they did before."""
    need: dict[int, int] = Counter(rank_bundle)
    by_node: dict[str, list[int]] = {}
    for old in [*sorted(alive), *sorted(set(refill) - set(alive))]:  # survivors first
        by_node.setdefault(rank_nodes[old], []).append(old)
    live = Counter(rank_nodes[o] for o in alive)
    free = sorted(by_node, key=lambda n: (-live[n], -len(by_node[n]), min(by_node[n])))
    chosen: dict[int, list[int]] = {}
    for bundle in sorted(need, key=lambda b: -need[b]):
        node = next((n for n in free if len(by_node[n]) >= need[bundle] and live[n]), None)
        if node is not None:
            free.remove(node)
            chosen[bundle] = by_node[node][: need[bundle]]
    if not chosen:
        return None
    taken = {b: iter(v) for b, v in chosen.items()}
    return [next(taken[b]) if b in taken else None for b in rank_bundle]


def should_scale_up(current_world: int, planned_world: int, cfg: ElasticConfig) -> bool:
    """At a checkpoint boundary: grow when a re-plan on the accelerators available now would
    use more of them than are in use (spares it would leave idle do not count)."""
    cap = cfg.max_world_size or 10**9
    return min(planned_world, cap) > current_world


def ready_nodes(alive: list[Node], ranks_on: list[str], holding: set[str]) -> list[str]:
    """Where a job keeps ready rank processes: every node its ranks are on (``ranks_on``: each
    rank's node), and as many spare nodes (alive, none of its ranks) as it takes to hold the
    ranks of one of its nodes again, what replacing a lost node needs. Spares already
    ``holding`` some come first (a fill does not move them), then the largest. More would hold
    host memory on idle nodes, which other jobs may take, for losses that seldom come
    together; a recovery that used them fills again."""
    own = list(dict.fromkeys(ranks_on))
    need = max(Counter(ranks_on).values(), default=0)
    spares = sorted((n for n in alive if n.node_id not in own),
                    key=lambda n: (n.node_id not in holding, -n.accelerators))
    chosen = []
    for n in spares:
        if need <= 0:
            break
        chosen.append(n.node_id)
        need -= max(1, n.accelerators)
    return own + chosen
