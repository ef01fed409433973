"""The controller's states, the events that move it, and the pure decision after a stop
(the shape of Ray Train v2's controller: each state a small class holding what it needs,
policies that return decisions; no Ray, no torch here).

    SCHEDULING ──placed──▶ RESTORING ──restored──▶ RUNNING ──done──▶ FINISHED
        ▲ cold                ▲ warm                  │ stop: a failure, a preemption
        │                     │                       │ notice, a scale-up
        ├─────────────── REFORMING ◀──survivors──┐    ▼
        └──────────────────────────no survivors──RECOVERING ──give up──▶ ERRORED

A failure while scheduling, re-forming or restoring, or before the first step after a recovery,
goes back to RECOVERING as part of the same recovery (``Stop.then``): it is timed from the first
stop, and the survivors of both are kept when they can be. A re-form that cannot keep anyone, or
that breaks other than by a rank's death (survivors that do not answer), falls back to
SCHEDULING (cold).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from trainmesh.controller.elastic import GiveUp, Retry, on_failure, on_preemption
from trainmesh.spec.job import ElasticConfig

FAILURE, PREEMPTION, SCALE_UP = "failure", "preemption", "scale-up"


@dataclass(frozen=True)
class Stop:
    """An event that stops RUNNING (or interrupts a recovery)."""

    kind: str  # FAILURE | PREEMPTION | SCALE_UP
    cause: str  # the exception's type name, or the kind
    step: int  # steps done when it came
    mesh: dict  # the mesh it came on
    at: float  # time.monotonic() when the controller learned of it
    detail: str = ""  # the error's text, or the notice
    ranks: tuple[int, ...] = ()  # a preemption's notified ranks

    def then(self, later: Stop) -> Stop:
        """``later`` came before the recovery from this stop was done: one recovery, timed
        from this stop; a failure in either spends restart budget."""
        kind = FAILURE if FAILURE in (self.kind, later.kind) else self.kind
        return dataclasses.replace(self, kind=kind, cause=f"{self.cause}, then {later.cause}",
                                   detail=later.detail, ranks=self.ranks + later.ranks)


@dataclass(frozen=True)
class Scheduling:
    """Cold: plan (re-plan after a stop) and place a new group of rank actors."""

    stop: Stop | None = None
    name: ClassVar[str] = "scheduling"


@dataclass(frozen=True)
class Reforming:
    """Warm: the surviving actors (``alive``: their old ranks) take the new plan's ranks in the
    same processes; new actors start only for accelerators no survivor holds."""

    stop: Stop
    alive: frozenset[int]
    refill: frozenset[int] = frozenset()  # old ranks whose places new actors may take
    name: ClassVar[str] = "re-forming"


@dataclass(frozen=True)
class Restoring:
    """Build every rank's part for the plan and load the newest complete checkpoint."""

    stop: Stop | None
    mode: str  # "cold" | "warm": how the group came to be
    name: ClassVar[str] = "restoring"


@dataclass(frozen=True)
class Running:
    """Train from ``start`` until the end or a stop; a recovery is complete (and recorded) once
    its first step is done."""

    start: int
    stop: Stop | None
    mode: str
    name: ClassVar[str] = "training"


@dataclass(frozen=True)
class Recovering:
    """Learn who survived ``stop`` and decide (``decide``)."""

    stop: Stop
    name: ClassVar[str] = "recovering"


@dataclass(frozen=True)
class Finished:
    name: ClassVar[str] = "finished"


@dataclass(frozen=True)
class Errored:
    report: str
    name: ClassVar[str] = "errored"


State = Scheduling | Reforming | Restoring | Running | Recovering | Finished | Errored


@dataclass(frozen=True)
class Decision:
    """What to do after a stop: the next state, after waiting ``backoff_s``; a retried failure
    spends one restart."""

    next: State
    backoff_s: float = 0.0
    spends_restart: bool = False


def decide(stop: Stop, cfg: ElasticConfig, restarts: int, available: int,
           alive: frozenset[int], refill: frozenset[int] = frozenset(),
           in_a_row: int | None = None) -> Decision:
    """After ``stop``, with ``restarts`` spent (``in_a_row`` of them since a step last
    completed), ``available`` accelerators usable, the old ranks ``alive`` and those whose
    places can be refilled (``refill``): give up (the report names the knob), or go on warm
    with the survivors (``elastic.warm_recovery``) or cold. Preemption and scale-up never spend
    restart budget."""
    if stop.kind == FAILURE:
        verdict = on_failure(cfg, restarts, available, [stop.detail], in_a_row)
    elif stop.kind == PREEMPTION:
        verdict = on_preemption(cfg, available, stop.detail)
    else:
        verdict = Retry(backoff_s=0.0)
    if isinstance(verdict, GiveUp):
        return Decision(Errored(verdict.report))
    spends = stop.kind == FAILURE
    if cfg.warm_recovery and alive:
        return Decision(Reforming(stop, alive, refill), verdict.backoff_s, spends)
    return Decision(Scheduling(stop), verdict.backoff_s, spends)
