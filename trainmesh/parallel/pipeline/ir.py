"""Pipeline schedules as data: every rank's ordered list of actions.

The model is cut into ``S = pp × v`` *stages* (virtual stages); stage ``s`` lives on rank
``s % pp`` as its chunk ``s // pp`` (round-robin, Megatron's interleaving), or, for the V-shaped
schedules (ZBV, DualPipeV), on rank ``s`` going down and ``2pp - 1 - s`` coming back. An action names
an op, a stage, a microbatch and the phase of the schedule it belongs to. Sends and receives
are derived from the compute order by ``lower`` (below). The simulator (``simulate.py``) checks
any such list, and the executor runs exactly the same list.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Op(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"  # the whole backward: input and weight gradients
    BACKWARD_INPUT = "I"  # input gradients only (zero-bubble schedules: sent upstream at once)
    WEIGHT = "W"  # the weight gradients of an earlier I, deferred into a bubble
    RECV_FORWARD = "RF"  # receive the previous stage's activations
    SEND_FORWARD = "SF"  # send activations to the next stage
    RECV_BACKWARD = "RB"  # receive the next stage's input gradient
    SEND_BACKWARD = "SB"  # send the input gradient to the previous stage


class Phase(str, Enum):
    WARMUP = "warmup"
    STEADY = "steady"
    COOLDOWN = "cooldown"


class ScheduleKind(str, Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    ZB_H1 = "zb-h1"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"


def _kinds(*members: ScheduleKind) -> dict[ScheduleKind | str, bool]:
    """Each schedule, as a member and by its name, → whether it is one of ``members``: a
    plan's search asks ~10^5 times, and a dict answers faster than constructing the enum."""
    return {k: kind in members for kind in ScheduleKind for k in (kind, kind.value)}


_SPLITS_BACKWARD = _kinds(ScheduleKind.ZB_H1, ScheduleKind.ZBV, ScheduleKind.DUALPIPEV)
_V_SHAPED = _kinds(ScheduleKind.ZBV, ScheduleKind.DUALPIPEV)


def splits_backward(kind: ScheduleKind | str) -> bool:
    """Whether ``kind`` splits backwards into I and W (DualPipeV: some of them)."""
    found = _SPLITS_BACKWARD.get(kind)
    return found if found is not None else _SPLITS_BACKWARD[ScheduleKind(kind)]


def v_shaped(kind: ScheduleKind | str) -> bool:
    """Whether ``kind`` places its two chunks a rank in a V (the last stage on rank 0)."""
    found = _V_SHAPED.get(kind)
    return found if found is not None else _V_SHAPED[ScheduleKind(kind)]


COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.WEIGHT)
GRADIENT = (Op.BACKWARD, Op.BACKWARD_INPUT)  # the ops that produce a stage's input gradient


@dataclass(frozen=True)
class Action:
    op: Op
    stage: int
    microbatch: int
    phase: Phase = Phase.STEADY

    def __str__(self) -> str:  # e.g. "2F0": stage 2, forward, microbatch 0
        return f"{self.stage}{self.op.value}{self.microbatch}"


@dataclass(frozen=True)
class PipeShape:
    pp: int
    vpp: int
    microbatches: int
    v_shape: bool = False  # two chunks per rank placed in a V (ZBV, DualPipeV), not round-robin

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def rank_of(self, stage: int) -> int:
        if self.v_shape:
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, rank: int) -> list[int]:
        if self.v_shape:
            return [rank, 2 * self.pp - 1 - rank]
        return [c * self.pp + rank for c in range(self.vpp)]


Schedule = list[list[Action]]  # rank → ordered actions


def lower(shape: PipeShape, compute: list[list[Action]]) -> Schedule:
    """Every rank's compute order with its sends and receives, placed the way
    torch.distributed.pipelining lowers its schedules: walking the ranks round-robin, a compute
    action is placed once its input is on its rank; its send follows it at once and the peer's
    receive goes at the end of what the peer has been given so far — posted as early as it can
    be, waited for only by the compute that uses it.

    Every rank's list is then a subsequence of one global order in which both ends of each
    message sit together. So (a) no rank waits on a message whose other end comes later in that
    order: the lists cannot deadlock even where every send blocks until its receive is posted and
    every rank runs its communication in order on one stream (NCCL), and (b) each pair of ranks
    posts its messages in the same order on both sides, as NCCL needs (it matches them first in,
    first out, ignoring tags). Raises ``ValueError`` if the compute orders can never run."""
    last = shape.num_stages - 1
    out: Schedule = [[] for _ in compute]
    have: list[set[tuple[Op, int, int]]] = [set() for _ in compute]
    todo = [list(reversed(actions)) for actions in compute]
    while any(todo):
        placed = False
        for rank, queue in enumerate(todo):
            if not queue or not _inputs_here(queue[-1], have[rank], last):
                continue
            a = queue.pop()
            placed = True
            out[rank].append(a)
            have[rank].add((a.op, a.stage, a.microbatch))
            if a.op is Op.FORWARD and a.stage < last:
                to, send, recv = a.stage + 1, Op.SEND_FORWARD, Op.RECV_FORWARD
            elif a.op in GRADIENT and a.stage > 0:
                to, send, recv = a.stage - 1, Op.SEND_BACKWARD, Op.RECV_BACKWARD
            else:
                continue
            peer = shape.rank_of(to)
            if peer != rank:
                out[rank].append(Action(send, a.stage, a.microbatch, a.phase))
                out[peer].append(Action(recv, to, a.microbatch, a.phase))
                have[peer].add((recv, to, a.microbatch))
        if not placed:
            stuck = [f"rank {r}: {q[-1]}" for r, q in enumerate(todo) if q]
            raise ValueError("compute orders that can never run (each waits for an input that "
                             "comes after it): " + "; ".join(stuck))
    return out


SENDS = (Op.SEND_FORWARD, Op.SEND_BACKWARD)


def peer_stage(a: Action) -> int:
    """The stage at the other end of a send or receive."""
    return a.stage + 1 if a.op in (Op.SEND_FORWARD, Op.RECV_BACKWARD) else a.stage - 1


def message(a: Action) -> tuple[str, int, int]:
    """What both ends of a message call it: (direction, sending stage, microbatch)."""
    direction = "fwd" if a.op in (Op.SEND_FORWARD, Op.RECV_FORWARD) else "bwd"
    return direction, a.stage if a.op in SENDS else peer_stage(a), a.microbatch


def _inputs_here(a: Action, have: set[tuple[Op, int, int]], last: int) -> bool:
    s, m = a.stage, a.microbatch
    if a.op is Op.FORWARD:
        return s == 0 or bool({(Op.RECV_FORWARD, s, m), (Op.FORWARD, s - 1, m)} & have)
    if a.op in GRADIENT:
        return s == last or bool({(Op.RECV_BACKWARD, s, m), (Op.BACKWARD, s + 1, m),
                                  (Op.BACKWARD_INPUT, s + 1, m)} & have)
    return (Op.BACKWARD_INPUT, s, m) in have  # W after its own I


def grid(schedule: Schedule, compute_only: bool = True) -> str:
    """The schedule as text, one row per rank, e.g. ``rank 0 | 0F0 0F1 0B0 ...``."""
    rows = []
    for rank, actions in enumerate(schedule):
        cells = [f"{a!s:>5}" for a in actions if not compute_only or a.op in COMPUTE]
        rows.append(f"rank {rank:<2}|" + " ".join(cells))
    return "\n".join(rows)
