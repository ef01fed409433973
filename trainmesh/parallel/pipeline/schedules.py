"""Schedule generators: pure functions of (pp, vpp, microbatches) → every rank's action list."""

from __future__ import annotations

import functools

from trainmesh.parallel.pipeline.ir import (
    Action,
    Op,
    Phase,
    PipeShape,
    Schedule,
    ScheduleKind,
    lower,
    v_shaped,
)


def pipe_shape(kind: ScheduleKind | str, pp: int, vpp: int, microbatches: int) -> PipeShape:
    """Where ``kind`` puts the stages: ZBV and DualPipeV two per rank in a V, the others
    round-robin."""
    kind = ScheduleKind(kind)
    check(kind, pp, vpp, microbatches)
    return PipeShape(pp, vpp, microbatches, v_shape=v_shaped(kind))


def build_schedule(kind: ScheduleKind | str, pp: int, vpp: int, microbatches: int) -> Schedule:
    """Every rank's ordered actions, sends and receives included."""
    kind = ScheduleKind(kind)
    shape = pipe_shape(kind, pp, vpp, microbatches)
    if kind is ScheduleKind.ZBV:  # 1F1B's peak, in half-size chunks: 2·pp of them
        return lower(shape, zero_bubble(shape, limit=2 * pp))
    if kind is ScheduleKind.DUALPIPEV:
        return lower(shape, [_phases(actions) for actions in dualpipev(shape)])
    gen = {ScheduleKind.GPIPE: _gpipe, ScheduleKind.ONE_F_ONE_B: _one_f_one_b,
           ScheduleKind.INTERLEAVED_1F1B: _interleaved, ScheduleKind.ZB_H1: _zb_h1}[kind]
    return lower(shape, [gen(shape, r) for r in range(pp)])


def forward_only(shape: PipeShape, schedule: Schedule) -> Schedule:
    """A built schedule's forwards alone, in its order, with their sends and receives placed
    anew (the same lowering): evaluation."""
    return lower(shape, [[a for a in actions if a.op is Op.FORWARD] for actions in schedule])


class ScheduleMisfit(ValueError):
    """A combination a schedule cannot run; ``need``: the value of ``vpp`` or ``microbatches``
    that would run (the caller names the setting: a spec field, a command-line flag)."""

    def __init__(self, message: str, need: dict[str, int | str]):
        super().__init__(message)
        self.need = need


def check(kind: ScheduleKind, pp: int, vpp: int, m: int) -> None:
    """Refuse combinations a schedule cannot run (``ScheduleMisfit``)."""
    if pp < 1 or vpp < 1 or m < 1:
        raise ScheduleMisfit(f"pp={pp}, vpp={vpp}, microbatches={m} must all be at least 1", {})
    if kind is ScheduleKind.INTERLEAVED_1F1B:
        if m < pp:
            raise ScheduleMisfit(f"interleaved 1F1B needs at least pp={pp} microbatches, not {m}",
                                 {"microbatches": pp})
    elif v_shaped(kind):
        if vpp != 2:
            raise ScheduleMisfit(f"{kind.value} places two chunks per rank in a V (vpp=2), not "
                                 f"vpp={vpp}", {"vpp": 2})
        if kind is ScheduleKind.DUALPIPEV and m < 2 * pp:
            raise ScheduleMisfit(f"dualpipev needs at least as many microbatches as stages "
                                 f"(2·pp = {2 * pp}), not {m}", {"microbatches": 2 * pp})
    elif vpp != 1:
        raise ScheduleMisfit(f"schedule {kind.value} has one chunk per rank (vpp={vpp}); use "
                             "interleaved-1f1b, zbv or dualpipev for vpp > 1", {"vpp": 1})


def zero_bubble(shape: PipeShape, limit: int) -> list[list[Action]]:
    """Compute orders with the backward split into I (input gradients) and W (weight gradients),
    chosen greedily on unit costs the way the zero-bubble paper's heuristic does (Qi et al.,
    2023): at each moment a rank runs a ready I first (it is on the critical path: the stage
    before waits for it), else a ready F if fewer than ``limit`` microbatch-chunks hold
    activations (F done, W not yet), else a deferred W — so the W's fill what would have been
    bubbles. With two chunks per rank in a V and ``limit = 2·pp`` this is ZBV."""
    pp, m, last = shape.pp, shape.microbatches, shape.num_stages - 1
    done: dict[tuple[str, int, int], float] = {}  # (op, stage, mb) → finish time
    nxt = {(op, s): 0 for s in range(last + 1) for op in "FI"}  # next microbatch per stage
    clock, held = [0.0] * pp, [0] * pp
    waiting_w: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    out: list[list[Action]] = [[] for _ in range(pp)]

    def arrival(op: str, s: int) -> float | None:
        i = nxt[(op, s)]
        if i >= m:
            return None
        if op == "F":
            return 0.0 if s == 0 else done.get(("F", s - 1, i))
        own = done.get(("F", s, i))
        grad = own if s == last else done.get(("I", s + 1, i))
        return None if own is None or grad is None else max(own, grad)

    def options(r: int) -> list[tuple[float, int, str, int]]:
        """(ready time, priority, op, stage) of what rank r could start next."""
        opts = []
        for s in shape.stages_of(r):
            for op, prio in (("I", 0), ("F", 1)):
                at = arrival(op, s)
                if at is not None and (op == "I" or held[r] < limit):
                    opts.append((max(at, clock[r]), prio, op, -s))
        return opts

    for _ in range(3 * m * (last + 1)):  # every stage's F, I and W of every microbatch
        best = None  # (start, priority, rank, op, stage)
        for r in range(pp):
            opts = options(r)
            now = [o for o in opts if o[0] <= clock[r]]
            if now:
                _, prio, op, s = min(now)
                cand = (clock[r], prio, r, op, -s)
            elif waiting_w[r]:
                cand = (clock[r], 2, r, "W", 0)
            elif opts:
                start, prio, op, s = min(opts)
                cand = (start, prio, r, op, -s)
            else:
                continue
            best = cand if best is None or cand < best else best
        if best is None:
            raise RuntimeError("zero-bubble generator stalled")  # cannot happen for legal shapes
        start, _, r, op, s = best
        if op == "W":
            s, i = waiting_w[r].pop(0)
            held[r] -= 1
            out[r].append(Action(Op.WEIGHT, s, i))
        else:
            i = nxt[(op, s)]
            nxt[(op, s)] += 1
            done[(op, s, i)] = start + 1.0
            if op == "F":
                held[r] += 1
            else:
                waiting_w[r].append((s, i))
            out[r].append(Action(Op.FORWARD if op == "F" else Op.BACKWARD_INPUT, s, i))
        clock[r] = start + 1.0
    return [_phases(actions) for actions in out]


def dualpipev(shape: PipeShape) -> list[list[Action]]:
    """DeepSeek's DualPipeV (the V-shaped half of DualPipe): two chunks a rank in a V; after
    the warm-up each rank runs pairs, the forward of one chunk's microbatch beside the full
    backward of the other chunk's (where one's all-to-all hides behind the other's compute:
    ``dualpipev_pairs``, ``overlap.run_pair``), and splits the last backwards into I and W to
    fill the drain. The compute orders are torch.distributed.pipelining's
    (``ScheduleDualPipeV``, built from DeepSeek's code), each pair as its forward then its
    backward."""
    return _dualpipev(shape)[0]


def dualpipev_pairs(shape: PipeShape) -> list[frozenset[tuple[int, int]]]:
    """Per rank: the (stage, microbatch) of each forward that DualPipeV pairs with the backward
    after it."""
    return _dualpipev(shape)[1]


def pairs_of(kind: ScheduleKind | str, shape: PipeShape) -> list[frozenset[tuple[int, int]]]:
    """Per rank: the forwards ``kind`` pairs with the action after them (none but DualPipeV)."""
    if ScheduleKind(kind) is ScheduleKind.DUALPIPEV:
        return dualpipev_pairs(shape)
    return [frozenset() for _ in range(shape.pp)]


def _dualpipev(shape: PipeShape) -> tuple[list[list[Action]], list[frozenset[tuple[int, int]]]]:
    actions, pairs = _dualpipev_cached(shape)
    return [list(a) for a in actions], list(pairs)


@functools.cache
def _dualpipev_cached(shape: PipeShape) -> tuple[tuple[tuple[Action, ...], ...],
                                                 tuple[frozenset[tuple[int, int]], ...]]:
    import torch

    ops = {"F": Op.FORWARD, "B": Op.BACKWARD, "I": Op.BACKWARD_INPUT, "W": Op.WEIGHT}
    out, pairs = [], []
    try:  # (the generator is torch's own method, read without a runtime: its stages, groups)
        from torch.distributed.pipelining.schedules import OVERLAP_F_B, ScheduleDualPipeV

        generator = object.__new__(ScheduleDualPipeV)
        generator.pp_group_size, generator._n_microbatches = shape.pp, shape.microbatches
        for rank in range(shape.pp):
            actions, paired = [], set()
            for a in generator._calculate_single_rank_operations(rank):
                if a is None:
                    continue
                if a.computation_type == OVERLAP_F_B:
                    f = a.sub_actions[0]
                    paired.add((f.stage_index, f.microbatch_index))
                for sub in (a.sub_actions if a.computation_type == OVERLAP_F_B else (a,)):
                    actions.append(Action(ops[sub.computation_type.value], sub.stage_index,
                                          sub.microbatch_index))
            out.append(actions)
            pairs.append(frozenset(paired))
    except (ImportError, AttributeError, KeyError, TypeError) as err:
        raise RuntimeError(f"dualpipev's order comes from torch.distributed.pipelining's "
                           f"ScheduleDualPipeV, which torch {torch.__version__} does not give as "
                           f"torch 2.13 does ({type(err).__name__}: {err}); pin torch 2.13 or "
                           "use schedule.name=zbv") from err
    _check_each_once(shape, out)
    for rank, actions in enumerate(out):  # (each pair: a forward, then a whole backward)
        for i, a in enumerate(actions):
            if (a.stage, a.microbatch) in pairs[rank] and a.op is Op.FORWARD and (
                    i + 1 == len(actions) or actions[i + 1].op is not Op.BACKWARD):
                raise RuntimeError(f"dualpipev's pair {a} on rank {rank} is not a forward "
                                   "followed by a whole backward")
    return tuple(tuple(a) for a in out), tuple(pairs)


def _check_each_once(shape: PipeShape, compute: list[list[Action]]) -> None:
    """Each rank runs its stages' forward of every microbatch once and its backward once:
    whole (B), or split (I, then its W)."""
    for rank, actions in enumerate(compute):
        mine = {(s, i) for s in shape.stages_of(rank) for i in range(shape.microbatches)}
        seen = {op: [(a.stage, a.microbatch) for a in actions if a.op is op] for op in Op}
        backs = seen[Op.BACKWARD] + seen[Op.BACKWARD_INPUT]
        if (sorted(seen[Op.FORWARD]) != sorted(mine) or sorted(backs) != sorted(mine)
                or sorted(seen[Op.WEIGHT]) != sorted(seen[Op.BACKWARD_INPUT])):
            raise RuntimeError(f"a generated schedule does not run rank {rank}'s stages' "
                               "forward and backward once for every microbatch")


def _phases(actions: list[Action]) -> list[Action]:
    """Warm-up: before the rank's first backward; cool-down: after its last forward."""
    first = next(i for i, a in enumerate(actions) if a.op is not Op.FORWARD)
    final = max(i for i, a in enumerate(actions) if a.op is Op.FORWARD)
    return [Action(a.op, a.stage, a.microbatch,
                   Phase.WARMUP if i < first else Phase.COOLDOWN if i > final else Phase.STEADY)
            for i, a in enumerate(actions)]


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


def interleave_groups(pp: int, m: int) -> list[int]:
    """Interleaved 1F1B sends microbatches through a rank's chunks in groups of at least pp:
    ``m // pp`` groups whose sizes differ by at most one (pp each when pp divides m, Megatron's
    case; otherwise the first ``m % (m // pp)`` groups take one more), so any m ≥ pp runs
    without padding. The warm-up is sized by the first group g: (v - 1)·(g - pp) forward units
    more than Megatron's, activations included (one group of 7 for m = 7, pp = 4: 3·(v - 1)
    more); with the larger groups last, that warm-up is too short and the ranks deadlock."""
    if m < pp:
        raise ValueError(f"interleaved 1F1B needs at least pp={pp} microbatches, not {m}")
    rounds = m // pp
    size, extra = divmod(m, rounds)
    return [size + (j < extra) for j in range(rounds)]


def _interleaved(shape: PipeShape, rank: int) -> list[Action]:
    """Megatron's interleaved 1F1B: microbatches go through the rank's v chunks group by group
    (``interleave_groups``); the warm-up is (pp - rank - 1) × 2 + (v - 1) × g forward units, g
    the first group's size. Forwards take each group through chunks 0 … v-1, backwards through
    v-1 … 0."""
    pp, v, m = shape.pp, shape.vpp, shape.microbatches
    total = m * v
    forward, backward = [], []
    start = 0
    for g in interleave_groups(pp, m):
        for c in range(v):
            forward += [(c * pp + rank, start + i) for i in range(g)]
            backward += [((v - 1 - c) * pp + rank, start + i) for i in range(g)]
        start += g
    warm = min((pp - rank - 1) * 2 + (v - 1) * interleave_groups(pp, m)[0], total)
    out = [Action(Op.FORWARD, *forward[k], Phase.WARMUP) for k in range(warm)]
    for i in range(total - warm):
        out.append(Action(Op.FORWARD, *forward[warm + i], Phase.STEADY))
        out.append(Action(Op.BACKWARD, *backward[i], Phase.STEADY))
    out += [Action(Op.BACKWARD, *backward[k], Phase.COOLDOWN) for k in range(total - warm, total)]
    return out


def _zb_h1(shape: PipeShape, rank: int) -> list[Action]:
    """ZB-H1 (Qi et al., 2023): 1F1B with each backward split into I and W, and rank r's W's
    held back by r microbatches — the later ranks, which finish their I's first, do their
    deferred W's in what was 1F1B's cool-down bubble. Activations held: at most the warm-up
    (pp - r - 1) + 1 + r = pp, 1F1B's peak; bubble (pp - 1)·(F + I - W) instead of
    (pp - 1)·(F + B)."""
    s, m = rank, shape.microbatches
    warm = min(shape.pp - rank - 1, m)
    out = [Action(Op.FORWARD, s, i, Phase.WARMUP) for i in range(warm)]
    w = 0  # next W
    for j in range(m):
        phase = Phase.STEADY if j < m - warm else Phase.COOLDOWN
        if j < m - warm:
            out.append(Action(Op.FORWARD, s, warm + j, phase))
        out.append(Action(Op.BACKWARD_INPUT, s, j, phase))
        if j - rank >= w:
            out.append(Action(Op.WEIGHT, s, w, phase))
            w += 1
    out += [Action(Op.WEIGHT, s, i, Phase.COOLDOWN) for i in range(w, m)]
    return out
