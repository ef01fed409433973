"""The controller: owns the plan, the rank actors, checkpoints, tracking and the run summary.

It runs as a Ray actor (``max_concurrency > 1`` so ``progress()`` answers while ``run()``
works). The worker group is injected through a factory so the loop can be driven by fakes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from trainmesh.actors.worker_group import HangDetected, PlacementTimeout
from trainmesh.parallel.dims import ParallelDims
from trainmesh.platform.boundary import StepBoundary
from trainmesh.platform.cadence import CheckpointCadence
from trainmesh.platform.checkpointing import Checkpointer, step_meta
from trainmesh.platform.elastic import (
    JobFailed,
    Recovery,
    bounded_topology,
    recovery_phases,
    warm_assignment,
)
from trainmesh.platform.evaluation import Evaluator, evaluate_once
from trainmesh.platform.failure_costs import predicted_save
from trainmesh.platform.job_plan import PlanError, plan_for
from trainmesh.platform.memory_tier import MemoryTier, restore_newest
from trainmesh.platform.pipeline_artifacts import write_pipeline_artifacts
from trainmesh.platform.ray_group import RayWorkerGroup, draining_nodes, live_topology, placement_for
from trainmesh.platform.run_files import (
    controller_node_id,
    data_dir,
    make_tracker,
    step_metrics,
    write_json_atomically,
)
from trainmesh.platform.states import (
    FAILURE,
    PREEMPTION,
    SCALE_UP,
    Errored,
    Finished,
    Recovering,
    Reforming,
    Restoring,
    Running,
    Scheduling,
    State,
    Stop,
    decide,
)
from trainmesh.platform.topology import Topology
from trainmesh.spec.job import JobSpec

# What a recovery handles: a rank's actor died, a rank's step raised (a peer's death surfaces
# as a collective error), a step overran its timeout, ranks hung, or no placement could be made.
RECOVERABLE = (RayActorError, RayTaskError, GetTimeoutError, PlacementTimeout, HangDetected)
STUCK_S = 2.0  # after an abort, how long a rank may take to leave the failed call
ALIVE_S = 3.0  # how long a live rank may take to answer on its control path


class Controller:
    def __init__(self, spec_json: str, tracking_uri: str | None, worker_env: dict[str, str],
                 group_factory: Callable[..., Any] | None = None,
                 topology_fn: Callable[[JobSpec], Topology] | None = None):
        self.spec = JobSpec.model_validate_json(spec_json)
        self.out = Path(self.spec.resolved_output_dir())
        self.ckpts = Checkpointer(self.spec, self.out, on_warning=self._notice)
        self.cadence = CheckpointCadence(self.spec.checkpoint, self.spec.elastic)
        self.ckpts.on_commit = self.cadence.saved
        self.tracking_uri, self.worker_env = tracking_uri, worker_env
        self._group_factory = group_factory or RayWorkerGroup
        self._topology_fn = topology_fn or live_topology
        self.plan_row, self.peak_tflops = {}, 1.0
        self.rank_nodes: list[str] = []
        self._progress: dict[str, Any] = {"state": "starting", "step": 0,
                                          "steps": self.spec.training.steps}
        self.notices: list[str] = []  # warnings for the person running the job
        self.pid_history: list[list[int]] = []  # the ranks' processes, per (re)start
        self._marks: dict[str, float] = {}  # wall times of the current recovery's phases
        self.losses: list[float] = []
        self.recoveries: list[dict[str, Any]] = []
        self.dead_nodes: set[str] = set()
        self.group = None  # the rank actors (the injected worker group)
        self.restarts = self.in_a_row = 0  # failures retried: in all, since a step completed
        self._open: Stop | None = None  # the stop being recovered from, until its first step
        self.dims = ParallelDims()
        self.eff = self.spec  # the spec with the current plan written in
        self.boundary = StepBoundary(self.spec, self._available)
        self.evals = Evaluator(self.spec)
        self.memory, self.restored_from = MemoryTier(self.spec.checkpoint.in_memory.every), "none"

    # -- public ----------------------------------------------------------------------------
    def progress(self) -> dict[str, Any]:  # where the run is, every notice so far (the driver prints new ones)
        return {**self._progress, "notices": list(self.notices)}

    def _notice(self, text: str) -> None:
        self.notices.append(text)

    def run(self) -> dict[str, Any]:
        self.out.mkdir(parents=True, exist_ok=True)
        resume = self.ckpts.latest()
        run_id = resume[1].get("mlflow_run_id") if resume else None
        tracker = make_tracker(self.spec, self.tracking_uri, run_id, self._notice)
        status = "FAILED"
        try:
            tracker.log_params(json.loads(self.spec.model_dump_json()))
            tracker.log_dict(json.loads(self.spec.model_dump_json()), "spec.json")
            self._run_with_recovery(tracker)
            status = "FINISHED"
        finally:
            summary = self._write_summary(self.dims, tracker, status)
            tracker.log_artifact(self.out / "summary.json")
            tracker.finish(status)
            self._set(state=status.lower())
        return summary

    def dry_run(self, step: bool) -> list[dict]:  # memory per rank beside the plan: dry_run.py
        from trainmesh.platform.dry_run import measure, memory_rows

        group = self._place(replan=False)
        try:
            reports = measure(group, self.eff.model_dump_json(), self.dims, data_dir(self.spec, self.out), step)
        finally:
            group.shutdown()
        return memory_rows(reports, self.eff, self.candidate, self.dims, self.device, step)

    def evaluate(self) -> dict[str, Any]:  # `trainmesh eval`: evaluation.py
        return evaluate_once(self)

    def _run_with_recovery(self, tracker) -> None:
        """The state machine of ``platform/states.py``, from SCHEDULING to FINISHED (or
        ERRORED: ``JobFailed`` with the report)."""
        state: State = Scheduling()
        try:
            while not isinstance(state, Finished):
                if isinstance(state, Errored):
                    raise JobFailed(state.report)
                self._set(state=state.name)
                state = self._advance(state, tracker)
        finally:
            self._drop()

    def _advance(self, state: State, tracker) -> State:
        """Run ``state``'s action. A failure in it (a rank's actor died; a step raised, hung
        or overran; no placement) is a stop: RECOVERING, as part of the recovery still open
        if there is one; a job that cannot go on (nothing to plan, storage not shared) ERRORED."""
        action = {Scheduling: self._schedule, Reforming: self._reform, Restoring: self._build_and_restore,
                  Running: self._running, Recovering: self._recover}[type(state)]
        try:
            return action(state, tracker)
        except RECOVERABLE as err:
            stop = Stop(FAILURE, type(err).__name__, len(self.losses), self.dims.as_dict(),
                        time.monotonic(), str(err))
            return Recovering(self._open.then(stop) if self._open else stop)
        except JobFailed as err:
            return Errored(str(err))

    def _schedule(self, state: Scheduling, tracker) -> State:  # cold: new rank actors for the plan
        self._drop()
        self.group = self._place(replan=state.stop is not None)
        return Restoring(state.stop, "cold")

    def _reform(self, state: Reforming, tracker) -> State:
        """Warm: the survivors take the new plan's ranks (new actors only for accelerators no
        survivor holds); cold instead when none can be kept or the re-form breaks other than
        by a rank's death (that is a stop: recover again, keeping whom we can)."""
        topo = self._plan(replan=True)
        placement = placement_for(self.eff, self.dims, topo)
        assignment = warm_assignment(placement.rank_bundle, self.group.nodes, set(state.alive),
                                     set(state.refill))
        if assignment is None:
            self._notice(f"warm recovery: the {len(state.alive)} surviving ranks cannot hold any "
                         f"part of the new plan {self.dims.as_dict()}; restarting every rank")
            return Scheduling(state.stop)
        try:
            self.group.reform(assignment, placement, timeout_s=self.spec.runtime.collective_timeout_s * 2 + 30,
                              refill=set(state.refill) & set(assignment),
                              avoid=self.dead_nodes | set(draining_nodes()))
        except RayActorError:  # a rank died while re-forming: recover again, warm if we can
            raise
        except Exception as err:  # noqa: BLE001 - survivors stuck in a collective, or else: cold
            self._notice(f"warm recovery failed ({str(err).strip().splitlines()[-1][:200]}); "
                         "restarting every rank")
            tracker.event("warm-recovery-failed", error=str(err)[-2000:])
            return Scheduling(state.stop)
        self._marks["group"] = time.time()
        return Restoring(state.stop, "warm")

    def _build_and_restore(self, state: Restoring, tracker) -> State:
        start = self._prepare(self.group, tracker)
        self._marks["restored"] = time.time()
        return Running(start, state.stop, state.mode)

    def _running(self, state: Running, tracker) -> State:
        on_first = None
        if state.stop is not None:
            def on_first():
                self._record_recovery(tracker, state.stop, state.start, state.mode)
        stop = self._train(self.group, self.dims, tracker, state.start, on_first)
        if stop is not None:
            return Recovering(stop)
        for path in write_pipeline_artifacts(self.out, self.eff, self.dims, self.group):
            tracker.log_artifact(path)
        return Finished()

    def _recover(self, state: Recovering, tracker) -> State:
        """Who survived ``state.stop`` (a failure: after every survivor aborted its
        communicators, out of band), which nodes are gone, and the policy's decision."""
        stop, group = state.stop, self.group
        self._marks, self._open = (self._marks if self._open else {"failed": time.time()}), stop
        nodes, refill = (group.nodes if group is not None else []), set()
        if stop.kind == SCALE_UP:  # checkpointed already; every rank is kept when warm
            alive = set(range(len(nodes)))
        elif stop.kind == PREEMPTION:  # checkpointed already; the notified nodes are going
            leaving = {nodes[r] for r in stop.ranks}
            self.dead_nodes |= leaving
            alive = {r for r in self._alive(group) if nodes[r] not in leaving}
            tracker.event("preemption", step=stop.step, ranks=list(stop.ranks),
                          nodes=sorted(leaving))
        else:
            stuck: set[int] = set()
            if group is not None:  # survivors leave their collectives now, not at the timeout
                group.abort()      # (and any background save with them); those no abort frees
                stuck = set(group.release_stuck(STUCK_S))  # are killed, their places refilled
            answered = self._alive(group)  # (asked with the abort: stuck ones answer too)
            alive, gone = answered - stuck, set(range(len(nodes))) - answered
            # a node is gone when none of its ranks answers; a rank dead beside ones that do
            # (its process killed: OOM, a crash) leaves a place its node can refill
            self.dead_nodes |= {nodes[r] for r in gone} - {nodes[r] for r in answered}
            refill = {r for r in stuck | gone if nodes[r] not in self.dead_nodes}
            tracker.event("failure", cause=stop.cause, step=stop.step, stuck=sorted(stuck),
                          dead_nodes=sorted(self.dead_nodes), error=stop.detail[-2000:])
        decision = decide(stop, self.spec.elastic, self.restarts, self._available().world_size,
                          frozenset(alive), frozenset(refill), self.in_a_row)
        if not isinstance(decision.next, Reforming):
            self._drop()
        self.restarts += decision.spends_restart
        self.in_a_row += decision.spends_restart
        time.sleep(decision.backoff_s)
        return decision.next

    def _drop(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None

    def _available(self) -> Topology:
        """The accelerators the job may use now: not on a dead node, nor on one being drained."""
        gone = self.dead_nodes | set(draining_nodes())
        return bounded_topology(self._topology_fn(self.spec), self.spec.elastic, gone)

    def _plan(self, replan: bool) -> Topology:
        """Plan (or re-plan) for the accelerators alive now; returns that topology."""
        topo = self._available()
        try:
            new = plan_for(self.spec, topo, replan)
        except PlanError as err:
            if not replan:
                raise
            raise JobFailed(f"re-plan after a failure or resize found nothing: {err}") from None
        self.dims, result, self.eff = new.dims, new.result, new.spec
        if new.changed:
            self._notice(f"re-plan: {new.changed}")
        self.peak_tflops = topo.device.peak_tflops
        self.device, self.candidate = topo.device, result.best.candidate
        self.plan_row = result.best.as_row()
        if result.best.idle and (replan or self.spec.parallelism.auto):  # pinned: as asked
            self._notice(f"plan: {self.dims.world_size} of {topo.world_size} accelerators used, "
                         f"{result.best.idle} left idle as spares")
        self._marks["planned"] = time.time()
        return topo

    def _place(self, replan: bool):
        """Cold: place a new group of rank actors for the plan."""
        topo = self._plan(replan)
        self._set(state="placing")
        group = self._group_factory(self.eff, self.dims, placement_for(self.eff, self.dims, topo),
                                    self.worker_env)
        self._marks["group"] = time.time()
        return group

    def _prepare(self, group, tracker) -> int:
        """Build the ranks' model parts for the plan and restore the newest complete
        checkpoint; returns the step to start from."""
        infos = group.rank_infos()
        self.rank_nodes = [i["node_id"] for i in infos]
        if set(self.rank_nodes) - {controller_node_id()}:  # ranks elsewhere: storage must be shared
            self.ckpts.check_shared(group)
        self.pid_history.append([i["pid"] for i in infos])  # warm recovery keeps processes
        tracker.log_dict({**self.dims.as_dict(), "plan": self.plan_row,
                          "rank_to_node": self.rank_nodes}, "mesh.json")
        self._set(state="building")
        self.ckpts.forget()  # a save in flight when the job stopped never counts
        group.build(self.eff.model_dump_json(), self.dims, data_dir(self.spec, self.out))
        if (failed := tracker.opened()) is not None:  # (it opened while the ranks started)
            raise JobFailed(failed)
        start = self._resume(group, tracker)
        tracker.event("start", step=start, mesh=self.dims.as_dict())
        return start

    def _record_recovery(self, tracker, stop: Stop, start: int, mode: str) -> None:
        m = {**self._marks, "first_step": time.time()}
        rec = Recovery(step=start, cause=stop.cause, old_mesh=stop.mesh,
                       new_mesh=self.dims.as_dict(), downtime_s=time.monotonic() - stop.at,
                       steps_lost=max(0, stop.step - start), mode=mode, restored_from=self.restored_from,
                       failed_at=m.get("failed", 0.0), phases=recovery_phases(m))
        self._open, self.in_a_row = None, 0
        self.recoveries.append(rec.as_dict())
        tracker.event("recovery", **rec.as_dict())
        tracker.log_metrics({"recovery_downtime_s": rec.downtime_s,
                             "recovery_steps_lost": rec.steps_lost}, step=start)

    def _alive(self, group) -> set[int]:  # those that answer (busy ones too: out of band)
        return set() if group is None else group.alive_ranks(timeout_s=ALIVE_S)

    # -- steps -----------------------------------------------------------------------------
    def _train(self, group, dims: ParallelDims, tracker, start: int,
               on_first_step: Callable[[], None] | None = None) -> Stop | None:
        """Steps from ``start`` to the end (None) or to a stop at a step boundary: a preemption
        notice or a scale-up, each checkpointed first; ``on_first_step`` runs once the first
        step is done (a recovery is complete, and measured, only then)."""
        tr, metrics_of = self.spec.training, step_metrics(self.spec, dims.world_size * self.peak_tflops)
        nodes = len(set(self.rank_nodes))
        self.cadence.start(start, nodes, predicted_save(self.spec.model, dims.tp, dims.pp, dims.dp,
                                                        nodes, self.spec.checkpoint.async_save))
        self._set(state="training", step=start)
        for step in range(start, tr.steps):
            t0 = time.perf_counter()
            stats = group.train_step()
            dt = time.perf_counter() - t0
            self.losses.append(stats[0]["loss"])
            self.ckpts.poll(group, [s.get("save") for s in stats], tracker)
            metrics = metrics_of(stats[0], dt)
            tracker.log_metrics(metrics, step=step + 1)
            self.cadence.stepped(step + 1, dt, tracker)
            self._set(step=step + 1, loss=metrics["loss"], tokens_per_s=metrics["tokens_per_s"])
            if on_first_step is not None:
                on_first_step()
                on_first_step = None
            last = step + 1 == tr.steps
            if self.evals.due(step + 1, last):
                self._set(eval_loss=self.evals.run(group, step + 1, tracker))
            notified = self.boundary.notified(stats, self.rank_nodes)
            if notified and not last:  # checkpoint now, then let those ranks go
                self._notice(f"preemption notice for rank(s) {notified} after step {step + 1}: "
                             "checkpointing, then continuing without their node(s)")
                self._checkpoint(group, dims, step + 1, tracker, background=False)
                return Stop(PREEMPTION, PREEMPTION, step + 1, dims.as_dict(), time.monotonic(),
                            f"preemption notice from ranks {notified} at step {step + 1}",
                            tuple(notified))
            due = self.cadence.due(step + 1)
            grow = not last and self.boundary.may_grow(dims.world_size, checkpointing=due)
            if due or grow or (last and self.spec.checkpoint.save_final):
                self._checkpoint(group, dims, step + 1, tracker,
                                 background=self.spec.checkpoint.async_save and not (last or grow))
                if grow:  # the resize restores from this checkpoint
                    return Stop(SCALE_UP, SCALE_UP, step + 1, dims.as_dict(), time.monotonic())
            if self.memory.due(step + 1) and not last:
                tracker.log_metrics(self.memory.snapshot(group, step + 1, self.rank_nodes, self.losses,
                                                         dims.as_dict()), step=step + 1)
        self.ckpts.settle(group, tracker)
        if on_first_step is not None:  # resumed at the end: nothing left to run
            on_first_step()
        return None

    def _checkpoint(self, group, dims: ParallelDims, step: int, tracker, background: bool) -> None:
        meta = step_meta(self.eff, dims, step, self.losses, self.recoveries, tracker.run_id)
        self.cadence.saving(step)
        self.ckpts.save(group, step, meta, tracker, background)

    def _resume(self, group, tracker) -> int:
        got = restore_newest(group, self.ckpts, self.memory, tracker)
        self.memory.generation += 1  # later snapshots are of this build's mesh
        step, losses, recoveries, self.restored_from = got or (0, [], [], "none")
        self.losses = list(losses)[:step]  # a start from scratch drops earlier steps' losses
        self.recoveries = self.recoveries or recoveries
        return step

    def _write_summary(self, dims: ParallelDims, tracker, status: str) -> dict[str, Any]:
        summary = {
            "name": self.spec.name, "status": status, "steps_done": len(self.losses),
            "losses": self.losses, "final_loss": self.losses[-1] if self.losses else None,
            "eval": self.evals.results,
            "mesh": {**dims.as_dict(), "vpp": self.plan_row.get("vpp", 1)},
            "plan": self.plan_row, "rank_to_node": self.rank_nodes,
            "checkpoints": self.ckpts.published(), "recoveries": self.recoveries,
            "rank_pids": self.pid_history, "checkpoint_cadence": self.cadence.choices,
            "mlflow_run_id": tracker.run_id, "tracking_uri": tracker.uri,
        }
        write_json_atomically(self.out / "summary.json", summary)
        return summary

    def _set(self, **kw: Any) -> None:
        self._progress.update(kw)
