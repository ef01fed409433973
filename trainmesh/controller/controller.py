"""The controller: owns the plan, the rank actors, checkpoints, tracking and the run summary.

It runs as a Ray actor (``max_concurrency > 1`` so ``progress()`` answers while ``run()``
works). The worker group is injected through a factory so the loop can be driven by fakes.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from trainmesh.actors.errors import HangDetected, PlacementTimeout
from trainmesh.controller.boundary import StepBoundary
from trainmesh.controller.checkpointing import Checkpointer
from trainmesh.controller.elastic import JobFailed, bounded_topology, ready_nodes, warm_assignment
from trainmesh.controller.evaluation import Evaluator, evaluate_once
from trainmesh.controller.memory_tier import MemoryTier, restore_newest
from trainmesh.controller.pipeline_artifacts import write_pipeline_artifacts
from trainmesh.controller.preflight import earlier_run_problems
from trainmesh.controller.ray_group import (
    RayWorkerGroup,
    controller_node_id,
    draining_nodes,
    live_topology,
    placement_for,
    ready_pool,
)
from trainmesh.controller.recovery import RecoveryBook
from trainmesh.controller.states import (
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
from trainmesh.controller.summary import write_json_atomically
from trainmesh.controller.training_loop import TrainingLoop
from trainmesh.data.shards import resolve_data_dir
from trainmesh.parallel.dims import ParallelDims
from trainmesh.planning.cadence import CheckpointCadence
from trainmesh.planning.job_plan import PlanError, plan_for
from trainmesh.planning.planner import float8_refusal
from trainmesh.planning.topology import Topology
from trainmesh.spec.job import JobSpec
from trainmesh.spec.problems import SpecError
from trainmesh.spec.validate import Layout, Workload, layout_problems, problems
from trainmesh.tracking.mlflow_tracker import open_tracker

# What a recovery handles: a rank's actor died, a rank's step raised (a peer's death surfaces
# as a collective error), a step overran its timeout, ranks hung, or no placement could be made.
RECOVERABLE = (RayActorError, RayTaskError, GetTimeoutError, PlacementTimeout, HangDetected)
STUCK_S = 2.0  # after an abort, how long a rank may take to leave the failed call
ALIVE_S = 3.0  # how long a live rank may take to answer on its control path


class Controller(TrainingLoop):
    def __init__(self, spec_json: str, tracking_uri: str | None, worker_env: dict[str, str],
                 group_factory: Callable[..., Any] | None = None,
                 topology_fn: Callable[[JobSpec], Topology] | None = None,
                 rank_cls: type | None = None):
        self.spec = JobSpec.model_validate_json(spec_json)
        broken = problems(self.spec, runnable=True)  # the Python API's callers skip the CLI's check
        if broken:
            raise SpecError(broken)
        self.out = Path(self.spec.resolved_output_dir())
        self.ckpts = Checkpointer(self.spec, self.out, on_warning=self._notice)
        self.cadence = CheckpointCadence(self.spec.checkpoint, self.spec.elastic)
        self.ckpts.on_commit = self.cadence.saved
        self.tracking_uri, self.worker_env = tracking_uri, worker_env
        self._rank_cls = rank_cls  # the rank actors' class (None: RankWorker)
        self._group_factory = group_factory or functools.partial(RayWorkerGroup, rank_cls=rank_cls)
        self._topology_fn = topology_fn or live_topology
        self.plan_row, self.peak_tflops = {}, 1.0
        self.rank_nodes: list[str] = []
        self._progress: dict[str, Any] = {"state": "starting", "step": 0,
                                          "steps": self.spec.training.steps}
        self.notices: list[str] = []  # warnings for the person running the job
        self.events: list[str] = []  # what else the console says as it happens (recoveries)
        self.pid_history: list[list[int]] = []  # the ranks' processes, per (re)start
        self.losses: list[float] = []
        self.experts: dict[str, Any] = {}  # MoE: the last step's statistics (summary.json)
        self.breakdown: dict[str, Any] = {}  # the last step: where each rank's time went
        self.stragglers: dict[str, int] = {}  # rank → steps it was named the straggler
        self.resumed_at: int | None = None  # the step this run started from
        self.book = RecoveryBook()  # restarts, dead nodes, the recovery in progress, those done
        self.group = None  # the rank actors (the injected worker group)
        # ready rank processes (actors/ready.py): kept with the real worker group only
        self.ready, self._keeps_ready = None, group_factory is None
        self.dims = ParallelDims()
        self.eff = self.spec  # the spec with the current plan written in
        self.boundary = StepBoundary(self.spec, self._available)
        self._grow_asked = False  # a segment ended early for a scale-up (``_end_segment_early``)
        # What the control plane cost (summary.json "control"; bench/control_plane.py): this
        # thread's CPU seconds over the training loops, their segments and steps, the seconds
        # from the run's start to its first step, each save's and snapshot's coordination, what
        # ended the segments (``RankWorker.train_segment``'s reasons, counted).
        self.control: dict[str, Any] = {"cpu_s": 0.0, "segments": 0, "steps": 0, "ended": {},
                                        "first_step_s": None, "first_step_cpu_s": None,
                                        "save_s": [], "snapshot_s": [], "boundary_cpu_s": []}
        self._t_run = time.monotonic()
        self._t_run_cpu = time.thread_time()  # (the controller thread's: its start's CPU cost)
        self.evals = Evaluator(self.spec)
        self.memory = MemoryTier(self.spec.checkpoint.in_memory.every)

    @property
    def restarts(self) -> int:
        return self.book.restarts

    @property
    def dead_nodes(self) -> set[str]:
        return self.book.dead_nodes

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        return self.book.done

    # -- public ----------------------------------------------------------------------------
    def progress(self) -> dict[str, Any]:  # where the run is, every notice so far (the driver prints new ones)
        return {**self._progress, "notices": list(self.notices), "events": list(self.events)}

    def _notice(self, text: str) -> None:
        self.notices.append(text)

    def run(self) -> dict[str, Any]:
        self._t_run, self._t_run_cpu = time.monotonic(), time.thread_time()
        self.out.mkdir(parents=True, exist_ok=True)
        broken = earlier_run_problems(self.spec, self.ckpts.store)
        if broken:
            raise SpecError(broken)
        self.ckpts.start()
        resume = self.ckpts.latest()
        run_id = resume[1].get("mlflow_run_id") if resume else None
        tracker = open_tracker(self.tracking_uri if self.spec.tracking.enabled else None,
                               self.spec.tracking.experiment, self.spec.name, run_id, self._notice,
                               artifact_dir=self.out / "mlartifacts", backlog_dir=self.out,
                               backlog_in_memory=self.spec.tracking.backlog_in_memory)
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
        from trainmesh.controller.dry_run import measure, memory_rows

        group = self._place(replan=False, ready=False)
        try:
            reports = measure(group, self.eff.model_dump_json(), self.dims, self._data_dir(), step)
        finally:
            group.shutdown()
        return memory_rows(reports, self.eff, self.candidate, self.dims, self.device, step)

    def evaluate(self) -> dict[str, Any]:  # `trainmesh eval`: evaluation.py
        return evaluate_once(self)

    def _run_with_recovery(self, tracker) -> None:
        """The state machine of ``controller/states.py``, from SCHEDULING to FINISHED (or
        ERRORED: ``JobFailed`` with the report)."""
        state: State = Scheduling()
        try:
            while not isinstance(state, Finished):
                if isinstance(state, Errored):
                    raise JobFailed(state.report)
                self._set(state=state.name)
                state = self._advance(state, tracker)
        finally:
            try:
                self._drop()
            finally:
                if self.ready is not None:
                    self.ready.shutdown()

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
            return Recovering(self.book.joined(stop))
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
                              avoid=self.book.dead_nodes | set(draining_nodes()))
        except RayActorError:  # a rank died while re-forming: recover again, warm if we can
            raise
        except Exception as err:  # noqa: BLE001 - survivors stuck in a collective, or else: cold
            self._notice(f"warm recovery failed ({str(err).strip().splitlines()[-1][:200]}); "
                         "restarting every rank")
            tracker.event("warm-recovery-failed", error=str(err)[-2000:])
            self.book.interrupt()
            return Scheduling(state.stop)
        self.book.mark("group")
        self.book.processes = self.group.processes() if self.ready is not None else {}
        return Restoring(state.stop, "warm")

    def _build_and_restore(self, state: Restoring, tracker) -> State:
        start = self._prepare(self.group, tracker)
        self.book.mark("restored")
        return Running(start, state.stop, state.mode)

    def _running(self, state: Running, tracker) -> State:
        stop = self._train(self.group, self.dims, tracker, state)
        if stop is not None:
            return Recovering(stop)
        for path in write_pipeline_artifacts(self.out, self.eff, self.dims, self.group):
            tracker.log_artifact(path)
        return Finished()

    def _recover(self, state: Recovering, tracker) -> State:
        """Who survived ``state.stop`` (a failure: after every survivor aborted its
        communicators, out of band), which nodes are gone, and the policy's decision."""
        stop, group, book = state.stop, self.group, self.book
        book.begin(stop)
        nodes, refill = (group.nodes if group is not None else []), set()
        if stop.kind == SCALE_UP:  # checkpointed already; every rank is kept when warm
            alive = set(range(len(nodes)))
        elif stop.kind == PREEMPTION:  # checkpointed already; the notified nodes are going
            leaving = {nodes[r] for r in stop.ranks}
            book.dead_nodes |= leaving
            alive = {r for r in self._alive(group) if nodes[r] not in leaving}
            tracker.event("preemption", step=stop.step, ranks=list(stop.ranks),
                          nodes=sorted(leaving))
        else:
            stuck: set[int] = set()
            if group is not None:  # survivors leave their collectives now, not at the timeout
                group.abort()      # (and any background save with them); those no abort frees
            book.mark("aborted")   # (no group: a cold placement failed; nothing to abort)
            if group is not None:  # are killed, their places refilled
                stuck = set(group.release_stuck(STUCK_S))
            book.mark("released")
            answered = self._alive(group)  # (asked with the abort: stuck ones answer too)
            book.mark("checked")
            alive, gone = answered - stuck, set(range(len(nodes))) - answered
            # a node is gone when none of its ranks answers; a rank dead beside ones that do
            # (its process killed: OOM, a crash) leaves a place its node can refill
            book.dead_nodes |= {nodes[r] for r in gone} - {nodes[r] for r in answered}
            refill = {r for r in stuck | gone if nodes[r] not in book.dead_nodes}
            tracker.event("failure", cause=stop.cause, step=stop.step, stuck=sorted(stuck),
                          dead_nodes=sorted(book.dead_nodes), error=stop.detail[-2000:])
        decision = decide(stop, self.spec.elastic, book.restarts, self._available().world_size,
                          frozenset(alive), frozenset(refill), book.in_a_row)
        if not isinstance(decision.next, Reforming):
            self._drop()
        book.spend(decision)
        time.sleep(decision.backoff_s)
        return decision.next

    def _drop(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None

    def _available(self) -> Topology:
        """The accelerators the job may use now: not on a dead node, nor on one being drained."""
        gone = self.book.dead_nodes | set(draining_nodes())
        return bounded_topology(self._topology_fn(self.spec), self.spec.elastic, gone)

    def _plan(self, replan: bool) -> Topology:
        """Plan (or re-plan) for the accelerators alive now; returns that topology."""
        topo = self._available()
        broken = float8_refusal(self.spec.training.float8, topo.device, self.spec.model.compile)
        if broken:  # (before any rank starts; the planner would find no plan for it)
            raise JobFailed(broken)
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
        # Refused before any rank starts (float8 above; the ranks check it again, knowing
        # their GPU's capability): the plan written into the spec keeps every rule a layout
        # keeps (its size against elastic's bounds is the planner's: bounded_topology,
        # replan_job)
        broken = [str(p) for p in layout_problems(Workload.of(self.eff), Layout.pinned(self.eff))]
        if broken:
            raise JobFailed(broken[0])
        if result.best.idle and (replan or self.spec.parallelism.auto):  # pinned: as asked
            self._notice(f"plan: {self.dims.world_size} of {topo.world_size} accelerators used, "
                         f"{result.best.idle} left idle as spares")
        self.book.mark("planned")
        return topo

    def _place(self, replan: bool, ready: bool = True):
        """Cold: place a new group of rank actors for the plan (taking ready processes, and
        keeping them, unless not ``ready``: a one-off group, a dry run or an evaluation)."""
        topo = self._plan(replan)
        self._set(state="placing")
        placement = placement_for(self.eff, self.dims, topo)
        if ready and self._keeps_ready and self.ready is None:
            self.ready = ready_pool(self.spec, self.worker_env, placement, topo.device.name != "cpu",
                                    len(self._topology_fn(self.spec).nodes),  # (spares too)
                                    self._rank_cls)
        elif ready and self.ready is not None:  # (a cold restart goes where they wait)
            self.ready.drop(self.book.dead_nodes | set(draining_nodes()))
        kw = {"ready": self.ready} if ready and self.ready is not None else {}
        group = self._group_factory(self.eff, self.dims, placement, self.worker_env, **kw)
        self.book.mark("group")
        self.book.processes = group.processes() if kw else {}
        if kw and not replan:  # the job's start: its ready processes start beside its ranks
            self._fill_ready(group)
        return group

    def _fill_ready(self, group=None) -> None:
        """Ready processes (``elastic.ready_ranks_per_node``) on every node of the job's ranks
        (``group``'s, by default the running one's) and on spare nodes enough to replace one of
        them (``elastic.ready_nodes``), none dead or draining."""
        group = group or self.group
        if self.ready is None or group is None:
            return
        try:
            gone = self.book.dead_nodes | set(draining_nodes())
            alive = [n for n in self._topology_fn(self.spec).nodes if n.node_id not in gone]
            self.ready.fill(ready_nodes(alive, [n for n in group.nodes if n not in gone],
                                        self.ready.nodes()), {n.node_id: n.accelerators for n in alive})
        except Exception as err:  # noqa: BLE001 - an optimisation: the job goes on without
            self._notice(f"ready rank processes not started ({str(err)[:200]}); new ranks "
                         "will start their own processes")

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
        group.build(self.eff.model_dump_json(), self.dims, self._data_dir())
        self.book.mark("built")
        if (failed := tracker.opened()) is not None:  # (it opened while the ranks started)
            raise JobFailed(failed)
        start = self._resume(group, tracker)
        tracker.event("start", step=start, mesh=self.dims.as_dict())
        return start

    def _alive(self, group) -> set[int]:  # those that answer (busy ones too: out of band)
        return set() if group is None else group.alive_ranks(timeout_s=ALIVE_S)

    def _resume(self, group, tracker) -> int:
        # (the run's start: no checkpoint under resume: never; a recovery: its own newest)
        got = restore_newest(group, self.ckpts, self.memory, tracker, start=self.resumed_at is None)
        self.memory.generation += 1  # later snapshots are of this build's mesh
        step, losses, recoveries, self.book.restored_from = got or (0, [], [], "none")
        if self.resumed_at is None:  # this run's start: a checkpoint of an earlier run, or 0
            self.resumed_at = step
        self.losses = list(losses)[:step]  # a start from scratch drops earlier steps' losses
        self.book.done = self.book.done or recoveries
        return step

    def _write_summary(self, dims: ParallelDims, tracker, status: str) -> dict[str, Any]:
        summary = {
            "name": self.spec.name, "status": status, "steps_done": len(self.losses),
            "resumed_at": self.resumed_at or 0,
            "losses": self.losses, "final_loss": self.losses[-1] if self.losses else None,
            "eval": self.evals.results,
            "mesh": {**dims.as_dict(), "vpp": self.plan_row.get("vpp", 1)},
            "plan": self.plan_row, "rank_to_node": self.rank_nodes,
            "checkpoints": self.ckpts.published(), "recoveries": self.recoveries,
            "rank_pids": self.pid_history, "checkpoint_cadence": self.cadence.choices,
            "mlflow_run_id": tracker.run_id, "tracking_uri": tracker.uri,
            "control": self.control,
        }
        if self.experts:  # the last step's per-block expert statistics, the run's drops
            summary["experts"] = self.experts
        if self.breakdown:  # where each rank's last step went; who lagged, how often
            summary["step_breakdown"] = self.breakdown
            summary["stragglers"] = self.stragglers
        write_json_atomically(self.out / "summary.json", summary)
        return summary

    def _data_dir(self) -> str:
        return resolve_data_dir(self.spec.data.path, self.out)

    def _set(self, **kw: Any) -> None:
        self._progress.update(kw)
