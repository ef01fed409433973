"""The bookkeeping of recoveries, in one record: the restart budget spent, the nodes known dead,
the recovery still open (from its stop until its first completed step) with the wall times of
its phases, and the recoveries completed. The controller's states carry what one transition
needs; this record carries what lives across them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from trainmesh.controller.elastic import Recovery, recovery_phases
from trainmesh.controller.states import Decision, Stop


@dataclass
class RecoveryBook:
    restarts: int = 0  # failures retried, in all
    in_a_row: int = 0  # of them since a step last completed (the backoff doubles with each)
    dead_nodes: set[str] = field(default_factory=set)
    open: Stop | None = None  # the stop being recovered from, until the first step after it
    marks: dict[str, float] = field(default_factory=dict)  # wall times of the open one's phases
    restored_from: str = "none"  # where the last restore read from: memory | storage | none
    done: list[dict[str, Any]] = field(default_factory=list)  # as in summary.json's recoveries
    processes: dict[str, list[int]] = field(default_factory=dict)  # new ranks: ready | started
    cpu_at_failure: float = 0.0  # the controller thread's CPU clock when the open one began

    def joined(self, stop: Stop) -> Stop:
        """``stop`` as part of the recovery still open, if there is one (one recovery, timed
        from its first stop)."""
        return self.open.then(stop) if self.open else stop

    def begin(self, stop: Stop) -> None:
        """A recovery from ``stop`` (``joined`` already) starts, or goes on: a failure while
        recovering interrupts the attempt so far (its time is ``interrupted_s``), and the new
        attempt's phases are timed from that moment."""
        if self.open is None:
            self.marks = {"failed": time.time()}
            self.processes = {}
            self.cpu_at_failure = time.thread_time()
        else:
            self._interrupted()
        self.open = stop

    def interrupt(self) -> None:
        """The attempt so far broke without a new failure (a warm re-form that could not
        finish: the job restarts cold): its time joins ``interrupted_s`` and the next attempt
        decides from now, with nothing left to abort or check."""
        self._interrupted("aborted", "released", "checked")

    def _interrupted(self, *also: str) -> None:
        """Marks restart: the first failure kept, the interruption (and ``also``) now."""
        now = time.time()
        self.marks = {"failed": self.marks["failed"], **dict.fromkeys(("interrupted", *also), now)}

    def mark(self, phase: str) -> None:
        """The wall time ``phase`` ended (``planned``, ``group``, ``built``, ``restored``)."""
        self.marks[phase] = time.time()

    def spend(self, decision: Decision) -> None:
        self.restarts += decision.spends_restart
        self.in_a_row += decision.spends_restart

    def complete(self, stop: Stop, start: int, new_mesh: dict, mode: str) -> Recovery:
        """The first step after ``stop`` is done: the recovery, recorded and returned."""
        marks = {**self.marks, "first_step": time.time()}
        rec = Recovery(step=start, cause=stop.cause, old_mesh=stop.mesh, new_mesh=new_mesh,
                       downtime_s=time.monotonic() - stop.at, steps_lost=max(0, stop.step - start),
                       mode=mode, restored_from=self.restored_from,
                       failed_at=marks.get("failed", 0.0), phases=recovery_phases(marks),
                       processes=self.processes,
                       controller_cpu_s=time.thread_time() - self.cpu_at_failure)
        self.open, self.in_a_row = None, 0
        self.done.append(rec.as_dict())
        return rec
