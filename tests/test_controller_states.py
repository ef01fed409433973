"""The controller's state machine driven by a fake worker group (no Ray, no torch ranks):
the transitions a failure, a second failure while recovering, a broken re-form and a plan that
no longer fits take, and the pure decision after a stop. The same paths with real rank actors on
a simulated cluster: test_fault_matrix.py."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from ray.exceptions import RayActorError

from trainmesh.checkpoint.manifest import file_digests
from trainmesh.cli.loading import load_spec
from trainmesh.controller.controller import Controller
from trainmesh.controller.elastic import JobFailed
from trainmesh.controller.states import (
    FAILURE,
    PREEMPTION,
    SCALE_UP,
    Errored,
    Reforming,
    Scheduling,
    Stop,
    decide,
)
from trainmesh.planning.topology import Node, Topology, device_spec
from trainmesh.spec.job import ElasticConfig

_pids = itertools.count(1000)


class FakeCluster:
    """Nodes with accelerators, some dead; what happens before a step (``before_step``) or
    during the next re-form (``on_reform``) is scripted by the test."""

    def __init__(self, sizes: dict[str, int]):
        self.sizes, self.dead, self.dead_pids = dict(sizes), set(), set()
        self.before_step: dict[int, callable] = {}
        self.on_reform: list = []
        self.groups: list[FakeGroup] = []

    def topology(self, spec) -> Topology:
        return Topology(tuple(Node(n, a) for n, a in self.sizes.items() if n not in self.dead),
                        device_spec("cpu"))

    def factory(self, spec, dims, placement, env) -> FakeGroup:
        group = FakeGroup(self, placement)
        self.groups.append(group)
        return group

    def place(self, placement, ranks: list[int], taken: set[str]) -> dict[int, str]:
        """A node for each of ``ranks``' bundles: alive, large enough, not in ``taken``."""
        where, chosen = {}, {}
        for r in ranks:
            b = placement.rank_bundle[r]
            if b not in chosen:
                need = placement.rank_bundle.count(b)
                chosen[b] = next(n for n, a in self.sizes.items()
                                 if n not in self.dead | taken and a >= need)
                taken = taken | {chosen[b]}
            where[r] = chosen[b]
        return where


def rank_streams(rank: int, world: int) -> dict:
    """What a rank's ``save`` and ``memory_snapshot`` return of its random streams."""
    return {"coords": f"pp0.dp{rank}.cp0.tp0", "layout": {"dp": world}, "cpu": "", "device": None,
            "replica": ""}


class FakeGroup:
    """The worker group's interface over FakeCluster: ranks are (node, pid); a rank on a dead
    node is dead; every step's loss is a function of the step alone (any mesh agrees)."""

    def __init__(self, cluster: FakeCluster, placement):
        self.cluster, world = cluster, len(placement.rank_bundle)
        where = cluster.place(placement, list(range(world)), set())
        self.ranks = [(where[r], next(_pids)) for r in range(world)]
        self.step, self.aborts, self.preempt = 0, 0, {}

    @property
    def nodes(self) -> list[str]:
        return [n for n, _ in self.ranks]

    def _check(self) -> None:
        if any(n in self.cluster.dead or p in self.cluster.dead_pids for n, p in self.ranks):
            raise RayActorError()

    def rank_infos(self) -> list[dict]:
        return [{"node_id": n, "pid": p} for n, p in self.ranks]

    def readable_on_every_node(self, path: str, token: str) -> dict[str, bool]:
        return dict.fromkeys(self.nodes, True)

    def build(self, spec_json: str, dims, data_dir: str) -> None:
        self._check()
        self.step = 0  # a new engine: at step 0 until a checkpoint is loaded

    def bad_files(self, uri: str, files: dict) -> list[str]:
        return []

    def load(self, uri: str, step: int, rng) -> None:
        self._check()
        self.step = step

    def train_step(self) -> list[dict]:
        if self.step in self.cluster.before_step:
            self.cluster.before_step.pop(self.step)(self)
        self._check()
        self.step += 1
        return [{"loss": 10.0 / self.step, "lr": 1e-3, "grad_norm": 1.0, "save": None,
                 "preempted": self.preempt.get(r, False)} for r in range(len(self.ranks))]

    def train_segment(self, steps: int, until_s: float, on_step, between,
                      save_pending: bool = False) -> list[dict]:
        """As ``RayWorkerGroup.train_segment``: up to ``steps`` steps, ended at the step after a
        notice; the steps before the last handed to ``on_step`` (rank 0's), the last returned."""
        for i in range(steps):
            stats = [{**r, "step": self.step, "wall_s": 0.01} for r in self.train_step()]  # (after it)
            if i == steps - 1 or any(r["preempted"] for r in stats) or between():
                return stats
            on_step(stats[0])
        raise AssertionError("a segment of no steps")

    def save(self, uri: str, background: bool) -> list[dict]:
        self._check()
        self.uri = uri
        for r in range(len(self.ranks)):
            (Path(uri) / f"__{r}_0.distcp").write_bytes(bytes([r]) * 16)
        return [rank_streams(r, len(self.ranks)) for r in range(len(self.ranks))]

    def wait_save(self) -> list[None]:
        return [None] * len(self.ranks)

    def saved_files(self) -> dict:
        return file_digests(self.uri, [f"__{r}_0.distcp" for r in range(len(self.ranks))])

    def abort(self) -> None:
        self.aborts += 1

    def alive_ranks(self, timeout_s: float) -> set[int]:
        return {r for r, (n, p) in enumerate(self.ranks)
                if n not in self.cluster.dead and p not in self.cluster.dead_pids}

    def release_stuck(self, wait_s: float) -> list[int]:
        return []

    def reform(self, assignment, placement, timeout_s: float, refill=frozenset(),
               avoid=frozenset()) -> None:
        self.refilled = set(refill)
        kept = {r: self.ranks[o] if o not in refill else (self.ranks[o][0], next(_pids))
                for r, o in enumerate(assignment) if o is not None}
        fresh = [r for r, o in enumerate(assignment) if o is None]
        where = self.cluster.place(placement, fresh, {n for n, _ in kept.values()})
        self.ranks = [kept[r] if r in kept else (where[r], next(_pids))
                      for r in range(len(assignment))]
        if self.cluster.on_reform:  # a fault while the survivors re-form
            self.cluster.on_reform.pop(0)(self)

    def shutdown(self) -> None:
        pass


def _controller(tmp_path, cluster: FakeCluster, *overrides: str) -> Controller:
    spec = load_spec(None, ["model.preset=tiny", "runtime.device=cpu", "training.steps=6",
                            "training.global_batch_size=12", "training.microbatch_size=2",
                            "optimizer.warmup_steps=1",
                            "training.seq_len=32", "checkpoint.every=2",
                            "checkpoint.async_save=false", "checkpoint.keep_last=10",
                            "tracking.enabled=false", "elastic.max_restarts=3",
                            f"runtime.output_dir={tmp_path}", *overrides])
    ctl = Controller(spec.model_dump_json(), None, {}, group_factory=cluster.factory,
                     topology_fn=cluster.topology)
    ctl.trace = []
    advance = ctl._advance

    def traced(state, tracker):
        ctl.trace.append(state.name)
        return advance(state, tracker)

    ctl._advance = traced
    return ctl


def _kill(cluster: FakeCluster, node: str):
    return lambda group: cluster.dead.add(node)


def test_a_node_failure_is_recovered_warm_on_the_survivors(tmp_path):
    cluster = FakeCluster({"n0": 2, "n1": 2})
    cluster.before_step[3] = _kill(cluster, "n1")
    ctl = _controller(tmp_path, cluster, "parallelism.tp=2", "parallelism.dp=2")
    s = ctl.run()
    assert ctl.trace == ["scheduling", "restoring", "training", "recovering", "re-forming",
                         "restoring", "training"]
    assert s["status"] == "FINISHED" and s["steps_done"] == 6
    assert s["losses"] == pytest.approx([10.0 / k for k in range(1, 7)])
    (rec,) = s["recoveries"]
    assert rec["cause"] == "RayActorError" and rec["mode"] == "warm"
    assert rec["step"] == 2 and rec["steps_lost"] == 1
    assert rec["old_mesh"]["world_size"] == 4 and rec["new_mesh"]["world_size"] == 2
    (group,) = cluster.groups  # one group: the survivors were kept, none restarted
    assert group.aborts == 1 and set(group.nodes) == {"n0"}
    assert s["rank_pids"][-1] == s["rank_pids"][0][:2] and ctl.restarts == 1


def test_a_rank_process_dying_on_a_live_node_is_refilled_there(tmp_path):
    """A node is given up only when none of its ranks answers: rank 1's process dies beside
    rank 0, which answers, so n0 stays and a new process takes rank 1's place on it."""
    cluster = FakeCluster({"n0": 2, "n1": 2})
    ctl = _controller(tmp_path, cluster, "parallelism.tp=2", "parallelism.dp=2")
    cluster.before_step[3] = lambda group: cluster.dead_pids.add(group.ranks[1][1])
    s = ctl.run()
    assert s["status"] == "FINISHED" and s["steps_done"] == 6
    (rec,) = s["recoveries"]
    assert rec["mode"] == "warm" and rec["new_mesh"]["world_size"] == 4
    assert ctl.dead_nodes == set() and cluster.groups[0].refilled == {1}
    before, after = s["rank_pids"][0], s["rank_pids"][-1]
    assert len(set(before) & set(after)) == 3 and before[1] not in after


def test_a_tracking_server_out_of_reach_ends_the_job_before_training_naming_the_fix(tmp_path):
    """The MLflow run opens while the ranks start (it takes seconds); one that cannot be opened
    ends the job before its first step, with no restart."""
    cluster = FakeCluster({"n0": 2})
    ctl = _controller(tmp_path, cluster, "parallelism.dp=2", "tracking.enabled=true")
    ctl.tracking_uri = "http://127.0.0.1:9"
    with pytest.raises(JobFailed, match="tracking.uri: cannot open an MLflow run at http://127.0.0.1:9 .*"
                                        "start the tracking server, fix the URI"):
        ctl.run()
    assert ctl.trace == ["scheduling", "restoring"] and ctl.losses == [] and ctl.restarts == 0


def test_a_failure_before_any_checkpoint_starts_over_with_no_stale_losses(tmp_path):
    cluster = FakeCluster({"n0": 2, "n1": 2})
    cluster.before_step[1] = _kill(cluster, "n1")  # step 1 done, no checkpoint yet
    s = _controller(tmp_path, cluster, "parallelism.tp=2", "parallelism.dp=2").run()
    assert s["steps_done"] == 6 and s["losses"] == pytest.approx([10.0 / k for k in range(1, 7)])
    assert s["recoveries"][0]["step"] == 0 and s["recoveries"][0]["steps_lost"] == 1


def test_a_second_failure_while_re_forming_is_part_of_the_same_warm_recovery(tmp_path):
    cluster = FakeCluster({"n0": 2, "n1": 2, "n2": 2})
    cluster.before_step[3] = _kill(cluster, "n2")
    cluster.on_reform.append(lambda group: (cluster.dead.add("n1"), group._check()))
    ctl = _controller(tmp_path, cluster, "parallelism.tp=2", "parallelism.dp=3")
    s = ctl.run()
    assert ctl.trace == ["scheduling", "restoring", "training", "recovering", "re-forming",
                         "recovering", "re-forming", "restoring", "training"]
    assert s["status"] == "FINISHED" and s["steps_done"] == 6
    (rec,) = s["recoveries"]  # one recovery, timed from the first failure
    assert rec["cause"] == "RayActorError, then RayActorError" and rec["mode"] == "warm"
    assert rec["old_mesh"]["world_size"] == 6 and rec["new_mesh"]["world_size"] == 2
    assert len(cluster.groups) == 1 and set(cluster.groups[0].nodes) == {"n0"}
    assert ctl.restarts == 2  # each failure spent one restart
    assert ctl.dead_nodes == {"n1", "n2"}
    _assert_decide_split(rec)


def _assert_decide_split(rec: dict) -> None:
    """A recovery interrupted (by a second failure, or a warm attempt that broke): deciding is
    the interrupted attempts, then the last one's abort, stuck grace, health check and re-plan,
    one after the other."""
    p = rec["phases"]
    parts = [p.get(k) for k in ("interrupted_s", "abort_s", "stuck_s", "health_s", "plan_s")]
    assert None not in parts and min(parts) >= 0, p
    assert sum(parts) == pytest.approx(p["decide_s"], abs=0.01), p


def test_a_rank_lost_while_a_cold_restart_places_its_group_joins_that_recovery(tmp_path):
    """Cold restarts (elastic.warm_recovery=false): a node lost at step 3, then the group being
    placed for the restart loses a rank (placement raises): one recovery, whose last attempt had
    no group to abort, and whose decide still splits into its parts."""
    cluster = FakeCluster({"n0": 2, "n1": 2, "n2": 2})
    cluster.before_step[3] = _kill(cluster, "n2")
    factory, calls = cluster.factory, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the restart's placement: a rank died as it started
            raise RayActorError()
        return factory(*args, **kwargs)

    ctl = _controller(tmp_path, cluster, "parallelism.tp=2", "parallelism.dp=3",
                      "elastic.warm_recovery=false")
    ctl._group_factory = flaky
    s = ctl.run()
    assert ctl.trace == ["scheduling", "restoring", "training", "recovering", "scheduling",
                         "recovering", "scheduling", "restoring", "training"]
    (rec,) = s["recoveries"]
    assert rec["cause"] == "RayActorError, then RayActorError" and rec["mode"] == "cold"
    assert s["status"] == "FINISHED" and s["steps_done"] == 6
    _assert_decide_split(rec)


def test_a_re_form_that_breaks_falls_back_to_a_cold_restart(tmp_path):
    def broken(group):
        raise RuntimeError("reset failed in a way that is not a failure")

    cluster = FakeCluster({"n0": 2, "n1": 2})
    cluster.before_step[3] = _kill(cluster, "n1")
    cluster.on_reform.append(broken)
    ctl = _controller(tmp_path, cluster, "parallelism.tp=2", "parallelism.dp=2")
    s = ctl.run()
    assert ctl.trace == ["scheduling", "restoring", "training", "recovering", "re-forming",
                         "scheduling", "restoring", "training"]
    (rec,) = s["recoveries"]
    assert rec["mode"] == "cold" and s["steps_done"] == 6
    assert len(cluster.groups) == 2 and not set(s["rank_pids"][-1]) & set(s["rank_pids"][0])
    assert any("warm recovery failed (reset failed" in n for n in ctl.notices)
    _assert_decide_split(rec)  # the broken warm attempt is the interrupted one


def test_a_plan_that_no_longer_fits_ends_the_job_with_the_reason(tmp_path):
    # 3 accelerators stay, enough for elastic.min_world_size=3, but a TP group of 2 stays
    # whole inside a node: the node of one holds none, and tp2 × dp1 is below the minimum.
    cluster = FakeCluster({"n0": 2, "n1": 2, "n2": 1})
    cluster.before_step[3] = _kill(cluster, "n1")
    ctl = _controller(tmp_path, cluster, "parallelism.tp=2", "parallelism.dp=2",
                      "elastic.min_world_size=3")
    with pytest.raises(JobFailed, match="elastic.min_world_size") as err:
        ctl.run()
    assert "re-plan after a failure or resize found nothing" in str(err.value)
    assert ctl.trace[-2:] == ["recovering", "re-forming"]
    assert ctl._progress["state"] == "failed" and ctl.losses == pytest.approx([10.0, 5.0, 10 / 3])


def test_a_node_lost_re_plans_to_every_accelerator_left_even_an_uneven_dp(tmp_path):
    """dp 4 loses a node of one accelerator: the re-plan takes all 3 left, dp 3, both over a
    batch of 6 microbatches (shares of 2) and over one of 10 (shares 4, 3, 3), where dp had to
    divide the batch before and 2 of the 3 would have run."""
    for batch, dp_after in ((12, 3), (20, 3)):
        cluster = FakeCluster({"n0": 2, "n1": 1, "n2": 1})
        cluster.before_step[3] = _kill(cluster, "n2")
        out = tmp_path / str(batch)
        ctl = _controller(out, cluster, "parallelism.dp=4", f"training.global_batch_size={batch}",
                          f"runtime.output_dir={out}")
        s = ctl.run()
        assert s["status"] == "FINISHED" and s["steps_done"] == 6
        (rec,) = s["recoveries"]
        assert (rec["old_mesh"]["dp"], rec["new_mesh"]["dp"]) == (4, dp_after), rec


def test_too_few_accelerators_left_gives_up_before_re_forming(tmp_path):
    cluster = FakeCluster({"n0": 2, "n1": 2})
    cluster.before_step[3] = _kill(cluster, "n1")
    ctl = _controller(tmp_path, cluster, "parallelism.tp=2", "parallelism.dp=2",
                      "elastic.min_world_size=4")
    with pytest.raises(JobFailed, match="only 2 accelerators are left") as err:
        ctl.run()
    assert "lower elastic.min_world_size or add nodes" in str(err.value)
    assert ctl.trace[-1] == "recovering"
    import json

    summary = json.loads((tmp_path / "summary.json").read_text())  # written all the same
    assert summary["status"] == "FAILED" and summary["steps_done"] == 3


def test_a_preemption_notice_spends_no_restart_budget_even_at_zero(tmp_path):
    def notice(group):
        group.preempt = {3: True}  # rank 3 (on n1) was told its node goes

    cluster = FakeCluster({"n0": 2, "n1": 2})
    cluster.before_step[2] = notice
    ctl = _controller(tmp_path, cluster, "parallelism.tp=2", "parallelism.dp=2",
                      "elastic.max_restarts=0")
    s = ctl.run()
    (rec,) = s["recoveries"]
    assert rec["cause"] == "preemption" and rec["steps_lost"] == 0 and rec["step"] == 3
    assert ctl.restarts == 0 and ctl.dead_nodes == {"n1"} and s["steps_done"] == 6


def _stop(kind: str) -> Stop:
    return Stop(kind, kind, 4, {"world_size": 8}, 0.0, "boom")


def test_decide_after_a_stop():
    el = ElasticConfig(max_restarts=1, min_world_size=2)
    cold = el.model_copy(update={"warm_recovery": False})
    alive = frozenset({0, 1})
    d = decide(_stop(FAILURE), el, 0, 4, alive)
    assert d.next == Reforming(_stop(FAILURE), alive) and d.spends_restart and d.backoff_s == 0
    more = ElasticConfig(max_restarts=9, min_world_size=2)  # 2 failures without a step between
    assert decide(_stop(FAILURE), more, 4, 4, alive, in_a_row=2).backoff_s == 1.0
    assert isinstance(decide(_stop(FAILURE), el, 0, 4, frozenset()).next, Scheduling)
    assert isinstance(decide(_stop(FAILURE), cold, 0, 4, alive).next, Scheduling)
    assert "elastic.max_restarts" in decide(_stop(FAILURE), el, 1, 4, alive).next.report
    for kind in (PREEMPTION, SCALE_UP):  # no budget spent, no backoff, even when spent out
        d = decide(_stop(kind), el, 1, 4, alive)
        assert isinstance(d.next, Reforming) and not d.spends_restart and d.backoff_s == 0
    assert isinstance(decide(_stop(PREEMPTION), el, 0, 1, alive).next, Errored)
    later = _stop(FAILURE)
    both = _stop(PREEMPTION).then(later)
    assert both.kind == FAILURE and both.cause == "preemption, then failure" and both.at == 0.0


def test_a_straggler_is_judged_against_the_ranks_doing_the_same_work():
    """Pipeline stages differ in work: a last stage whose forward (with the head) is slower
    than the first's is no straggler, one of two ranks of a stage lagging the other is; a
    rank without the optional GPU utilisation does not break the metrics; the first step
    after a start is not judged."""
    from trainmesh.controller.hooks import breakdown_metrics

    def rank(forward, **extra):
        return {"breakdown": {"step_s": 1.0, "data_s": 0.0, "comm_s": 0.0, "bubble_s": 0.0,
                              "compute_s": 1.0, "forward_s": forward, **extra}}

    stages = [0, 0, 1, 1]
    even = [rank(0.2), rank(0.2, gpu_utilization=90.0), rank(0.6), rank(0.6)]
    metrics, straggler = breakdown_metrics(even, stages)
    assert straggler is None and metrics["system/gpu_utilization"] == 90.0
    assert metrics["step/forward_s_max"] == 0.6 and metrics["rank2/forward_s"] == 0.6
    lagging = [rank(0.2), rank(0.2), rank(0.6), rank(1.2)]  # 1.2 > 0.9 (the median) × 1.25
    assert breakdown_metrics(lagging, stages)[1] == {"rank": 3, "forward_s": 1.2,
                                                     "median_forward_s": pytest.approx(0.9)}
    assert breakdown_metrics(lagging, stages, judge=False)[1] is None


def test_rays_worker_death_notices_stay_off_the_console_while_jobs_run(capsys):
    """While jobs run (however many, overlapping), Ray's driver-side notice of a worker process
    it lost is not printed (trainmesh prints its own recovery line), every other line Ray prints
    is, and Ray's printer is itself again once the last job ends."""
    from ray._private import worker

    from trainmesh.controller.launch import WORKER_DEATH, worker_deaths_logged_not_printed

    original = worker.print_to_stdstream  # (what the wrapping needs of Ray is there)

    def say(text: str) -> None:
        worker.print_to_stdstream({"lines": [text], "pid": "raylet", "is_err": False},
                                  ignore_prefix=False)

    with worker_deaths_logged_not_printed():
        with worker_deaths_logged_not_printed():  # a second job in the same process
            say(f"{WORKER_DEATH} while executing a task by an unexpected system error.")
        say(f"{WORKER_DEATH} after the second job ended.")
        say("Some other notice from the raylet.")
    assert worker.print_to_stdstream is original
    out = capsys.readouterr().out
    assert WORKER_DEATH not in out and "Some other notice from the raylet." in out
    say(f"{WORKER_DEATH} with no job running.")
    assert WORKER_DEATH in capsys.readouterr().out
