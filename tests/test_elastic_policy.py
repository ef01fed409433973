"""The elastic policy is pure: decisions from numbers, reports from errors."""

from __future__ import annotations

import pytest

from trainmesh.controller.elastic import (
    GiveUp,
    Retry,
    bounded_topology,
    failure_report,
    on_failure,
    on_preemption,
    ready_nodes,
    should_scale_up,
    warm_assignment,
)
from trainmesh.planning.topology import Node, Topology
from trainmesh.spec.job import ElasticConfig


def test_retry_with_growing_backoff_until_the_restart_budget_is_spent():
    cfg = ElasticConfig(min_world_size=2, max_restarts=3)
    waits = [on_failure(cfg, n, available=4, errors=["x"]) for n in range(3)]
    assert all(isinstance(w, Retry) for w in waits)
    assert [w.backoff_s for w in waits] == sorted(w.backoff_s for w in waits)
    final = on_failure(cfg, 3, available=4, errors=["x"])
    assert isinstance(final, GiveUp) and "elastic.max_restarts" in final.report
    # the backoff follows failures in a row: a failure after steps went well again retries
    # at once, however many came before
    assert on_failure(cfg, 2, available=4, errors=["x"], in_a_row=0).backoff_s == 0.0
    assert waits[0].backoff_s == 0.0 and waits[2].backoff_s > 0


def test_below_minimum_gives_up_naming_the_knob():
    d = on_failure(ElasticConfig(min_world_size=8), 0, available=4, errors=["boom"])
    assert isinstance(d, GiveUp)
    assert "elastic.min_world_size=8" in d.report and "add nodes" in d.report


def test_preemption_spends_no_restart_budget():
    cfg = ElasticConfig(min_world_size=4, max_restarts=0)
    assert on_preemption(cfg, available=4, notice="drain") == Retry(backoff_s=0.0)
    below = on_preemption(cfg, available=3, notice="drain")
    assert isinstance(below, GiveUp) and "elastic.min_world_size=4" in below.report


def test_report_groups_identical_rank_errors():
    errs = ["Traceback...\nRuntimeError: Connection closed by peer"] * 3 + ["ActorDiedError"]
    text = failure_report(errs, "verdict")
    assert text.splitlines()[0] == "verdict"
    assert "3 rank(s): RuntimeError: Connection closed by peer" in text
    assert "1 rank(s): ActorDiedError" in text


def test_bounded_topology_drops_dead_nodes_and_caps_the_world():
    topo = Topology.uniform(3, 4, "h100")
    alive = bounded_topology(topo, ElasticConfig(), {"node-1"})
    assert [n.node_id for n in alive.nodes] == ["node-0", "node-2"] and alive.world_size == 8
    capped = bounded_topology(topo, ElasticConfig(max_world_size=6), set())
    assert capped.world_size == 6


def test_scale_up_only_to_more_usable_accelerators():
    assert should_scale_up(4, 8, ElasticConfig())
    assert not should_scale_up(4, 8, ElasticConfig(max_world_size=4))
    assert not should_scale_up(8, 8, ElasticConfig())


def test_warm_assignment_keeps_a_bundle_on_one_surviving_node():
    # 8 old ranks, 4 per node; node B died. New plan: 4 ranks in one bundle.
    nodes = ["A"] * 4 + ["B"] * 4
    assert warm_assignment((0, 0, 0, 0), nodes, alive={0, 1, 2, 3}) == [0, 1, 2, 3]
    # Node A died instead: the survivors of B become ranks 0..3, in order.
    assert warm_assignment((0, 0, 0, 0), nodes, alive={4, 5, 6, 7}) == [4, 5, 6, 7]
    # Two bundles of 2 from 3 nodes with 3, 2 and 1 survivors: never split a bundle.
    nodes3 = ["A"] * 3 + ["B"] * 3 + ["C"] * 3
    keep = warm_assignment((0, 0, 1, 1), nodes3, alive={0, 1, 2, 3, 4, 6})
    assert len(keep) == 4 and len(set(keep)) == 4
    assert nodes3[keep[0]] == nodes3[keep[1]] and nodes3[keep[2]] == nodes3[keep[3]]
    assert nodes3[keep[0]] != nodes3[keep[2]]


def test_warm_assignment_starts_new_actors_only_for_bundles_no_survivor_holds():
    nodes = ["A"] * 4 + ["B"] * 4
    # Scale-up from node A's 4 ranks to 8 ranks on 2 nodes: A's actors keep bundle 0.
    assert warm_assignment((0, 0, 0, 0, 1, 1, 1, 1), nodes[:4], alive={0, 1, 2, 3}) == [
        0, 1, 2, 3, None, None, None, None]
    # A node died and a spare one joined: survivors keep their bundle, the other is new.
    assert warm_assignment((0, 0, 0, 0, 1, 1, 1, 1), nodes, alive={4, 5, 6, 7}) == [
        4, 5, 6, 7, None, None, None, None]
    # 4 survivors spread 2 + 2 cannot hold one bundle of 4 (TP group of 4 on one node): no
    # survivor is kept, so the restart is cold.
    assert warm_assignment((0, 0, 0, 0), nodes, alive={0, 1, 4, 5}) is None


def test_warm_assignment_refills_the_places_of_ranks_killed_on_a_node_that_is_fine():
    nodes = ["A"] * 4 + ["B"] * 4
    # Node B died; on A, rank 2 was stuck in a collective and killed: A still holds the bundle,
    # rank 2's place taken by a new actor (its old rank given, to say whose reservation).
    assert warm_assignment((0, 0, 0, 0), nodes, alive={0, 1, 3}, refill={2}) == [0, 1, 3, 2]
    # Survivors first: a node with only refillable places is not chosen for a bundle.
    assert warm_assignment((0, 0, 0, 0), nodes, alive=set(), refill={4, 5, 6, 7}) is None
    # Without the refill, A's 3 survivors cannot hold a bundle of 4: cold.
    assert warm_assignment((0, 0, 0, 0), nodes, alive={0, 1, 3}) is None


def _seen(step: int, fwd: int, bwd: int = 0, idle_s: float = 5.0) -> dict:
    return {"step": step, "phase": "forward", "counts": {"forward": fwd, "backward": bwd,
                                                         "optimizer": 0, "save": 0}, "idle_s": idle_s}


def test_hung_ranks_are_the_silent_ones_or_those_behind_when_nothing_moves():
    from trainmesh.actors.worker_group import stalled

    a = [_seen(3, 4, 2), _seen(3, 4, 2), _seen(3, 3, 1), _seen(3, 4, 2)]
    every = {0, 1, 2, 3}
    assert stalled(a, every, quiet_s=4) == [2]  # the others wait for rank 2
    assert stalled([*a[:3], None], every, quiet_s=4) == [3]  # frozen: no answer
    moved = [_seen(3, 4, 3, idle_s=0.5), *a[1:]]
    assert stalled(moved, every, quiet_s=4) == []  # someone still works
    assert stalled(a, every, quiet_s=6) == []  # a long phase, not yet a hang
    assert stalled(a, {0, 1, 3}, quiet_s=4) == [0, 1, 3]  # a collective stuck with no culprit
    assert stalled(a, set(), quiet_s=4) == []  # every rank returned meanwhile
    # a restore, a build, a save (one long phase, progress not counted): only silence counts
    assert stalled(a, every, quiet_s=4, silent_only=True) == []
    assert stalled([*a[:3], None], every, quiet_s=4, silent_only=True) == [3]


def test_hang_bound_from_recent_steps_with_a_floor_or_the_spec():
    from trainmesh.controller.ray_group import HANG_FLOOR_S, hang_bound_s, liveness_bound_s

    assert hang_bound_s(ElasticConfig(), [1.0, 2.0]) is None  # too few steps measured
    assert hang_bound_s(ElasticConfig(), [1.0, 2.0, 3.0]) == HANG_FLOOR_S
    assert hang_bound_s(ElasticConfig(), [10.0, 20.0, 30.0]) == 200.0
    assert hang_bound_s(ElasticConfig(hang_timeout_s=4), []) == 4
    # outside a timed step, silence: the spec's bound or the floor, found before peers time out
    assert liveness_bound_s(ElasticConfig(), 120) == HANG_FLOOR_S
    assert liveness_bound_s(ElasticConfig(hang_timeout_s=4), 120) == 4
    assert liveness_bound_s(ElasticConfig(), 60) == 30


def test_the_fault_hook_parses_strictly_fires_once_and_only_where_placed(tmp_path):
    import json

    from trainmesh.actors.progress import Progress
    from trainmesh.testing.faults import FAULT_ENV, Fault, FaultListener, InjectedFault

    with pytest.raises(ValueError, match=FAULT_ENV):
        Fault.parse("hang@rank=1,step=2")  # no phase, no marker
    with pytest.raises(ValueError, match="phase one of"):
        Fault.parse(f"raise@rank=1,step=2,phase=sideways,marker={tmp_path / 'm'}")
    faults = Fault.parse(f"raise@rank=1,step=2,phase=backward,marker={tmp_path / 'm'};"
                         f" raise@rank=0,phase=reform,marker={tmp_path / 'r'}")

    def rank(r: int) -> Progress:  # as a FaultyRank's: the faults listen to its phases
        p = Progress(rank=r)
        p.listeners.append(FaultListener(faults))
        return p

    other, mine = rank(0), rank(1)
    for p in (other, mine):
        p.step = 2
        p.mark("forward")
    other.mark("backward")  # another rank: nothing
    with pytest.raises(InjectedFault):
        mine.mark("backward")
    assert mine.snapshot()["counts"]["backward"] == 1
    assert json.loads((tmp_path / "m").read_text())["pid"] > 0  # where it fired
    again = rank(1)  # a restarted rank: the marker says it fired already
    again.step = 2
    again.mark("backward")
    mine.rank = 0  # a re-form made it rank 0: the fault placed at rank 0, any step, fires
    mine.step = 7
    with pytest.raises(InjectedFault):
        mine.mark("reform")
    # a hold blocks the rank until its release file appears, then the rank goes on
    import threading

    held = Progress(rank=0)
    held.listeners.append(FaultListener(Fault.parse(
        f"hold@rank=0,step=3,phase=restore,marker={tmp_path / 'h'}")))
    held.step = 3
    t = threading.Thread(target=held.mark, args=("restore",), daemon=True)
    t.start()
    try:
        t.join(0.5)
        assert t.is_alive() and (tmp_path / "h").exists()  # fired, and held there
        assert held.snapshot()["phase"] == "restore"  # answering while held (not silent)
    finally:
        (tmp_path / "h.go").touch()
    t.join(5)
    assert not t.is_alive() and held.snapshot()["counts"]["restore"] == 1
    assert Progress(rank=1).listeners == []  # a product rank carries no fault


def test_ready_processes_default_to_a_nodes_ranks_on_accelerators_and_one_on_cpu_clusters():
    from trainmesh.cli.loading import load_spec
    from trainmesh.controller.ray_group import ready_pool
    from trainmesh.parallel.layout import Placement

    # 8 ranks: 4 on each of 2 nodes
    placement = Placement(({"GPU": 4.0}, {"GPU": 4.0}), (0, 0, 0, 0, 1, 1, 1, 1), {"GPU": 1.0})
    assert ready_pool(load_spec(None, []), {}, placement, accelerators=True).per_node == 4
    assert ready_pool(load_spec(None, []), {}, placement, accelerators=False).per_node == 1
    assert ready_pool(load_spec(None, []), {}, placement, False, nodes=1) is None  # one machine
    spec = load_spec(None, ["elastic.ready_ranks_per_node=3"])
    assert ready_pool(spec, {}, placement, accelerators=True).per_node == 3
    assert ready_pool(load_spec(None, ["elastic.ready_ranks_per_node=0"]), {}, placement, True) is None


def test_ready_processes_stay_on_the_jobs_nodes_and_as_many_spares_as_replace_one_node():
    """The job's nodes, then spares until they hold one node's ranks: those already holding
    ready processes first (a fill does not move them), then the largest; none on the rest."""
    alive = [Node("a", 4), Node("b", 4), Node("c", 2), Node("d", 4), Node("e", 2), Node("f", 8)]
    ranks_on = ["a"] * 4 + ["b"] * 4
    assert ready_nodes(alive, ranks_on, set()) == ["a", "b", "f"]
    assert ready_nodes(alive, ranks_on, {"c", "e"}) == ["a", "b", "c", "e"]  # 2 + 2 hold 4
    assert ready_nodes(alive, ranks_on, {"d", "c"}) == ["a", "b", "d"]
    assert ready_nodes(alive, ["a", "a"], set()) == ["a", "f"]
    assert ready_nodes(alive[:2], ranks_on, set()) == ["a", "b"]  # no spare left
    assert ready_nodes(alive, [], set()) == []


def test_a_recovery_interrupted_by_a_failure_times_its_last_attempt_apart(monkeypatch):
    """A failure while recovering joins the recovery (one downtime, from the first failure):
    the interrupted attempt's time is ``interrupted_s``, the last attempt's abort is timed from
    the interruption (not from the first failure), and deciding's parts add up to it."""
    from trainmesh.controller import recovery
    from trainmesh.controller.recovery import RecoveryBook
    from trainmesh.controller.states import FAILURE, Stop

    now = [100.0]
    monkeypatch.setattr(recovery.time, "time", lambda: now[0])
    book, mesh = RecoveryBook(), {"world_size": 4}
    first = Stop(FAILURE, "RuntimeError", 3, mesh, at=0.0)
    book.begin(book.joined(first))
    for phase, dt in (("aborted", 0.5), ("released", 0.1), ("checked", 0.1), ("planned", 0.3),
                      ("group", 3.0)):
        now[0] += dt
        book.mark(phase)
    now[0] += 2.0  # restoring, when another node goes
    book.begin(book.joined(Stop(FAILURE, "ActorUnavailableError", 3, mesh, at=6.0)))
    for phase, dt in (("aborted", 0.6), ("released", 0.0), ("checked", 0.1), ("planned", 0.2),
                      ("group", 2.0), ("built", 0.25), ("restored", 0.75)):
        now[0] += dt
        book.mark(phase)
    now[0] += 0.5
    rec = book.complete(book.open, 2, mesh, "warm")
    p = rec.phases
    assert rec.cause == "RuntimeError, then ActorUnavailableError"
    assert p["interrupted_s"] == pytest.approx(6.0) and p["abort_s"] == pytest.approx(0.6)
    assert p["decide_s"] == pytest.approx(6.9) and p["reform_s"] == pytest.approx(2.0)
    parts = ("interrupted_s", "abort_s", "stuck_s", "health_s", "plan_s")
    assert sum(p[k] for k in parts) == pytest.approx(p["decide_s"])
    assert (p["restore_s"], p["first_step_s"]) == pytest.approx((1.0, 0.5))
    assert (p["build_s"], p["load_s"]) == pytest.approx((0.25, 0.75))


def test_a_recovery_and_a_resize_are_one_console_line_each():
    """What the person running the job sees as it happens (it was only in summary.json)."""
    from trainmesh.controller.elastic import Recovery

    lost = Recovery(step=4, cause="RayActorError", downtime_s=6.23, steps_lost=1, mode="warm",
                    old_mesh={"pp": 2, "dp": 2, "tp": 2, "world_size": 8, "ep": 2},
                    new_mesh={"pp": 2, "dp": 1, "tp": 2, "world_size": 4}, restored_from="memory")
    assert lost.line() == ("recovered from a lost rank (its process or node gone): tp2·pp2·dp2·ep2 "
                           "(8 ranks) → tp2·pp2·dp1 (4 ranks), warm, step 4 restored from peers' "
                           "in-memory snapshots, 1 step(s) lost, 6.2 s without training")
    grown = Recovery(step=20, cause="scale-up", downtime_s=11.0, steps_lost=0, mode="cold",
                     old_mesh={"pp": 1, "dp": 2, "tp": 1, "world_size": 2},
                     new_mesh={"pp": 1, "dp": 4, "tp": 1, "world_size": 4})
    assert grown.line() == ("resized onto the nodes that joined: dp2 (2 ranks) → dp4 (4 ranks), "
                            "cold, step 20 restored from its checkpoint in storage, 11.0 s without "
                            "training")
    both = Recovery(**{**grown.as_dict(), "cause": "scale-up, then preemption"})  # (Stop.then)
    assert both.line().startswith("resized (scale-up, then preemption): dp2 (2 ranks) → ")
    assert "lost" not in both.line()
