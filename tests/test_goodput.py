"""The goodput simulator against closed forms, the recovery strategies event by event, the
``trainmesh goodput`` command, and the Young/Daly checkpoint cadence."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from trainmesh.cli.main import main
from trainmesh.planning.cadence import CheckpointCadence, choose, daly_interval_s, system_mtbf_s
from trainmesh.planning.failure_costs import Assumptions, Measured, MeshCosts
from trainmesh.planning.goodput import CAUSES, Cluster, Fault, poisson_faults, simulate
from trainmesh.spec.job import CheckpointConfig, ElasticConfig

CRASH_ONLY = Assumptions(crash_share=1.0, unreachable_share=0.0, hang_share=0.0)
FREE = Measured(crash_detect_s=0.0, decide_s=0.0, warm_reform_s=0.0, cold_reform_s=0.0,
                warm_restore_s=0.0, cold_restore_s=0.0, first_step_s=0.0, restart_s=0.0)


def _mesh(nodes: int = 4, step_s: float = 1.0, save_s: float = 2.0, restart_s: float = 30.0,
          restore_s: float = 0.0, ranks_per_node: int = 8) -> MeshCosts:
    return MeshCosts(f"{nodes} nodes", nodes * ranks_per_node, nodes, step_s, 1000, 1.0,
                     save_blocked_s=save_s, save_write_s=save_s, save_durable_s=save_s,
                     restore_s=restore_s, restore_bytes_s=restore_s, warm_reform_s=5.0,
                     cold_reform_s=20.0, restart_s=restart_s)


def _check_accounting(out) -> None:
    assert sum(out.seconds.values()) == pytest.approx(out.wall_s, rel=1e-9)
    assert all(v >= -1e-6 for v in out.seconds.values()), out.seconds


def test_without_failures_goodput_is_one_minus_the_checkpoint_overhead():
    cl = Cluster(nodes=4)
    every, mesh = 60, _mesh(save_s=2.0)
    out = simulate("restart", cl, [], 62.0 * 1000, lambda n: mesh, lambda m: every)
    assert out.goodput == pytest.approx(1 - 2.0 / 62.0, rel=1e-12)
    assert out.seconds["checkpoint"] == pytest.approx(2.0 * 1000)
    assert out.steps == pytest.approx(60 * 1000) and out.faults == 0


def test_restart_from_checkpoint_matches_dalys_expected_time_within_sampling_error():
    """Daly (2006): with Poisson failures of mean interval M, a restart R (itself interruptible),
    checkpoints of cost δ every τ of compute, the expected wall time per τ of work is
    M·e^(R/M)·(e^((τ+δ)/M) − 1)."""
    cl = Cluster(nodes=4, mtbf_node_hours=1.0, replace_s=0.0)
    tau, delta, restart = 200.0, 10.0, 100.0
    mesh = _mesh(step_s=1.0, save_s=delta, restart_s=restart)
    measured = Measured(crash_detect_s=0.0)
    horizon = 1.5e6
    goodputs = []
    for seed in range(12):
        faults = poisson_faults(cl, horizon, seed, CRASH_ONLY)
        out = simulate("restart", cl, faults, horizon, lambda n: mesh, lambda m: int(tau),
                       m=measured, a=CRASH_ONLY)
        _check_accounting(out)
        goodputs.append(out.goodput)
    M = system_mtbf_s(cl.mtbf_node_hours, cl.nodes)
    expected = tau / (M * math.exp(restart / M) * (math.exp((tau + delta) / M) - 1))
    se = statistics.stdev(goodputs) / math.sqrt(len(goodputs))
    assert abs(statistics.mean(goodputs) - expected) < 4 * se + 1e-3, (goodputs, expected)
    assert 0.5 < expected < 0.9  # the failures matter at these rates


def test_the_simulation_is_deterministic_under_a_seed():
    cl = Cluster(nodes=8, spare_nodes=1, mtbf_node_hours=5.0, replace_s=600)
    plan = {8: _mesh(8), 7: _mesh(7, step_s=1.2)}.get
    runs = [[simulate(s, cl, poisson_faults(cl, 2e5, seed), 2e5, plan, lambda m: 50).as_dict()
             for s in ("trainmesh warm", "restart")] for seed in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_one_fault_trainmesh_shrinks_and_grows_back_while_restart_waits_for_the_node():
    """A node of the mesh crashes at t=1000 s; its replacement rejoins 600 s later."""
    cl = Cluster(nodes=4, replace_s=600.0)
    meshes = {4: _mesh(4, step_s=1.0, save_s=1.0), 3: _mesh(2, step_s=2.0, save_s=1.0)}
    fault = [Fault(1000.0, node=2, kind="crash")]
    m = Measured(crash_detect_s=3.0, decide_s=1.0, warm_reform_s=2.0, cold_reform_s=7.0,
                 warm_restore_s=0.0, first_step_s=0.0)
    meshes = {n: MeshCosts(**{**c.__dict__, "warm_reform_s": m.warm_reform_s,
                              "cold_reform_s": m.cold_reform_s}) for n, c in meshes.items()}
    out = {s: simulate(s, cl, fault, 4000.0, meshes.get, lambda c: 100, m=m, a=CRASH_ONLY)
           for s in ("trainmesh warm", "trainmesh cold", "restart")}
    for o in out.values():
        _check_accounting(o)
        assert o.faults == 1 and o.seconds["detection"] == pytest.approx(3.0)
        # the fault landed 1000 s in: checkpoints at steps 100, 200, ... each blocking 1 s;
        # the last durable one is step 900 (ended at 909 s), so 91 s of steps were lost
        assert o.seconds["lost_work"] == pytest.approx(91.0)
    warm, cold, restart = out["trainmesh warm"], out["trainmesh cold"], out["restart"]
    # trainmesh: decide + re-form (warm: the survivors; cold: all new) on 2 of the 3 nodes left
    assert warm.seconds["recovery"] == pytest.approx(1.0 + 2.0)
    assert cold.seconds["recovery"] == pytest.approx(1.0 + 7.0)
    assert [w for _, w in warm.timeline] == [32, 0, 16, 0, 32]  # shrink, then grow back
    assert warm.seconds["degraded"] > 0 and warm.seconds["resize"] > 0
    assert warm.seconds["waiting"] == 0
    # restart: nothing runs until the node is back (600 s after the fault, detection included)
    assert restart.seconds["waiting"] == pytest.approx(600.0 - 3.0)
    assert restart.seconds["recovery"] == pytest.approx(30.0)
    assert [w for _, w in restart.timeline] == [32, 0, 32]
    assert warm.goodput > cold.goodput > restart.goodput


def test_a_fault_on_a_spare_costs_nothing_and_a_spare_replaces_a_failed_node_at_once():
    cl = Cluster(nodes=4, spare_nodes=1, replace_s=1e9)
    mesh = _mesh(4, save_s=1.0)
    spare_dies = simulate("restart", cl, [Fault(50.0, node=4)], 1000.0, {4: mesh}.get,
                          lambda c: 100, m=FREE)
    assert spare_dies.faults == 0 and spare_dies.seconds["lost_work"] == 0
    # the spare is gone: the next fault on the mesh leaves restart waiting for good
    both = simulate("restart", cl, [Fault(50.0, node=4), Fault(500.0, node=0)], 1000.0,
                    {4: mesh}.get, lambda c: 100, m=FREE)
    assert both.seconds["waiting"] == pytest.approx(500.0)
    one = simulate("restart", cl, [Fault(500.0, node=0)], 1000.0, {4: mesh}.get,
                   lambda c: 100, m=FREE)
    assert one.seconds["waiting"] == 0 and one.seconds["recovery"] == pytest.approx(30.0)


def test_goodput_command_side_by_side_on_the_70b_reference_job(capsys, tmp_path):
    trace = tmp_path / "faults.txt"
    trace.write_text("# hours node kind\n2.0 5 crash\n30 17 unreachable\n100.5 3\n")
    png = tmp_path / "mesh.png"
    assert main(["goodput", "jobs/llama-70b.yaml", "--nodes", "128", "--trace", str(trace),
                 "--days", "10", "--json", "--png", str(png)]) == 0
    got = json.loads(capsys.readouterr().out.split("\nwrote ")[0])
    (r,) = got["results"]
    assert r["gpus"] == 1024 and r["mesh"] == "tp8·pp8·dp16" and r["checkpoint_every_steps"] == 500
    outs = {o["strategy"]: o for o in r["outcomes"]}
    assert set(outs) == {"trainmesh warm", "trainmesh cold", "restart"}
    assert all(o["interruptions"] == 3 for o in outs.values())
    assert outs["restart"]["hours_lost"]["waiting"] > 1.0  # 3 × (30 min - detection)
    assert outs["trainmesh warm"]["hours_lost"]["waiting"] == 0
    assert outs["trainmesh warm"]["goodput"] > outs["restart"]["goodput"]
    assert png.stat().st_size > 10_000
    # The picture's data: hours lost never fall and end at (1 - goodput) of the wall time.
    for o in outs.values():
        hours = [h for _, h in o["lost_hours"]]
        assert hours == sorted(hours) and o["lost_hours"][-1][0] == pytest.approx(240, abs=1e-3)
        assert hours[-1] == pytest.approx(240 * (1 - o["goodput"]), abs=0.01)
    from trainmesh.cli.goodput import goodput_figure

    fig = goodput_figure(got["results"])
    [ax] = fig.axes  # one cluster size: one axis, every strategy on it, named with its goodput
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        f"{o['strategy']}: goodput {o['goodput']:.2%}" for o in r["outcomes"]]
    assert len(ax.get_lines()) == 3 and ax.get_ylabel() == "hours lost (cumulative)"

    assert main(["goodput", "jobs/llama-70b.yaml", "--nodes", "128", "--nodes", "256",
                 "--failures-per-day", "2", "--days", "3", "--spare-nodes", "2"]) == 0
    table = capsys.readouterr().out
    assert "1,024" in table and "2,048" in table and "spare_nodes=2" in table
    # every cost term says where it comes from: measured (where, at how many ranks) or assumed
    assert "boundary_ms_per_rank = 0.52: measured, 128 stand-in ranks" in table
    assert "pg_init_s_per_1k_ranks = 5: assumed (--pg-init-s-per-1k-ranks)" in table
    assert got["measured"]["restart_s"]["source"].startswith("measured")


def test_segments_keep_the_controllers_boundaries_to_a_percent_of_the_time():
    """A segment is SEGMENT_STEPS steps or SEGMENT_S seconds, stretched where the controller's
    boundary (growing with the ranks) would take more than 1% of it, and, up to 2 minutes,
    until it costs at most 0.25 ms a step; so the control plane's
    part of a step stays within 1% of the step at any rank count, and within 1 ms a step at 256
    ranks with steps of up to a tenth of a second. A save's call to every rank blocks for a
    boundary more, which the cadence weighs."""
    from trainmesh.planning.cadence import SEGMENT_S, SEGMENT_STEPS, segment_caps
    from trainmesh.planning.failure_costs import MEASURED, control_s_per_step, mesh_costs
    from trainmesh.spec.job import ModelConfig

    assert segment_caps(0.001, 0.1) == (SEGMENT_STEPS, SEGMENT_S)  # small jobs: as they were
    # the boundary's CPU a step flat in the ranks (0.25 ms: 100 ms, 256 stand-in ranks here
    # at 0.23 s steps, every 400 steps) while a segment stays within 2 minutes; beyond, at
    # most 1% of the time
    from trainmesh.planning.cadence import BOUNDARY_S_PER_STEP, BOUNDARY_SHARE
    assert segment_caps(0.063, 0.1) == (252, SEGMENT_S)
    assert segment_caps(0.1, 0.23) == (400, pytest.approx(92.0))
    assert segment_caps(0.5, 1.5)[1] == 120.0  # (80 steps of 1.5 s: 6.25 ms, 0.4% a step)
    for boundary in (0.01, 0.063, 0.2, 0.5, 3.0):
        for step_s in (0.01, 0.1, 1.5):
            steps, until_s = segment_caps(boundary, step_s)
            runs = min(steps, until_s / step_s)
            assert boundary / runs <= max(BOUNDARY_S_PER_STEP, BOUNDARY_SHARE * step_s) * 1.0001
    steps, until_s = segment_caps(9.0, 1.5)
    assert until_s == pytest.approx(900) and steps == 600
    for world in (8, 256, 1024, 16384):
        for step_s in (0.01, 0.1, 1.5, 10.0):
            assert control_s_per_step(world, step_s) <= 0.0101 * step_s, (world, step_s)
    assert control_s_per_step(256, 0.1) <= 1e-3
    model = ModelConfig(preset="70b")
    small, large = (mesh_costs(model, 8, 8, dp, dp // 8, 1.5, 1, async_save=True)
                    for dp in (16, 256))
    boundary = MEASURED.boundary_ms_per_rank / 1000
    assert large.save_blocked_s - small.save_blocked_s == pytest.approx(
        boundary * 64 * (256 - 16) + large.state_gb_per_rank / 25 - small.state_gb_per_rank / 25)
    assert large.step_s == pytest.approx(1.5 + large.control_s) and large.control_s > small.control_s


def test_a_ranks_state_to_save_and_restore_follows_the_pipelines_split():
    """The goodput model's state per rank (what a save copies and writes, a restore reads) is
    the fullest rank's under the pipeline's split and schedule, not the even split's."""
    from trainmesh.planning.failure_costs import mesh_costs, state_gb_per_rank
    from trainmesh.planning.stage_params import rank_params
    from trainmesh.spec.job import ModelConfig

    model = ModelConfig(preset="70b")  # 80 blocks
    even = state_gb_per_rank(model, 8, 2, 16)
    uneven = state_gb_per_rank(model, 8, 2, 16, ("1f1b", 1, (20, 60)))
    assert uneven > 1.4 * even
    assert uneven == pytest.approx(max(
        rank_params(model, 2, r, "1f1b", 1, (20, 60)).local(8, 16) for r in range(2)) * 12 / 1e9)
    # interleaved: rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3
    assert state_gb_per_rank(model, 8, 2, 16, ("interleaved-1f1b", 2, (10, 10, 30, 30))) == even
    assert state_gb_per_rank(model, 8, 2, 16, ("interleaved-1f1b", 2, (10, 30, 10, 30))) == uneven
    costs = mesh_costs(model, 8, 2, 16, 32, 1.5, 1, async_save=True,
                       stages=("1f1b", 1, (20, 60)))
    assert costs.state_gb_per_rank == uneven


@pytest.mark.parametrize("argv, words", [
    (["--nodes", "0"], "--nodes"),
    (["--nodes", "8", "--days", "0"], "--days"),
    (["--nodes", "8", "--trace", "/nonexistent"], "--trace"),
])
def test_goodput_refuses_bad_arguments_plainly(argv, words, capsys):
    assert main(["goodput", "jobs/llama-70b.yaml", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_daly_interval_is_youngs_to_first_order_and_auto_cadence_uses_it():
    assert daly_interval_s(1.0, 1e6) == pytest.approx(math.sqrt(2e6), rel=1e-3)
    d, mtbf = 30.0, 3600.0
    r = math.sqrt(d / (2 * mtbf))
    assert daly_interval_s(d, mtbf) == pytest.approx(math.sqrt(2 * d * mtbf) * (1 + r / 3 + r * r / 9) - d)
    c = choose(d, 0.0, step_time_s=2.0, mtbf_s=mtbf, source="measured")
    assert c.every_steps == round(daly_interval_s(d, mtbf) / 2.0)
    # a background write longer than the optimum sets the floor
    assert choose(0.01, 50.0, 2.0, mtbf, "measured").every_steps == 25


class _Sink:
    def __init__(self):
        self.events, self.metrics = [], []

    def event(self, kind, **f):
        self.events.append((kind, f))

    def log_metrics(self, m, step):
        self.metrics.append((m, step))


def test_auto_cadence_measures_then_chooses_and_rechooses_on_a_new_mesh():
    sink = _Sink()
    cad = CheckpointCadence(CheckpointConfig(every="auto"), ElasticConfig(mtbf_node_hours=1.0))
    cad.start(0, nodes=2, predicted=(0.5, 0.5))
    for s in (1, 2):
        cad.stepped(s, 1.0, sink)
        assert not cad.due(s)  # nothing chosen before 3 measured steps
    cad.stepped(3, 1.0, sink)
    first = cad.choice
    assert first.every_steps == round(daly_interval_s(0.5, 1800.0)) and "predicted" in first.reason
    assert cad.due(first.every_steps) and not cad.due(first.every_steps - 1)
    cad.saving(first.every_steps)
    cad.saved(first.every_steps, blocked_s=8.0, write_s=8.0, tracker=sink)
    assert cad.choice.every_steps == round(daly_interval_s(8.0, 1800.0))
    # one node left: the job fails half as often, checkpoints further apart (measured cost kept)
    cad.start(100, nodes=1, predicted=(0.5, 0.5))
    for s in (101, 102, 103):
        cad.stepped(s, 1.0, sink)
    assert cad.choice.every_steps == round(daly_interval_s(8.0, 3600.0))
    assert [k for k, _ in sink.events] == ["checkpoint-cadence"] * 3
    assert [m["checkpoint_every_steps"] for m, _ in sink.metrics] == [
        c["every_steps"] for c in cad.choices]
    # a synchronous save is written once it unblocks: its write time sets no floor, even when
    # the saves cost more than the job runs between failures (Daly's interval is then M)
    sync = CheckpointCadence(CheckpointConfig(every="auto"), ElasticConfig(mtbf_node_hours=0.001))
    sync.start(0, nodes=1, predicted=(20.0, 20.0))
    for s in (1, 2, 3):
        sync.stepped(s, 1.0, sink)
    assert sync.choice.every_steps == round(3.6) and sync.choice.write_s == 0.0
    fixed = CheckpointCadence(CheckpointConfig(every=4), ElasticConfig())
    assert [s for s in range(1, 13) if fixed.due(s)] == [4, 8, 12]


def test_every_cause_is_reported():
    out = simulate("trainmesh warm", Cluster(nodes=2), [], 10.0, {2: _mesh(2)}.get, lambda c: 0)
    assert set(out.as_dict()["hours_lost"]) == set(CAUSES) - {"useful"}


def test_a_lost_process_keeps_its_node_a_notice_loses_no_work_a_hang_waits_for_the_watcher():
    """The trace kinds the soak benchmark replays: a rank process lost on a healthy node (the
    mesh stays whole: nothing to wait for, even without a spare), a preemption notice (a
    checkpoint at the step boundary first: no step rolled back), a hang (trainmesh's watcher
    calls it after ``hang_s``; restart-from-checkpoint waits for the collective timeout)."""
    cl = Cluster(nodes=4, replace_s=600.0)
    meshes = {4: _mesh(4, step_s=1.0, save_s=1.0), 3: _mesh(3, step_s=2.0, save_s=1.0)}
    every = lambda m: 100  # noqa: E731

    proc = simulate("trainmesh warm", cl, [Fault(1050.5, 1, "process")], 3000.0, meshes.get, every,
                    m=FREE)
    _check_accounting(proc)
    assert proc.seconds["waiting"] == 0 and proc.seconds["degraded"] == 0  # 4 nodes throughout
    # at 1050.5 s, after 10 saves of 1 s, step 1040.5: back to the step-1000 checkpoint
    assert proc.seconds["lost_work"] == pytest.approx(40.5)

    notice = simulate("trainmesh warm", cl, [Fault(1050.5, 1, "notice")], 3000.0, meshes.get, every,
                      m=FREE)
    _check_accounting(notice)
    assert notice.seconds["lost_work"] == 0 and notice.seconds["degraded"] > 0  # on 3 nodes

    hang = [Fault(1050.5, 1, "hang")]
    watched = simulate("trainmesh warm", cl, hang, 3000.0, meshes.get, every, m=FREE, hang_s=20.0,
                       collective_timeout_s=120.0)
    restart = simulate("restart", cl, hang, 3000.0, meshes.get, every, m=FREE, hang_s=20.0,
                       collective_timeout_s=120.0)
    assert watched.seconds["detection"] == pytest.approx(20.0)
    assert restart.seconds["detection"] == pytest.approx(120.0)
