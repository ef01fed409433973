"""Play every rank's action list together: detect deadlocks and unmet dependencies, and
predict step time, bubble and peak in-flight activations.

Semantics are the executor's: a send never blocks (it is posted and waited for at the end of
the step), a receive blocks until its matching send was posted (+ latency), a compute action
waits for its inputs. Costs are per stage action (one chunk of one rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainmesh.parallel.pipeline.ir import COMPUTE, Action, Op, Schedule


class ScheduleError(RuntimeError):
    """A deadlock or an unmet dependency, with the actions involved."""


@dataclass(frozen=True)
class Costs:
    forward: float = 1.0
    backward: float = 2.0
    send_latency: float = 0.0


@dataclass
class SimResult:
    step_time: float
    bubble_fraction: float
    peak_in_flight: list[int]  # per rank: most microbatch-chunks of activations held at once
    timeline: list[list[tuple[Action, float, float]]] = field(repr=False)


def simulate(schedule: Schedule, num_stages: int, microbatches: int,
             costs: Costs = Costs()) -> SimResult:
    pp = len(schedule)
    clock = [0.0] * pp
    pos = [0] * pp
    done: dict[tuple[Op, int, int], float] = {}  # (op, stage, mb) → completion time
    sent: dict[tuple[Op, int, int], float] = {}
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    live = [0] * pp
    peak = [0] * pp
    while any(pos[r] < len(schedule[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(schedule[r]):
                a = schedule[r][pos[r]]
                ready = _ready_time(a, r, done, sent, num_stages, costs)
                if ready is None:
                    break
                start = max(clock[r], ready)
                end = start + {Op.FORWARD: costs.forward, Op.BACKWARD: costs.backward,
                               Op.WEIGHT: 0.0}.get(a.op, 0.0)
                clock[r] = end
                done[(a.op, a.stage, a.microbatch)] = end
                if a.op in (Op.SEND_FORWARD, Op.SEND_BACKWARD):
                    sent[(a.op, a.stage, a.microbatch)] = end
                if a.op is Op.FORWARD:
                    live[r] += 1
                    peak[r] = max(peak[r], live[r])
                elif a.op is Op.BACKWARD:
                    live[r] -= 1
                timeline[r].append((a, start, end))
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = [f"rank {r}: {schedule[r][pos[r]]} ({schedule[r][pos[r]].op.name})"
                     for r in range(pp) if pos[r] < len(schedule[r])]
            raise ScheduleError("deadlock: every rank waits; next actions: " + "; ".join(stuck))
    _check_complete(done, num_stages, microbatches)
    makespan = max(clock)
    busy = sum(e - s for row in timeline for a, s, e in row if a.op in COMPUTE)
    bubble = 1.0 - busy / (pp * makespan) if makespan > 0 else 0.0
    return SimResult(makespan, bubble, peak, timeline)


def _ready_time(a: Action, rank: int, done, sent, num_stages: int, costs: Costs) -> float | None:
    """When ``a``'s inputs are available on ``rank``, or None if not yet."""
    s, m = a.stage, a.microbatch
    if a.op is Op.RECV_FORWARD:
        t = sent.get((Op.SEND_FORWARD, s - 1, m))
        return None if t is None else t + costs.send_latency
    if a.op is Op.RECV_BACKWARD:
        t = sent.get((Op.SEND_BACKWARD, s + 1, m))
        return None if t is None else t + costs.send_latency
    if a.op is Op.SEND_FORWARD:
        return done.get((Op.FORWARD, s, m))
    if a.op is Op.SEND_BACKWARD:
        return done.get((Op.BACKWARD, s, m))
    if a.op is Op.FORWARD:
        if s == 0:
            return 0.0
        return done.get((Op.RECV_FORWARD, s, m), done.get((Op.FORWARD, s - 1, m)))
    if a.op is Op.BACKWARD:
        own = done.get((Op.FORWARD, s, m))
        if own is None:
            return None
        if s == num_stages - 1:
            return own
        grad = done.get((Op.RECV_BACKWARD, s, m), done.get((Op.BACKWARD, s + 1, m)))
        return None if grad is None else max(own, grad)
    return 0.0


def _check_complete(done, num_stages: int, microbatches: int) -> None:
    missing = [f"{s}{op.value}{m}" for op in (Op.FORWARD, Op.BACKWARD)
               for s in range(num_stages) for m in range(microbatches)
               if (op, s, m) not in done]
    if missing:
        raise ScheduleError(f"unmet: {len(missing)} actions never run, e.g. {missing[:6]}")
