"""Play every rank's action list together: detect deadlocks, unmet dependencies and messages a
pair of ranks would match wrongly, and predict step time, bubble and peak in-flight activations.

Two rules for communication. Consecutive communication actions of a rank form one batch (one
``batch_isend_irecv``), as in the executor.
- ``nccl=False`` (the executor's view): posting never blocks; a receive's data is there once
  both ends are posted (+ latency), and only the compute that uses it waits.
- ``nccl=True`` (NCCL's rules, for deadlock checks): each rank runs its list in order on one
  stream; a batch completes only when every message in it has met its other end (a send blocks
  until the peer has posted the receive, and the other way round), and messages between two
  ranks meet first in, first out whatever their tags — the k-th send from a to b meets the k-th
  receive at b from a, which must be the same message.
Costs are per stage action (one chunk of one rank).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from trainmesh.parallel.pipeline.ir import (
    COMPUTE,
    GRADIENT,
    SENDS,
    Action,
    Op,
    PipeShape,
    Schedule,
    message,
    peer_stage,
)


class ScheduleError(RuntimeError):
    """A deadlock, an unmet dependency or a mismatched message, with the actions involved."""


@dataclass(frozen=True)
class Costs:
    forward: float = 1.0
    backward: float = 2.0  # a whole backward; a split one is input + weight
    send_latency: float = 0.0
    input: float | None = None  # default: half the backward
    weight: float | None = None  # default: half the backward
    # Each stage's cost as a multiple of the above (stages of unequal size: their blocks, the
    # head on the last); None: every stage alike
    stage_scale: tuple[float, ...] | None = None

    def of(self, op: Op, stage: int = 0) -> float:
        half = self.backward / 2
        cost = {Op.FORWARD: self.forward, Op.BACKWARD: self.backward,
                Op.BACKWARD_INPUT: half if self.input is None else self.input,
                Op.WEIGHT: half if self.weight is None else self.weight}.get(op, 0.0)
        return cost if self.stage_scale is None else cost * self.stage_scale[stage]


@dataclass
class SimResult:
    step_time: float
    bubble_fraction: float
    peak_in_flight: list[int]  # per rank: most microbatch-chunks of activations held at once
    timeline: list[list[tuple[Action, float, float]]] = field(repr=False)


def _items(actions: list[Action]) -> list[list[Action]]:
    """A rank's list as the executor runs it: a compute action alone, communication batched."""
    out: list[list[Action]] = []
    for a in actions:
        if a.op not in COMPUTE and out and out[-1][0].op not in COMPUTE:
            out[-1].append(a)
        else:
            out.append([a])
    return out


def simulate(schedule: Schedule, num_stages: int, microbatches: int, costs: Costs = Costs(),
             nccl: bool = False, shape: PipeShape | None = None) -> SimResult:
    pp = len(schedule)
    shape = shape or PipeShape(pp, num_stages // pp, microbatches)
    items = [_items(actions) for actions in schedule]
    # Each message's place in its pair's FIFO on both sides (nccl) and where its ends are.
    fifo: dict[tuple[int, int, str, int], tuple[str, int, int]] = {}
    counts: dict[tuple[int, int, str], int] = defaultdict(int)
    for r, actions in enumerate(schedule):
        for a in actions:
            if a.op in COMPUTE:
                continue
            peer = shape.rank_of(peer_stage(a))
            pair = (r, peer) if a.op in SENDS else (peer, r)
            end = "send" if a.op in SENDS else "recv"
            k = counts[(*pair, end)]
            counts[(*pair, end)] += 1
            fifo[(*pair, end, k)] = message(a)
    for (src, dst, end, k), msg in fifo.items():
        other = fifo.get((src, dst, "recv", k))
        if nccl and end == "send" and other is not None and other != msg:
            raise ScheduleError(f"ranks {src}→{dst}: message {k} of the pair is {msg} at the "
                                f"sender and {other} at the receiver (NCCL matches in order)")

    clock = [0.0] * pp
    pos = [0] * pp
    posted: dict[tuple[str, int, int], dict[str, float]] = defaultdict(dict)  # message → end → t
    done: dict[tuple[Op, int, int], float] = {}
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    live, peak = [0] * pp, [0] * pp
    started: list[float | None] = [None] * pp  # nccl: when the batch in hand was posted

    def arrived(a: Action) -> float | None:
        ends = posted.get(message(a), {})
        if len(ends) < 2:
            return None
        return max(ends.values()) + costs.send_latency

    while any(pos[r] < len(items[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(items[r]):
                item = items[r][pos[r]]
                if item[0].op in COMPUTE:
                    a = item[0]
                    ready = _compute_ready(a, done, shape, nccl, arrived)
                    if ready is None:
                        break
                    start = max(clock[r], ready)
                    end = start + costs.of(a.op, a.stage)
                    done[(a.op, a.stage, a.microbatch)] = end
                    if a.op is Op.FORWARD:
                        live[r] += 1
                        peak[r] = max(peak[r], live[r])
                    elif a.op in (Op.BACKWARD, Op.WEIGHT):
                        live[r] -= 1
                    timeline[r].append((a, start, end))
                    clock[r] = end
                else:
                    if started[r] is None:  # post the batch's ends
                        started[r] = clock[r]
                        for a in item:
                            posted[message(a)]["send" if a.op in SENDS else "recv"] = clock[r]
                    times = [arrived(a) for a in item]
                    if nccl and None in times:
                        break  # one stream: nothing after this batch runs before it completes
                    end = max([clock[r], *[t for t in times if t is not None]]) if nccl else clock[r]
                    for a in item:
                        done[(a.op, a.stage, a.microbatch)] = end
                        timeline[r].append((a, started[r], end))
                    clock[r] = end
                    started[r] = None
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = [f"rank {r}: {' '.join(map(str, items[r][pos[r]]))}" for r in range(pp)
                     if pos[r] < len(items[r])]
            raise ScheduleError("deadlock: every rank waits; next actions: " + "; ".join(stuck))
    _check_complete(done, num_stages, microbatches)
    makespan = max(clock)
    busy = sum(e - s for row in timeline for a, s, e in row if a.op in COMPUTE)
    bubble = 1.0 - busy / (pp * makespan) if makespan > 0 else 0.0
    return SimResult(makespan, bubble, peak, timeline)


def _compute_ready(a: Action, done, shape: PipeShape, nccl: bool, arrived) -> float | None:
    """When ``a``'s inputs are on its rank, or None if not yet."""
    s, m = a.stage, a.microbatch
    num_stages = shape.num_stages

    def received(op: Op) -> float | None:
        t = done.get((op, s, m))
        if t is None or nccl:
            return t  # nccl: a receive completes with its batch
        return arrived(Action(op, s, m))

    if a.op is Op.WEIGHT:
        return done.get((Op.BACKWARD_INPUT, s, m))
    if a.op is Op.FORWARD:
        if s == 0:
            return 0.0
        if shape.rank_of(s - 1) == shape.rank_of(s):
            return done.get((Op.FORWARD, s - 1, m))
        return received(Op.RECV_FORWARD)
    own = done.get((Op.FORWARD, s, m))
    if own is None:
        return None
    if s == num_stages - 1:
        return own
    if shape.rank_of(s + 1) == shape.rank_of(s):
        grad = next((t for op in GRADIENT if (t := done.get((op, s + 1, m))) is not None), None)
    else:
        grad = received(Op.RECV_BACKWARD)
    return None if grad is None else max(own, grad)


def _check_complete(done, num_stages: int, microbatches: int) -> None:
    """Every stage's forward of every microbatch ran, and its backward: whole (B), or split
    (I and W) — a schedule may mix the two (DualPipeV splits only its drain's)."""
    missing = []
    for s in range(num_stages):
        for m in range(microbatches):
            split = (Op.BACKWARD_INPUT, s, m) in done or (Op.WEIGHT, s, m) in done
            if split and (Op.BACKWARD, s, m) in done:
                raise ScheduleError(f"stage {s}'s backward of microbatch {m} runs both whole "
                                    "and split")
            ops = (Op.FORWARD, Op.BACKWARD_INPUT, Op.WEIGHT) if split else (Op.FORWARD, Op.BACKWARD)
            missing += [f"{s}{op.value}{m}" for op in ops if (op, s, m) not in done]
    if missing:
        raise ScheduleError(f"unmet: {len(missing)} actions never run, e.g. {missing[:6]}")
