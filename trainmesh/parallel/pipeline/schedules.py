"""Schedule generators: pure functions of (pp, vpp, microbatches) → every rank's action list."""

from __future__ import annotations

from trainmesh.parallel.pipeline.ir import (
    Action,
    Op,
    Phase,
    PipeShape,
    Schedule,
    ScheduleKind,
    with_communication,
)


def build_schedule(kind: ScheduleKind | str, pp: int, vpp: int, microbatches: int) -> Schedule:
    """Every rank's ordered actions, sends and receives included."""
    kind = ScheduleKind(kind)
    check(kind, pp, vpp, microbatches)
    shape = PipeShape(pp, vpp, microbatches)
    gen = {ScheduleKind.GPIPE: _gpipe, ScheduleKind.ONE_F_ONE_B: _one_f_one_b,
           ScheduleKind.INTERLEAVED_1F1B: _interleaved}[kind]
    return with_communication(shape, [gen(shape, r) for r in range(pp)])


def check(kind: ScheduleKind, pp: int, vpp: int, m: int) -> None:
    """Refuse combinations a schedule cannot run, naming the fix."""
    if pp < 1 or vpp < 1 or m < 1:
        raise ValueError(f"pp={pp}, vpp={vpp}, microbatches={m} must all be at least 1")
    if kind is ScheduleKind.INTERLEAVED_1F1B:
        if m % pp:
            raise ValueError(f"interleaved 1F1B needs microbatches ({m}) to be a multiple of "
                             f"pp={pp}; change training.global_batch_size or microbatch_size")
    elif vpp != 1:
        raise ValueError(f"schedule {kind.value} has one chunk per rank (vpp={vpp}); use "
                         "interleaved-1f1b for vpp > 1")


def _gpipe(shape: PipeShape, rank: int) -> list[Action]:
    """All forwards, then all backwards."""
    s, m = rank, shape.microbatches
    return ([Action(Op.FORWARD, s, i, Phase.WARMUP) for i in range(m)]
            + [Action(Op.BACKWARD, s, i, Phase.COOLDOWN) for i in range(m)])


def _one_f_one_b(shape: PipeShape, rank: int) -> list[Action]:
    """pp - rank - 1 warm-up forwards, then one forward / one backward, then the rest."""
    s, m = rank, shape.microbatches
    warm = min(shape.pp - rank - 1, m)
    out = [Action(Op.FORWARD, s, i, Phase.WARMUP) for i in range(warm)]
    for i in range(m - warm):
        out.append(Action(Op.FORWARD, s, warm + i, Phase.STEADY))
        out.append(Action(Op.BACKWARD, s, i, Phase.STEADY))
    out += [Action(Op.BACKWARD, s, i, Phase.COOLDOWN) for i in range(m - warm, m)]
    return out


def _interleaved(shape: PipeShape, rank: int) -> list[Action]:
    """Megatron's interleaved 1F1B: microbatches go through the rank's v chunks in groups of
    pp; the warm-up is (pp - rank - 1) × 2 + (v - 1) × pp forward units."""
    pp, v, m = shape.pp, shape.vpp, shape.microbatches
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // pp) % v
        if not forward:
            chunk = v - 1 - chunk
        return chunk * pp + rank, (k // (pp * v)) * pp + k % pp

    warm = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    out = [Action(Op.FORWARD, *unit(k, True), Phase.WARMUP) for k in range(warm)]
    for i in range(total - warm):
        out.append(Action(Op.FORWARD, *unit(warm + i, True), Phase.STEADY))
        out.append(Action(Op.BACKWARD, *unit(i, False), Phase.STEADY))
    out += [Action(Op.BACKWARD, *unit(k, False), Phase.COOLDOWN) for k in range(total - warm, total)]
    return out
