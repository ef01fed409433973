"""How often to checkpoint: a fixed ``checkpoint.every`` or ``auto``, the Young/Daly optimum.

With checkpoint cost δ (training time a save blocks) and mean time between interruptions M
of the job (``elastic.mtbf_node_hours`` over the nodes it runs on), the compute time between
checkpoints that wastes least is Young's τ ≈ √(2δM); Daly's higher-order form (used here,
J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
FGCS 2006) corrects it for δ not small against M. A background save must also have finished
writing before the next one starts, so τ is never shorter than its write time. Pure: no
torch, no Ray; the controller feeds it measured step times and save costs.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from trainmesh.spec.job import CheckpointConfig, ElasticConfig

MEASURED_STEPS = 3  # steps measured before the first automatic choice
# A segment of steps: the most steps, and seconds, the ranks run between two boundaries
# without a call from the controller (``Controller._train``; the per-rank breakdown and the
# straggler are sampled at its end).
SEGMENT_STEPS, SEGMENT_S = 100, 30.0
# ... longer where the controller's time at a boundary (reading every rank's answer, starting
# the next segment on every rank: it grows with the ranks) would be more than this share of it
BOUNDARY_SHARE = 0.01
# ... and longer still, up to SEGMENT_BUDGET_S, until the boundary's controller CPU is at most
# this much a step: its cost a step flat in the ranks where steps are short
BOUNDARY_S_PER_STEP, SEGMENT_BUDGET_S = 0.25e-3, 120.0


def segment_caps(boundary_s: float, step_s: float) -> tuple[int, float]:
    """(steps, seconds) a segment of steps runs at most: SEGMENT_STEPS and SEGMENT_S, both
    stretched so that a boundary taking ``boundary_s`` of the controller (the ranks wait) is
    at most BOUNDARY_SHARE of the segment, with steps of ``step_s``; and stretched, as long
    as the segment stays within SEGMENT_BUDGET_S, until the boundary is at most
    BOUNDARY_S_PER_STEP a step (so its cost a step stays flat as the ranks grow)."""
    span_s = boundary_s / BOUNDARY_SHARE
    step_s = max(step_s, 1e-9)
    budget = math.ceil(boundary_s / BOUNDARY_S_PER_STEP)
    until_s = max(SEGMENT_S, span_s, min(budget * step_s, SEGMENT_BUDGET_S))
    budget = min(budget, math.floor(until_s / step_s))
    return max(SEGMENT_STEPS, math.ceil(span_s / step_s), budget), until_s


def system_mtbf_s(mtbf_node_hours: float, nodes: int) -> float:
    """Mean time between interruptions of a job on ``nodes`` nodes that fail independently."""
    return mtbf_node_hours * 3600.0 / max(1, nodes)


def daly_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """Daly's optimum compute time between checkpoints (Young's √(2δM) to first order)."""
    d, m = max(save_cost_s, 0.0), mtbf_s
    if d <= 0:
        return 0.0
    if d >= 2 * m:
        return m
    r = math.sqrt(d / (2 * m))
    return math.sqrt(2 * d * m) * (1 + r / 3 + r * r / 9) - d


@dataclass(frozen=True)
class CadenceChoice:
    every_steps: int
    interval_s: float  # compute time between checkpoints that every_steps amounts to
    save_cost_s: float
    write_s: float
    mtbf_s: float
    step_time_s: float
    reason: str

    def as_dict(self) -> dict:
        return {"every_steps": self.every_steps, "interval_s": round(self.interval_s, 3),
                "save_cost_s": round(self.save_cost_s, 4), "write_s": round(self.write_s, 4),
                "mtbf_hours": round(self.mtbf_s / 3600, 3),
                "step_time_s": round(self.step_time_s, 4), "reason": self.reason}


def choose(save_cost_s: float, write_s: float, step_time_s: float, mtbf_s: float,
           source: str) -> CadenceChoice:
    tau = max(daly_interval_s(save_cost_s, mtbf_s), write_s)
    steps = max(1, round(tau / step_time_s)) if step_time_s > 0 else 1
    why = (f"Young/Daly: save blocks {save_cost_s:.3g} s ({source}), the job's nodes fail every "
           f"{mtbf_s / 3600:.3g} h on average, a step takes {step_time_s:.3g} s: checkpoint every "
           f"{tau:.3g} s of training = {steps} step(s)")
    if write_s > daly_interval_s(save_cost_s, mtbf_s):
        why += f" (no sooner than a background write takes, {write_s:.3g} s)"
    return CadenceChoice(steps, steps * step_time_s, save_cost_s, write_s, mtbf_s, step_time_s, why)


class CheckpointCadence:
    """When the controller saves. Fixed: every ``checkpoint.every`` steps (0: only at the end).
    ``auto``: after ``MEASURED_STEPS`` steps on a mesh, from the median step time and the save
    cost (predicted until a save was measured, then measured), re-chosen after every save and
    whenever the mesh changes (``start``). Each choice goes to MLflow with its reason."""

    def __init__(self, cfg: CheckpointConfig, elastic: ElasticConfig):
        self.auto = cfg.every == "auto"
        self.fixed = 0 if self.auto else int(cfg.every)
        self.mtbf_node_hours = elastic.mtbf_node_hours
        self.choice: CadenceChoice | None = None
        self.choices: list[dict] = []  # every choice made, for the run summary
        self._steps: list[float] = []
        self._nodes = 1
        self._last_save = 0
        self._save: tuple[float, float, str] | None = None  # (blocked s, write s, source)
        self.background = cfg.async_save  # else a save's write is over when it unblocks

    def start(self, step: int, nodes: int, predicted: tuple[float, float]) -> None:
        """A (new) mesh on ``nodes`` nodes begins at ``step``: re-measure, then re-choose.
        ``predicted``: (blocked s, write s) of a save, used until one is measured."""
        self._nodes, self._last_save, self._steps, self.choice = nodes, step, [], None
        if self._save is None or self._save[2] == "predicted":
            blocked, write = predicted
            self._save = (blocked, write if self.background else 0.0, "predicted")

    def step_s(self) -> float | None:
        """The median of the recent step times (None before one)."""
        return statistics.median(self._steps) if self._steps else None

    def stepped(self, step: int, step_time_s: float, tracker) -> None:
        self._steps.append(step_time_s)
        del self._steps[:-20]
        if self.auto and self.choice is None and len(self._steps) >= MEASURED_STEPS:
            self._choose(step, tracker)

    def due(self, step: int) -> bool:
        if not self.auto:
            return bool(self.fixed) and step % self.fixed == 0
        return self.choice is not None and step - self._last_save >= self.choice.every_steps

    def next_boundary(self, step: int) -> int:
        """The first step after ``step`` at which ``due`` may hold: a save's, or (``auto``
        still measuring) the one whose time makes the choice."""
        if not self.auto:
            return step - step % self.fixed + self.fixed if self.fixed else 1 << 62
        if self.choice is None:
            return step + max(1, MEASURED_STEPS - len(self._steps))
        return max(step + 1, self._last_save + self.choice.every_steps)

    def saving(self, step: int) -> None:
        self._last_save = step

    def saved(self, step: int, blocked_s: float, write_s: float, tracker) -> None:
        """A save of ``step`` blocked training ``blocked_s`` and was written ``write_s`` after it
        began (0 for a synchronous save: written once it unblocked, so no floor on the next)."""
        if not self.auto:
            return
        self._save = (blocked_s, write_s, "measured")
        before = self.choice
        if self._steps:
            new = self._choose(step, tracker, quiet=True)
            if before is None or new.every_steps != before.every_steps:
                self._log(step, new, tracker)

    def _choose(self, step: int, tracker, quiet: bool = False) -> CadenceChoice:
        blocked, write, source = self._save or (0.0, 0.0, "predicted")
        self.choice = choose(blocked, write, statistics.median(self._steps),
                             system_mtbf_s(self.mtbf_node_hours, self._nodes), source)
        if not quiet:
            self._log(step, self.choice, tracker)
        return self.choice

    def _log(self, step: int, c: CadenceChoice, tracker) -> None:
        self.choices.append({"step": step, **c.as_dict()})
        tracker.event("checkpoint-cadence", step=step, **c.as_dict())
        tracker.log_metrics({"checkpoint_every_steps": c.every_steps}, step=step)
