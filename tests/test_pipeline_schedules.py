"""Schedules are data: generated per rank, checked by the simulator, refused when illegal."""

from __future__ import annotations

import pytest

from trainmesh.parallel.pipeline.ir import Action, Op, Phase, PipeShape, grid
from trainmesh.parallel.pipeline.schedules import build_schedule, pipe_shape
from trainmesh.parallel.pipeline.simulate import Costs, ScheduleError, simulate

KINDS = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 1), ("interleaved-1f1b", 2),
         ("interleaved-1f1b", 3), ("interleaved-1f1b", 4), ("zb-h1", 1), ("zbv", 2),
         ("dualpipev", 2)]
# Every schedule the generators make for pp ≤ 8, v ≤ 4, m ≤ 16 (interleaved with m not a
# multiple of pp, where the groups differ in size: for pp ≤ 5; DualPipeV from its 2·pp).
SWEEP = [(k, pp, v, m) for k, v in KINDS for pp in range(1, 9) for m in range(1, 17)
         if (k != "interleaved-1f1b" or m % pp == 0 or (pp <= 5 and m >= pp))
         and (k != "dualpipev" or m >= 2 * pp)]


def test_every_schedule_runs_to_completion_and_cannot_deadlock_under_nccl_rules():
    """All of them (hundreds, in about a second): each rank holds its stages and runs each of
    their actions once, and the lowered lists finish both as the executor runs them and under
    NCCL's rules (blocking sends, one stream per rank, FIFO matching per pair)."""
    for kind, pp, v, m in SWEEP:
        shape = pipe_shape(kind, pp, v, m)
        sched = build_schedule(kind, pp, v, m)
        assert simulate(sched, pp * v, m, Costs(1.0, 2.0, 0.1), shape=shape).step_time > 0
        simulate(sched, pp * v, m, Costs(1.0, 2.0, 0.1), nccl=True, shape=shape)
        for rank, actions in enumerate(sched):
            assert {a.stage for a in actions} <= set(shape.stages_of(rank))
            mine = sorted((s, i) for s in shape.stages_of(rank) for i in range(m))
            done = {op: sorted((a.stage, a.microbatch) for a in actions if a.op is op) for op in Op}
            assert done[Op.FORWARD] == mine, (kind, pp, v, m, rank)
            # each backward once: whole (B) or split (I, then its W); DualPipeV mixes them
            assert sorted(done[Op.BACKWARD] + done[Op.BACKWARD_INPUT]) == mine, (kind, pp, v, m)
            assert done[Op.WEIGHT] == done[Op.BACKWARD_INPUT], (kind, pp, v, m, rank)
            if kind.startswith("zb"):
                assert not done[Op.BACKWARD]
            elif kind != "dualpipev":
                assert not done[Op.BACKWARD_INPUT]


def _placed_next_to_compute(shape: PipeShape, compute: list[list[Action]]) -> list[list[Action]]:
    """The executor's old placement: each receive right before the compute that needs it,
    each send right after the compute that produced it."""
    last, out = shape.num_stages - 1, []
    for rank, actions in enumerate(compute):
        seq = []
        for a in actions:
            s, m = a.stage, a.microbatch
            if a.op is Op.FORWARD:
                seq += [Action(Op.RECV_FORWARD, s, m)] * (s > 0 and shape.rank_of(s - 1) != rank)
                seq += [a] + [Action(Op.SEND_FORWARD, s, m)] * (s < last and shape.rank_of(s + 1) != rank)
            else:
                seq += [Action(Op.RECV_BACKWARD, s, m)] * (s < last and shape.rank_of(s + 1) != rank)
                seq += [a] + [Action(Op.SEND_BACKWARD, s, m)] * (s > 0 and shape.rank_of(s - 1) != rank)
        out.append(seq)
    return out


def test_the_old_placement_deadlocks_under_nccl_rules_and_is_reported():
    """Issue #15's case: interleaved 1F1B, pp=2, v=2, m=4, receives placed next to their
    compute. With buffered sends (gloo) it runs; under NCCL's rules rank 0's stream blocks in
    its send-only batch [2SB0] (its next, [0SF3 2RB1], queued behind it) while rank 1 waits in
    [3SB1 1RF2] and would post the receive for 2SB0 only later."""
    compute = [[a for a in r if a.op in (Op.FORWARD, Op.BACKWARD)]
               for r in build_schedule("interleaved-1f1b", 2, 2, 4)]
    old = _placed_next_to_compute(PipeShape(2, 2, 4), compute)
    simulate(old, 4, 4)
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0: 2SB0; rank 1: 3SB1 1RF2"):
        simulate(old, 4, 4, nccl=True)
    # Same order, ends posted differently on the two sides of a pair: NCCL would pair wrongly.
    swapped = [list(old[0]), list(old[1])]
    i, j = (swapped[1].index(Action(Op.RECV_FORWARD, 1, m)) for m in (1, 2))
    swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]
    with pytest.raises(ScheduleError, match="NCCL matches in order"):
        simulate(swapped, 4, 4, nccl=True)


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_schedules_shrink_the_bubble_at_1f1b_memory(pp, m):
    """F = I = W (the zero-bubble paper's costs): ZB-H1 idles (pp-1)·(F+I-W) where 1F1B idles
    (pp-1)·(F+B) — a third — at 1F1B's peak; ZBV (half-size chunks in a V) idles less than
    interleaved 1F1B at the same chunk size, holding at most 2·pp chunks."""
    def run(kind, v):
        shape = pipe_shape(kind, pp, v, m)
        res = simulate(build_schedule(kind, pp, v, m), pp * v, m, Costs(1 / v, 2 / v), shape=shape)
        return res.step_time - 3 * m, max(res.peak_in_flight)  # idle per rank, peak chunks

    one, zb = run("1f1b", 1), run("zb-h1", 1)
    assert zb[0] == pytest.approx(one[0] / 3) and zb[1] == one[1] == pp
    inter, zbv = run("interleaved-1f1b", 2), run("zbv", 2)
    assert zbv[0] < inter[0] and zbv[1] <= 2 * pp


@pytest.mark.parametrize(("kind", "pp", "v", "m"), [
    ("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("1f1b", 2, 1, 3), ("interleaved-1f1b", 4, 2, 8),
    ("interleaved-1f1b", 2, 3, 4), ("interleaved-1f1b", 4, 4, 16),
    # m not a multiple of pp: groups of pp and pp + 1, or one larger group
    ("interleaved-1f1b", 4, 2, 7), ("interleaved-1f1b", 8, 2, 9), ("interleaved-1f1b", 8, 2, 69)])
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
    with pytest.raises(ValueError, match="at least pp=4 microbatches, not 3"):
        build_schedule("interleaved-1f1b", 4, 2, 3)
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
    with pytest.raises(ScheduleError, match="deadlock.*rank 0: 0B0; rank 1: 1F0"):
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
    from trainmesh.planning.candidate import bubble_fraction

    sim = simulate(build_schedule(kind, pp, v, m), pp * v, m, Costs(1 / v, 2 / v))
    assert bubble_fraction(kind, pp, v, m) == pytest.approx(sim.bubble_fraction)


@pytest.mark.parametrize(("kind", "pp", "v"), [("1f1b", 4, 1), ("gpipe", 3, 1),
                                               ("interleaved-1f1b", 4, 2), ("zb-h1", 4, 1),
                                               ("zbv", 2, 2)])
def test_stages_of_unequal_cost_are_played_priced_and_bounded(kind, pp, v):
    """Per-stage costs (``Costs.stage_scale``): stages alike at 2× take twice as long. The
    planner's step for stages that differ (a heavier last stage: the head; a lighter one, a
    heavier first, random ones) is the simulator's: played for few microbatches, and for more
    on from the last play at its steady pace, never below the busiest rank's (exact for one
    chunk a rank, within 4% for two); and the bound a search ranks by first
    (``_least_makespan``) is never above the play, and equals the closed forms for stages
    alike."""
    import random

    from trainmesh.planning.candidate import _least_makespan, _makespan, bubble_fraction

    n = pp * v
    alike = simulate(build_schedule(kind, pp, v, 2 * pp), n, 2 * pp, Costs(1 / v, 2 / v),
                     shape=pipe_shape(kind, pp, v, 2 * pp))
    double = simulate(build_schedule(kind, pp, v, 2 * pp), n, 2 * pp,
                      Costs(1 / v, 2 / v, stage_scale=(2.0,) * n), shape=pipe_shape(kind, pp, v, 2 * pp))
    assert double.step_time == pytest.approx(2 * alike.step_time)
    rng = random.Random(0)
    scales = [tuple(1.0 if s < n - 1 else 1.6 for s in range(n)),  # (the head on the last)
              tuple(1.3 if s == 0 else 0.7 if s == n - 1 else 1.0 for s in range(n)),
              *(tuple(rng.choice((0.5, 0.7, 1.0, 1.3, 1.6)) for _ in range(n)) for _ in range(3))]
    for scale in scales:
        scale = tuple(round(x * n / sum(scale), 3) for x in scale)
        for m in ((1,) if kind != "interleaved-1f1b" else ()) + (pp, 3 * pp + 1, 6 * pp, 12 * pp):
            played = simulate(build_schedule(kind, pp, v, m), n, m, Costs(1 / v, 2 / v, stage_scale=scale),
                              shape=pipe_shape(kind, pp, v, m)).step_time
            assert _makespan(kind, pp, v, m, scale) == pytest.approx(played, rel=1e-9 if v == 1 else 0.04)
            assert _least_makespan(kind, pp, v, m, scale) <= played * (1 + 1e-9)
            if kind != "zbv":
                assert (bubble_fraction(kind, pp, v, m, scale, bound=True)
                        <= bubble_fraction(kind, pp, v, m, scale) + 1e-9)
    if kind in ("1f1b", "gpipe", "interleaved-1f1b"):
        for m in (pp, 3 * pp):
            busy = m * 3 * pp
            assert 1 - busy / (pp * _least_makespan(kind, pp, v, m, (1.0,) * n)) == pytest.approx(
                bubble_fraction(kind, pp, v, m))


def test_schedule_cli_prints_grid_and_writes_png(tmp_path, capsys):
    from trainmesh.cli.main import main

    png = tmp_path / "s.png"
    assert main(["schedule", "--pp", "4", "--vpp", "2", "--microbatches", "8", "--png",
                 str(png)]) == 0
    out = capsys.readouterr().out
    assert "rank 3 |" in out and "bubble 15.8%" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["schedule", "--pp", "4", "--vpp", "2", "--microbatches", "3"]) == 2
    assert "at least pp=4 microbatches" in capsys.readouterr().err


def test_schedule_figure_has_a_legend_for_every_kind_and_chunk_in_chunk_units():
    """The PNG a person reads: a legend names each action kind drawn (and each chunk's stages
    when a rank holds several), the box labels are explained, time is in chunk forwards."""
    import matplotlib.pyplot as plt

    from trainmesh.parallel.pipeline.trace import schedule_figure

    def legend_and_axis(kind, pp, v, m):
        sim = simulate(build_schedule(kind, pp, v, m), pp * v, m, Costs(1.0, 2.0),
                       shape=pipe_shape(kind, pp, v, m))
        fig = schedule_figure(sim, kind)
        [legend] = fig.legends
        texts = [t.get_text() for t in legend.get_texts()]
        ax = fig.axes[0]
        boxes = {t.get_text() for t in ax.texts}
        label, end = ax.get_xlabel(), sim.step_time
        plt.close(fig)
        return texts, boxes, label, end

    texts, boxes, label, end = legend_and_axis("interleaved-1f1b", 4, 2, 8)
    assert texts[:4] == ["F forward", "B backward", "chunk 0: stages 0–3", "chunk 1: stages 4–7"]
    assert texts[4].startswith("box label: stage, kind, microbatch (")
    assert {"0F0", "7B7", "4B0"} <= boxes and label == "time (one chunk's forward = 1)"
    # 2·m·pp chunk actions of 1 + 2 units spread over pp ranks, plus the bubble
    assert end == pytest.approx(3 * 8 * 2 / (1 - 0.158), rel=0.01)
    texts, boxes, _, _ = legend_and_axis("zb-h1", 4, 1, 8)
    assert texts[:3] == ["F forward", "I backward, input half", "W backward, weight half"]
    assert not [t for t in texts if t.startswith("chunk")] and "3W7" in boxes


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (3, 9), (4, 8), (4, 16), (8, 16)])
def test_dualpipev_pairs_forwards_with_other_backwards_at_a_closed_form_bubble(pp, m):
    """DualPipeV (torch's generator of DeepSeek's order, in this IR): two chunks a rank in a
    V; its steady state pairs each forward with a backward of the rank's other chunk and
    another microbatch (the pair whose all-to-alls hide behind each other's compute), the
    drain's backwards split into I and W. Played with the pairs run one after the other (as
    the executor runs them; F : B : W = 1 : 2 : 1), each rank idles (pp − 1) chunk forwards:
    bubble (pp − 1) / (6m + pp − 1), no more than ZBV's, with 2·pp + 1 chunks in flight."""
    shape = pipe_shape("dualpipev", pp, 2, m)
    sched = build_schedule("dualpipev", pp, 2, m)
    for rank, actions in enumerate(sched):
        compute = [a for a in actions if a.op in (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT,
                                                  Op.WEIGHT)]
        pairs = [(f, b) for f, b in zip(compute, compute[1:], strict=False)
                 if f.op is Op.FORWARD and b.op is Op.BACKWARD and f.stage != b.stage
                 and f.microbatch != b.microbatch]
        assert len(pairs) >= 2 * (m - 2 * pp) + 1, (rank, grid(sched))
        assert {s for f, b in pairs for s in (f.stage, b.stage)} == set(shape.stages_of(rank))
        assert any(a.op is Op.WEIGHT for a in compute)  # the drain's split backwards
    played = simulate(sched, 2 * pp, m, Costs(1 / 2, 1.0), shape=shape)
    assert played.bubble_fraction == pytest.approx((pp - 1) / (6 * m + pp - 1))
    zbv = simulate(build_schedule("zbv", pp, 2, m), 2 * pp, m, Costs(1 / 2, 1.0),
                   shape=pipe_shape("zbv", pp, 2, m))
    assert played.bubble_fraction <= zbv.bubble_fraction + 1e-9
    assert played.peak_in_flight == [2 * pp + 1] * pp


def test_dualpipev_in_the_schedule_cli(capsys, tmp_path):
    from trainmesh.cli.main import main

    png = tmp_path / "dualpipev.png"
    assert main(["schedule", "--pp", "2", "--vpp", "2", "--microbatches", "4", "--schedule",
                 "dualpipev", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "3W0" in out and "0B0" in out and "bubble 4.0%" in out  # 1 / (24 + 1)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["schedule", "--pp", "4", "--vpp", "2", "--microbatches", "6", "--schedule",
                 "dualpipev"]) == 2
    assert "--microbatches 8" in capsys.readouterr().err


def test_dualpipev_with_fewer_microbatches_a_replica_than_stages_is_refused_not_planned():
    """A spec (or a plan) whose replicas each get fewer than 2·pp microbatches under dualpipev
    is refused naming training.global_batch_size and the batch that would run: by the spec's
    rules, so that the planner rejects such a layout instead of failing to build it."""
    import dataclasses

    from trainmesh.cli.loading import load_spec
    from trainmesh.planning.job_plan import plan_job, request_for
    from trainmesh.planning.planner import plan
    from trainmesh.planning.topology import Topology
    from trainmesh.spec.problems import SpecError
    from trainmesh.spec.validate import Layout, Workload, layout_problems

    args = ["model.preset=tiny", "parallelism.pp=2", "parallelism.vpp=2",
            "schedule.name=dualpipev", "training.global_batch_size=8",
            "training.microbatch_size=1", "runtime.device=cpu"]
    fits = load_spec(None, [*args, "parallelism.dp=2"])  # 4 microbatches a replica: 2·pp
    assert not layout_problems(Workload.of(fits), Layout.pinned(fits))
    [problem] = layout_problems(Workload.of(fits), dataclasses.replace(Layout.pinned(fits), dp=4))
    assert problem.path == "training.global_batch_size" and "16 or more" in problem.fix
    with pytest.raises(SpecError, match="training.global_batch_size"):
        load_spec(None, [*args, "parallelism.dp=4"])  # 2 a replica
    dims, _ = plan_job(fits, Topology.uniform(1, 8, "cpu"))
    assert (dims.pp, dims.dp) == (2, 2)
    # with dp left to it (a re-plan), the planner rejects dp 4 for it rather than failing
    req = request_for(fits)
    free = dataclasses.replace(req, fixed={k: v for k, v in req.fixed.items() if k != "dp"})
    result = plan(free, Topology.uniform(1, 8, "cpu"), every=True)
    assert {p.candidate.dp for p in result.plans} == {1, 2}
    assert any("dualpipev needs at least" in r.reason for r in result.rejected)


def test_zero_bubble_in_the_schedule_cli_shows_weight_actions(capsys, tmp_path):
    from trainmesh.cli.main import main

    png = tmp_path / "zb.png"
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "zb-h1",
                 "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "0W7" in out and "3I0" in out and "bubble 11.1%" in out  # (pp-1)/(3m+pp-1)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["schedule", "--pp", "2", "--vpp", "3", "--microbatches", "4", "--schedule", "zbv"]) == 2
    assert capsys.readouterr().err.strip().endswith("not vpp=3; give --vpp 2")  # (the command's flag)


def test_plan_against_measurement_replays_the_measured_costs(tmp_path):
    """The planned-vs-measured view: per-action costs taken from a measured timeline, fed to
    the simulator, give back that timeline when the run went as planned (here the "measured"
    rows are a run on other costs, in seconds), and both land in one trace and one PNG."""
    import json

    from trainmesh.parallel.pipeline.trace import chrome_trace, measured_costs, plot_schedule

    kind, pp, v, m = "zbv", 2, 2, 4
    shape = pipe_shape(kind, pp, v, m)
    sched = build_schedule(kind, pp, v, m)
    truth = simulate(sched, pp * v, m, Costs(0.01, 0.03, input=0.02, weight=0.01), shape=shape)
    measured = [[(str(a) if a.op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.WEIGHT) else str(a) + "+",
                  100.0 + s, 100.0 + e) for a, s, e in row] for row in truth.timeline]
    costs = measured_costs(measured)
    assert (costs.forward, costs.input, costs.weight) == pytest.approx((0.01, 0.02, 0.01))
    planned = simulate(sched, pp * v, m, costs, shape=shape)
    assert planned.step_time == pytest.approx(truth.step_time)
    trace = chrome_trace(measured, planned)
    names = {p: {e["name"] for e in trace["traceEvents"] if e.get("pid") == p and e["ph"] == "X"}
             for p in (0, 1)}
    assert {"3W3", "0I0"} <= names[0] & names[1]
    assert {e["cat"] for e in trace["traceEvents"] if e.get("pid") == 1 and e["ph"] == "X"} == {"planned"}
    json.dumps(trace)
    png = plot_schedule(planned, kind, tmp_path / "pvm.png", measured=measured)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
