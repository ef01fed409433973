"""DualPipeV's pairs on two threads taking turns (``parallel/pipeline/overlap.py``): the order
the two halves run in is fixed by where they hand over, an autograd backward hands over from
inside its nodes, and a failure in either half reaches the caller. (On real ranks, against one
process: ``test_expert_parallel.py``'s dualpipev cases.)"""

from __future__ import annotations

import threading

import pytest
import torch

from trainmesh.parallel.pipeline.overlap import hand_over, run_pair
from trainmesh.parallel.pipeline.schedules import build_schedule, dualpipev_pairs, pipe_shape


def _steps(log: list, name: str, n: int):
    def run():
        for k in range(n):
            log.append((name, k, threading.get_ident()))
            if k < n - 1:
                hand_over()
        return name
    return run


def test_the_halves_take_turns_where_they_hand_over():
    log: list = []
    out, handovers = run_pair(_steps(log, "f", 3), _steps(log, "b", 2))
    assert out == "f"
    # f0 → b0 → f1 → b1 (the backward ends) → f2 (its hand-over finds no one to let run)
    assert [(n, k) for n, k, _ in log] == [("f", 0), ("b", 0), ("f", 1), ("b", 1), ("f", 2)]
    assert handovers == (2, 1)  # (the forward's last step hands nothing over: it ends)
    main = threading.get_ident()
    assert {t for n, _, t in log if n == "f"} == {main}
    assert main not in {t for n, _, t in log if n == "b"}
    hand_over()  # (outside a pair: nothing happens, nothing waits)


class _Handing(torch.autograd.Function):
    """Identity whose backward hands over before passing the gradient on, as an exchange's
    wait does (``expert._Ticket.wait``)."""

    @staticmethod
    def forward(ctx, x, log):
        ctx.log = log
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append("b")
        hand_over()
        return grad * 2, None


def test_an_autograd_backward_hands_over_from_inside_its_nodes():
    log: list = []
    w = torch.ones(3, requires_grad=True)
    out = _Handing.apply(_Handing.apply(w * 1.0, log), log).sum()

    def forward():
        x = torch.ones(3)
        for _ in range(3):
            log.append("f")
            x = x * 2
            hand_over()
        return x

    y, handovers = run_pair(forward, out.backward)
    assert torch.equal(y, torch.full((3,), 8.0))
    assert torch.equal(w.grad, torch.full((3,), 4.0))  # (both nodes doubled it)
    assert log == ["f", "b", "f", "b", "f"] and handovers == (3, 2)


def test_switch_gives_each_half_its_own_settings_at_every_turn():
    """``switch`` swaps what the two halves share in the process (here the random generator,
    as the executor does): the forward draws what it would alone, the backward's draws do not
    disturb it, and the forward's state is the process's afterwards."""
    torch.manual_seed(0)
    alone = torch.rand(4)
    after_alone = torch.rand(1)
    torch.manual_seed(0)
    saved: list = [None, None]
    turns: list[int] = []

    def switch(to: int) -> None:
        turns.append(to)
        saved[1 - to] = torch.get_rng_state()
        if saved[to] is not None:
            torch.set_rng_state(saved[to])

    def forward():
        parts = []
        for _ in range(4):
            parts.append(torch.rand(1))
            hand_over()
        return torch.cat(parts)

    def backward():
        torch.manual_seed(123)  # (as a recomputed block replays its forward's generator)
        for _ in range(2):
            torch.rand(10)
            hand_over()

    drawn, _ = run_pair(forward, backward, switch)
    assert torch.equal(drawn, alone) and torch.equal(torch.rand(1), after_alone)
    assert turns == [1, 0, 1, 0, 1, 0]  # (the last: the backward ended, the forward's turn)
    # ... and where the forward ends first and the backward runs last, the forward's state
    # is put back after both (the process goes on as after the two one after the other)
    torch.manual_seed(0)
    saved[:], turns[:] = [None, None], []

    def short_forward():
        first = torch.rand(1)
        hand_over()
        return torch.cat([first, torch.rand(1)])

    drawn, _ = run_pair(short_forward, backward, switch)
    after = torch.rand(1)
    assert torch.equal(drawn, alone[:2]) and torch.equal(after, alone[2:3])
    assert turns == [1, 0, 1, 0]  # (the last: after both, back to the forward's)


def test_a_failing_half_is_raised_once_the_other_has_ended():
    log: list = []

    def backward():
        log.append("b")
        raise ValueError("backward broke")

    with pytest.raises(ValueError, match="backward broke"):
        run_pair(_steps(log, "f", 3), backward)
    # the forward stops at its next hand-over: alone, its collectives would meet nobody's
    assert [x if isinstance(x, str) else x[:2] for x in log] == [("f", 0), "b"]
    ran: list = []
    with pytest.raises(RuntimeError, match="forward broke"):  # (before it handed over: the
        run_pair(lambda: (_ for _ in ()).throw(RuntimeError("forward broke")),  # backward
                 lambda: ran.append("b"))  # never starts)
    assert ran == []
    assert run_pair(lambda: 1, lambda: None) == (1, (0, 0))  # (and the next pair runs)
    # a forward failing after it handed over: the backward stops at its next hand-over, and
    # the forward's own error is the one raised
    seen: list = []

    def failing_forward():
        hand_over()
        raise KeyError("forward broke later")

    def long_backward():
        for k in range(3):
            seen.append(k)
            hand_over()

    with pytest.raises(KeyError, match="forward broke later"):
        run_pair(failing_forward, long_backward)
    assert seen == [0]


def test_a_switch_that_raises_fails_the_pair_without_hanging_it():
    calls: list[int] = []

    def switch(to: int) -> None:
        calls.append(to)
        if len(calls) == 2:
            raise OSError("device lost")

    with pytest.raises(OSError, match="device lost"):
        run_pair(_steps([], "f", 3), _steps([], "b", 3), switch)
    assert run_pair(lambda: 2, lambda: None) == (2, (0, 0))


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (2, 5), (3, 9), (4, 8), (4, 16), (8, 16), (8, 64)])
def test_every_pair_takes_turns_and_the_planner_counts_them(pp, m):
    """Each pair is a forward and, as the next compute action, another chunk's and
    microbatch's whole backward; the executor runs every one of them taking turns (its
    backward's input never arrives between the two: ``executor.pair_end``), as many as the
    planner counts on rank 0, which pairs fewest (``cost_model.paired_share``)."""
    from trainmesh.parallel.pipeline.executor import pair_end
    from trainmesh.planning.cost_model import paired_share

    shape = pipe_shape("dualpipev", pp, 2, m)
    sched = build_schedule("dualpipev", pp, 2, m)
    counts = []
    for rank, pairs in enumerate(dualpipev_pairs(shape)):
        run = 0
        for i, a in enumerate(sched[rank]):
            j = pair_end(sched[rank], i, pairs)
            if (a.stage, a.microbatch) in pairs and a.op.value == "F":
                assert j is not None, (rank, a)
                b = sched[rank][j]
                assert b.op.value == "B" and b.stage != a.stage and b.microbatch != a.microbatch
                assert all(c.op.value not in "FBIW" for c in sched[rank][i + 1:j])
                run += 1
        assert run == len(pairs)
        counts.append(run)
    assert min(counts) == counts[0] == round(paired_share(pp, m) * 2 * m)
