"""Pipeline schedules as data: every rank's ordered list of actions.

The model is cut into ``S = pp × v`` *stages* (virtual stages); stage ``s`` lives on rank
``s % pp`` as its chunk ``s // pp`` (round-robin, Megatron's interleaving). An action names an
op, a stage, a microbatch and the phase of the schedule it belongs to. Sends and receives are
derived from the compute order: a receive right before the compute that needs it, a send right
after the compute that produced it. The simulator (``simulate.py``) checks any such list, and
the executor runs exactly the same list.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Op(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"  # weight-gradient half of a split backward (zero-bubble schedules)
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


COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)


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

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    def stages_of(self, rank: int) -> list[int]:
        return [c * self.pp + rank for c in range(self.vpp)]


Schedule = list[list[Action]]  # rank → ordered actions


def with_communication(shape: PipeShape, compute: list[list[Action]]) -> Schedule:
    """Insert the receives and sends that each compute action implies."""
    last = shape.num_stages - 1
    out: Schedule = []
    for rank, actions in enumerate(compute):
        seq: list[Action] = []
        for a in actions:
            s, m, ph = a.stage, a.microbatch, a.phase
            if a.op is Op.FORWARD:
                if s > 0 and shape.rank_of(s - 1) != rank:
                    seq.append(Action(Op.RECV_FORWARD, s, m, ph))
                seq.append(a)
                if s < last and shape.rank_of(s + 1) != rank:
                    seq.append(Action(Op.SEND_FORWARD, s, m, ph))
            elif a.op is Op.BACKWARD:
                if s < last and shape.rank_of(s + 1) != rank:
                    seq.append(Action(Op.RECV_BACKWARD, s, m, ph))
                seq.append(a)
                if s > 0 and shape.rank_of(s - 1) != rank:
                    seq.append(Action(Op.SEND_BACKWARD, s, m, ph))
            else:
                seq.append(a)
        out.append(seq)
    return out


def grid(schedule: Schedule, compute_only: bool = True) -> str:
    """The schedule as text, one row per rank, e.g. ``rank 0 | 0F0 0F1 0B0 ...``."""
    rows = []
    for rank, actions in enumerate(schedule):
        cells = [f"{a!s:>5}" for a in actions if not compute_only or a.op in COMPUTE]
        rows.append(f"rank {rank:<2}|" + " ".join(cells))
    return "\n".join(rows)
