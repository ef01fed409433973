"""Schedules are data: generated per rank, checked by the simulator, refused when illegal."""

from __future__ import annotations

import pytest

from trainmesh.parallel.pipeline.ir import Action, Op, Phase, PipeShape, grid
from trainmesh.parallel.pipeline.schedules import build_schedule
from trainmesh.parallel.pipeline.simulate import Costs, ScheduleError, simulate

LEGAL = [(k, pp, v, m) for pp in (1, 2, 3, 4) for m in range(1, 9)
         for k, v in [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 1),
                      ("interleaved-1f1b", 2), ("interleaved-1f1b", 3)]
         if k != "interleaved-1f1b" or m % pp == 0]


@pytest.mark.parametrize(("kind", "pp", "v", "m"), LEGAL)
def test_every_legal_schedule_runs_to_completion(kind, pp, v, m):
    sched = build_schedule(kind, pp, v, m)
    result = simulate(sched, pp * v, m, Costs(1.0, 2.0, 0.1))
    assert result.step_time > 0
    for rank, actions in enumerate(sched):
        shape = PipeShape(pp, v, m)
        mine = {a.stage for a in actions}
        assert mine <= set(shape.stages_of(rank))
        for op in (Op.FORWARD, Op.BACKWARD):
            done = sorted((a.stage, a.microbatch) for a in actions if a.op is op)
            assert done == sorted((s, i) for s in shape.stages_of(rank) for i in range(m))


@pytest.mark.parametrize(("kind", "pp", "v", "m"), [
    ("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("1f1b", 2, 1, 3), ("interleaved-1f1b", 4, 2, 8),
    ("interleaved-1f1b", 2, 3, 4), ("interleaved-1f1b", 4, 4, 16)])
def test_bubble_matches_closed_form_on_uniform_costs(kind, pp, v, m):
    """(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/v / (m + (p-1)/v) interleaved; forward and
    backward of a chunk cost 1/v of the rank's layers."""
    result = simulate(build_schedule(kind, pp, v, m), pp * v, m, Costs(1 / v, 2 / v, 0.0))
    idle = (pp - 1) / v
    assert result.bubble_fraction == pytest.approx(idle / (m + idle))
    assert result.step_time == pytest.approx(3 * (m + idle))


def test_in_flight_activations():
    assert simulate(build_schedule("gpipe", 4, 1, 8), 4, 8).peak_in_flight == [8] * 4
    assert simulate(build_schedule("1f1b", 4, 1, 8), 4, 8).peak_in_flight == [4, 3, 2, 1]
    inter = simulate(build_schedule("interleaved-1f1b", 4, 2, 8), 8, 8).peak_in_flight
    assert inter[0] == (4 - 0 - 1) * 2 + (2 - 1) * 4 + 1  # warm-up + one steady forward


def test_phases_are_named():
    ranks = build_schedule("1f1b", 4, 1, 8)
    assert {a.phase for a in ranks[0]} == {Phase.WARMUP, Phase.STEADY, Phase.COOLDOWN}
    assert [str(a) for a in ranks[3] if a.op in (Op.FORWARD, Op.BACKWARD)][:4] == [
        "3F0", "3B0", "3F1", "3B1"]


def test_illegal_combinations_are_refused():
    with pytest.raises(ValueError, match="multiple of pp=4"):
        build_schedule("interleaved-1f1b", 4, 2, 6)
    with pytest.raises(ValueError, match="use interleaved-1f1b"):
        build_schedule("1f1b", 2, 2, 4)
    with pytest.raises(ValueError, match="at least 1"):
        build_schedule("gpipe", 0, 1, 4)


def test_simulator_detects_deadlock_and_unmet_dependencies():
    F, B = Op.FORWARD, Op.BACKWARD
    # Rank 0 waits for the gradient before sending the activation that produces it.
    rank0 = [Action(F, 0, 0), Action(Op.RECV_BACKWARD, 0, 0), Action(B, 0, 0),
             Action(Op.SEND_FORWARD, 0, 0)]
    rank1 = [Action(Op.RECV_FORWARD, 1, 0), Action(F, 1, 0), Action(B, 1, 0),
             Action(Op.SEND_BACKWARD, 1, 0)]
    with pytest.raises(ScheduleError, match="deadlock.*rank 0: 0RB0.*rank 1: 1RF0"):
        simulate([rank0, rank1], 2, 1)
    sched = build_schedule("1f1b", 2, 1, 2)
    dropped = [a for a in sched[1] if str(a) != "1B1"]
    with pytest.raises(ScheduleError):
        simulate([sched[0], dropped], 2, 2)


def test_grid_prints_every_rank():
    text = grid(build_schedule("interleaved-1f1b", 2, 2, 4))
    lines = text.splitlines()
    assert len(lines) == 2 and lines[0].startswith("rank 0") and "3B3" in lines[1]


@pytest.mark.parametrize(("kind", "pp", "v", "m"), [("1f1b", 4, 1, 8),
                                                    ("interleaved-1f1b", 4, 2, 8),
                                                    ("gpipe", 2, 1, 6)])
def test_planner_closed_form_equals_the_simulator(kind, pp, v, m):
    from trainmesh.platform.cost_model import bubble_fraction

    sim = simulate(build_schedule(kind, pp, v, m), pp * v, m, Costs(1 / v, 2 / v))
    assert bubble_fraction(kind, pp, v, m) == pytest.approx(sim.bubble_fraction)


def test_schedule_cli_prints_grid_and_writes_png(tmp_path, capsys):
    from trainmesh.jobs.cli import main

    png = tmp_path / "s.png"
    assert main(["schedule", "--pp", "4", "--vpp", "2", "--microbatches", "8", "--png",
                 str(png)]) == 0
    out = capsys.readouterr().out
    assert "rank 3 |" in out and "bubble 15.8%" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["schedule", "--pp", "4", "--vpp", "2", "--microbatches", "6"]) == 2
    assert "multiple of pp=4" in capsys.readouterr().err
