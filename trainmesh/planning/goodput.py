"""Goodput by simulation: a training run on a cluster whose nodes fail, replayed as discrete
events for several recovery strategies facing the same faults.

Time is split, second by second of the wall clock, into what it went to: ``useful`` (the steps
kept, valued at the first mesh's step time), ``degraded`` (the extra time those steps took on a
smaller mesh), ``checkpoint`` (training blocked by saves), ``lost_work`` (steps computed and
then rolled back), ``detection``, ``recovery`` (re-plan, re-form, restore, first step),
``waiting`` (no mesh fits the nodes alive: waiting for replacements) and ``resize`` (growing
back onto returned nodes at a checkpoint). Goodput = useful / wall. Pure Python; the meshes
and their costs come in through ``plan`` (alive nodes → ``MeshCosts`` or None).

Strategies:
- ``trainmesh warm``: re-plan onto the nodes alive (the surviving rank processes are kept,
  new ones started only on nodes new to the mesh), restore the newest durable checkpoint; when
  replaced nodes return, checkpoint after the step in flight and grow back onto them;
- ``trainmesh cold``: the same, every rank process restarted;
- ``restart``: restart-from-checkpoint as Ray Train v2 and TorchTitan do it: the same world
  size again (a spare node if there is one, else wait for the replacement), every worker anew.

Faults are node-level: each node fails as a Poisson process (``mtbf_node_hours``); a failed
node rejoins ``replace_s`` later; a fault on a node the mesh does not use (a spare, an idle
node) costs nothing but the node. A trace may also hold a rank process lost on a healthy node
(``process``: the node stays) and a preemption notice (``notice``: a checkpoint, then the node
leaves). A hang is found by trainmesh's watcher after ``hang_s``, by restart-from-checkpoint
only at the collective timeout.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trainmesh.planning.failure_costs import ASSUMED, MEASURED, Assumptions, Measured, MeshCosts, detect_s

CAUSES = ("useful", "degraded", "checkpoint", "lost_work", "detection", "recovery", "waiting",
          "resize")
STRATEGIES = ("trainmesh warm", "trainmesh cold", "restart")
KEPT = ("detection", "useful", "degraded", "checkpoint")  # what a recovery waits behind
# crash, unreachable, hang: the node is lost (it rejoins ``replace_s`` later); process: one
# rank's process ends, its node is fine; notice: a preemption notice, the node leaves after a
# checkpoint (nothing is lost) and rejoins ``replace_s`` later
KINDS = ("crash", "unreachable", "hang", "process", "notice")


@dataclass(frozen=True)
class Fault:
    t: float  # seconds from the start
    node: int | None  # None: a node of the mesh (a trace of the job's own interruptions)
    kind: str = "crash"


@dataclass(frozen=True)
class Cluster:
    nodes: int  # nodes the job is planned on at the start
    spare_nodes: int = 0  # more nodes, idle until a failure needs them
    mtbf_node_hours: float = 6300.0
    replace_s: float = 1800.0

    @property
    def total(self) -> int:
        return self.nodes + self.spare_nodes


def poisson_faults(cluster: Cluster, horizon_s: float, seed: int,
                   a: Assumptions = ASSUMED) -> list[Fault]:
    """Faults of every node of the cluster over ``horizon_s``, as independent Poisson processes
    (drawn at the whole cluster's rate; one that lands on a node already down is dropped by
    the simulation, which is exact for a node that cannot fail while it is being replaced)."""
    rng = random.Random(seed)
    rate = cluster.total / (cluster.mtbf_node_hours * 3600)
    shares = (a.crash_share, a.unreachable_share, a.hang_share)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= horizon_s:
            return out
        out.append(Fault(t, rng.randrange(cluster.total), rng.choices(KINDS[:3], shares)[0]))


@dataclass
class Outcome:
    strategy: str
    wall_s: float
    steps: float
    tokens: float
    seconds: dict[str, float]
    faults: int  # faults that hit the mesh (interruptions)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (time, ranks training)
    # (time, seconds of the wall clock lost so far): wall time less the useful work kept, so a
    # rollback shows as a jump; piecewise linear between the points
    lost: list[tuple[float, float]] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.seconds["useful"] / self.wall_s

    def as_dict(self) -> dict:
        return {"strategy": self.strategy, "goodput": round(self.goodput, 5),
                "wall_s": self.wall_s,
                "tokens": self.tokens, "steps": round(self.steps, 2),
                "interruptions": self.faults,
                "hours_lost": {k: round(v / 3600, 3) + 0.0 for k, v in self.seconds.items()
                               if k != "useful"},
                "timeline": [(round(t, 1), w) for t, w in self.timeline],
                "lost_hours": [(round(t / 3600, 3), round(x / 3600, 4)) for t, x in self.lost]}


@dataclass
class _Run:
    """The simulation's state for one strategy."""

    strategy: str
    cluster: Cluster
    plan: Callable[[int], MeshCosts | None]
    every: Callable[[MeshCosts], int]
    timeout_s: float
    m: Measured
    a: Assumptions
    hang_s: float | None = None  # trainmesh's hang bound (None: the collective timeout)
    t: float = 0.0
    steps: float = 0.0
    durable: int = 0
    pending: list[tuple[int, float]] = field(default_factory=list)  # (step, durable at)
    busy: list[tuple[str, float]] = field(default_factory=list)  # (cause, until), in order
    waiting: bool = False
    grow: bool = False
    hits: int = 0

    def __post_init__(self) -> None:
        self.full = self.plan(self.cluster.nodes)
        if self.full is None:
            raise ValueError(f"no mesh fits {self.cluster.nodes} nodes")
        self.mesh: MeshCosts = self.full
        self.alive = set(range(self.cluster.total))
        self.used = set(range(self.full.nodes))
        self.back: dict[int, float] = {}  # node → when it rejoins
        self.sec = dict.fromkeys(CAUSES, 0.0)
        self.timeline = [(0.0, self.full.world)]
        self.k = self.every(self.mesh)

    # -- time ------------------------------------------------------------------------------
    def advance(self, until: float) -> None:
        dt = until - self.t
        if dt <= 0:
            return
        if self.busy:
            self.sec[self.busy[0][0]] += dt
        elif self.waiting:
            self.sec["waiting"] += dt
        else:
            self.steps += dt / self.mesh.step_s
            useful = dt * self.full.step_s / self.mesh.step_s
            self.sec["useful"] += useful
            self.sec["degraded"] += dt - useful
        self.t = until
        while self.pending and self.pending[0][1] <= self.t:
            self.durable = max(self.durable, self.pending.pop(0)[0])

    def next_own_event(self) -> float:
        if self.busy:
            return self.busy[0][1]
        if self.waiting:
            return math.inf
        nxt = (math.floor(self.steps / self.k + 1e-9) + 1) * self.k if self.k else math.inf
        if self.grow:  # nodes came back: checkpoint after the step in flight, then grow
            nxt = math.floor(self.steps + 1e-9) + 1
        return self.t + (nxt - self.steps) * self.mesh.step_s

    # -- events ----------------------------------------------------------------------------
    def own_event(self) -> None:
        if self.busy:
            cause, _ = self.busy.pop(0)
            if not self.busy and cause in ("recovery", "resize"):
                self._mesh_up()
            elif not self.busy and cause == "checkpoint":
                self._maybe_grow()
            return
        self.steps = round(self.steps)
        mc = self.mesh
        blocked, durable = (mc.save_write_s,) * 2 if self.grow else (mc.save_blocked_s, mc.save_durable_s)
        self.pending.append((int(self.steps), self.t + durable))
        self.busy.append(("checkpoint", self.t + blocked))

    def fault(self, f: Fault) -> None:
        if f.node is None and self.waiting:  # the job's own interruption: nothing runs
            return
        node = f.node if f.node is not None else min(self.used & self.alive, default=None)
        if node not in self.alive:
            return
        if f.kind != "process":  # the node is gone until it rejoins
            self.alive.discard(node)
            self.back[node] = self.t + self.cluster.replace_s
        if node not in self.used or self.waiting:
            return  # a spare or idle node, or nothing running: nothing stops
        self.hits += 1
        self.timeline.append((self.t, 0))
        if f.kind == "notice" and self.strategy != "restart":  # the step in flight, then a
            # checkpoint: nothing is lost (restart-from-checkpoint takes it as a crash)
            frac = math.ceil(self.steps - 1e-9) - self.steps
            useful = frac * min(self.full.step_s, self.mesh.step_s)
            end = self.t + frac * self.mesh.step_s
            self.steps += frac
            self.busy = [("useful", self.t + useful), ("degraded", end),
                         ("checkpoint", end + self.mesh.save_write_s)]
            self.pending = [p for p in self.pending if p[1] <= self.t]
            self.pending.append((int(round(self.steps)), self.busy[-1][1]))
            self._recover(after=self.busy[-1][1])
            return
        self._rollback()
        timeout = self.hang_s if self.hang_s is not None and self.strategy != "restart" \
            else self.timeout_s
        self.busy = [("detection", self.t + detect_s(f.kind, timeout, self.a, self.m))]
        self._recover(after=self.busy[0][1])

    def rejoin(self, node: int) -> None:
        self.alive.add(node)
        del self.back[node]
        if self.waiting:
            self._recover(after=self.t)
        elif self._bigger() is not None:
            self.grow = True  # checkpoint (synchronously) after the step in flight and grow

    # -- strategies ------------------------------------------------------------------------
    def _rollback(self) -> None:
        self.pending = [(s, d) for s, d in self.pending if d <= self.t]
        lost = self.steps - self.durable  # 0 while recovering or waiting: rolled back already
        if lost > 0:
            per = self.mesh.step_s
            self.sec["useful"] -= lost * self.full.step_s
            self.sec["degraded"] -= lost * (per - self.full.step_s)
            self.sec["lost_work"] += lost * per
        self.steps = float(self.durable)

    def _recover(self, after: float) -> None:
        """Decide the next mesh; the recovery runs from ``after`` (detection done)."""
        self.waiting = False
        survivors = self.used & self.alive
        if self.strategy == "restart":
            new = self.full if len(self.alive) >= self.full.nodes else None
        else:
            new = self.plan(min(len(self.alive), self.full.nodes))
        if new is None:
            self.waiting, self.busy = True, [b for b in self.busy if b[0] in KEPT]
            return
        self._next = new
        fits = new.nodes <= len(survivors)  # warm; cold where the survivors cannot hold it
        if self.strategy == "restart":
            cost = new.restart_s + new.restore_bytes_s
        else:
            reform = new.warm_reform_s if self.strategy == "trainmesh warm" and fits \
                else new.cold_reform_s
            cost = self.m.decide_s + reform + new.restore_s + self.m.first_step_s
        self.busy = [b for b in self.busy if b[0] in KEPT] + [("recovery", after + cost)]

    def _bigger(self) -> MeshCosts | None:
        """The mesh a re-plan would grow to on the nodes alive now (trainmesh only)."""
        if self.strategy == "restart":
            return None
        new = self.plan(min(len(self.alive), self.full.nodes))
        return new if new is not None and new.world > self.mesh.world else None

    def _maybe_grow(self) -> None:
        new = self._bigger() if self.grow else None
        self.grow = False
        if new is None:
            return
        self._next = new
        durable_at = max((d for _, d in self.pending), default=self.t)
        cost = self.m.decide_s + new.cold_reform_s + new.restore_s + self.m.first_step_s
        self.busy = [("resize", durable_at + cost)]
        self.timeline.append((self.t, 0))

    def _mesh_up(self) -> None:
        new = self._next
        keep = sorted(self.used & self.alive)
        rest = sorted(self.alive - self.used)
        self.used = set((keep + rest)[: new.nodes])
        self.mesh, self.k = new, self.every(new)
        self.steps = float(self.durable)
        self.timeline.append((self.t, new.world))
        self.grow = self._bigger() is not None


def simulate(strategy: str, cluster: Cluster, faults: Sequence[Fault], horizon_s: float,
             plan: Callable[[int], MeshCosts | None], every: Callable[[MeshCosts], int],
             collective_timeout_s: float = 120.0, m: Measured = MEASURED,
             a: Assumptions = ASSUMED, hang_s: float | None = None) -> Outcome:
    """Replay ``faults`` (sorted by time) over ``horizon_s`` seconds for one strategy.
    ``every(mesh)``: steps between checkpoints on that mesh (0: never). ``hang_s``: how long
    trainmesh's watcher takes to call a hang (``elastic.hang_timeout_s``, else its default
    bound); None: the collective timeout, as restart-from-checkpoint."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    run = _Run(strategy, cluster, plan, every, collective_timeout_s, m, a, hang_s)
    lost = [(0.0, 0.0)]
    i = 0
    while run.t < horizon_s:
        t_fault = faults[i].t if i < len(faults) else math.inf
        t_back, node = min(((t, n) for n, t in run.back.items()), default=(math.inf, -1))
        t_own = run.next_own_event()
        t_next = min(t_fault, t_back, t_own, horizon_s)
        run.advance(t_next)
        lost.append((run.t, run.t - run.sec["useful"]))
        if t_next == horizon_s:
            break
        if t_next == t_back:
            run.rejoin(node)
        elif t_next == t_fault:
            run.fault(faults[i])
            i += 1
        else:
            run.own_event()
        lost.append((run.t, run.t - run.sec["useful"]))
    return Outcome(strategy, horizon_s, run.steps, run.steps * run.full.tokens_per_step,
                   run.sec, run.hits, run.timeline, _thin(lost))


def _thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Drop points that add nothing to the piecewise-linear curve (repeats and points on the
    line through their neighbours)."""
    out: list[tuple[float, float]] = []
    for p in points:
        if out and p == out[-1]:
            continue
        if len(out) >= 2:
            (t0, y0), (t1, y1) = out[-2], out[-1]
            if t1 > t0 and p[0] > t1 and abs((y1 - y0) / (t1 - t0) - (p[1] - y1) / (p[0] - t1)) < 1e-9:
                out[-1] = p
                continue
        out.append(p)
    return out
