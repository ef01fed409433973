"""What a rank is doing, readable from another thread while it does it.

A rank bumps a counter per phase (forward and backward per microbatch or pipeline action, the
optimizer step, a checkpoint save, a background save's write, a restore, a warm re-form, an
in-memory snapshot); the controller reads them through the rank's control path
(``RankWorker.progress``) while a step runs, to tell a rank that stopped (hung) from ranks
waiting for it. Tools beside a rank (a tracer; the test suite's fault injection,
``trainmesh/testing/faults.py``) hear each phase as it begins through ``listeners``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

PHASES = ("forward", "backward", "optimizer", "save", "write", "restore", "reform", "snapshot")
SILENCE_S = 5.0  # how long a question to a rank may go unanswered before it counts as frozen


def silence_after_s(hang_after_s: float, poll_s: float = 1.0, silent_only: bool = False) -> float:
    """How long a rank may leave a progress question unanswered before it counts as frozen
    (questions start that long before the hang bound, verdicts at it): in a step, a few
    seconds (SILENCE_S; half the bound when that is shorter), at least two polls. In a call
    whose progress is not counted (a build, a restore, a save: one long phase, where a live
    rank's control thread may wait longer on the interpreter) half the bound, at least two
    polls."""
    if silent_only:
        return max(2 * poll_s, hang_after_s / 2)
    return max(2 * poll_s, min(SILENCE_S, hang_after_s / 2))


class Progress:
    def __init__(self, rank: int):
        self.rank = rank  # a warm re-form may change it
        self.counts = dict.fromkeys(PHASES, 0)  # since the step began (comparable across ranks)
        self.phase, self._step, self.since = "idle", 0, time.monotonic()
        # each called as listener(self, phase) when a phase begins, after it is counted
        self.listeners: list[Callable[[Progress, str], None]] = []

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        if value != self._step:
            self.counts = dict.fromkeys(PHASES, 0)
        self._step = value

    def mark(self, phase: str) -> None:
        self.counts[phase] += 1
        self.phase, self.since = phase, time.monotonic()
        for listener in self.listeners:
            listener(self, phase)

    def snapshot(self) -> dict:
        return {"step": self.step, "phase": self.phase, "counts": dict(self.counts),
                "idle_s": round(time.monotonic() - self.since, 3)}
