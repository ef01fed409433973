"""The controller's training loop between boundaries (``Controller`` runs it in RUNNING): the
ranks run segments of steps on their own; at each segment's last step the after-step hooks
log the step, judge stragglers, evaluate, snapshot, checkpoint, and stop for a preemption
notice or a scale-up. A mixin of ``Controller``: it reads and writes the controller's state
(its spec, mesh, group, cadence, checkpoints, tracker, progress)."""

from __future__ import annotations

import functools
import statistics
import time

from trainmesh.controller.checkpointing import step_meta
from trainmesh.controller.hooks import (
    AfterStep,
    Hook,
    breakdown_metrics,
    expert_metrics,
    flat_expert_metrics,
    step_metrics,
)
from trainmesh.controller.states import PREEMPTION, SCALE_UP, Running, Stop
from trainmesh.parallel.dims import Axis, ParallelDims
from trainmesh.planning.cadence import SEGMENT_S, segment_caps
from trainmesh.planning.failure_costs import predicted_save


class TrainingLoop:
    def _train(self, group, dims: ParallelDims, tracker, state: Running) -> Stop | None:
        """Steps from ``state.start`` to the end (None) or to a stop at a step boundary (a
        preemption notice or a scale-up, each checkpointed first), in segments: the ranks run
        the steps up to the next boundary (``_segment_steps``) with one call each, and the
        controller logs each step as rank 0 reports it. After a segment's last step the hooks of
        ``_after_step_hooks`` run in their order, over every rank's stats; the first that
        returns a stop ends it."""
        start = state.start
        self._grow_asked = False  # (a request of a mesh before this one's recovery)
        nodes = len(set(self.rank_nodes))
        self.cadence.start(start, nodes, predicted_save(
            self.spec.model, dims.tp, dims.pp, dims.dp, nodes, self.spec.checkpoint.async_save,
            dp_replicate=self.eff.parallelism.dp_replicate,
            stages=_stages(self.eff, dims.pp)))
        hooks = self._after_step_hooks(state, dims)
        metrics_of = step_metrics(self.spec, dims.world_size * self.peak_tflops)
        self._set(state="training", step=start)

        def inside(row: dict) -> None:  # a step of the segment before its last: logged
            self.losses.append(row["loss"])
            self._log_step(AfterStep(row["step"], False, [row], row["wall_s"], group, dims,
                                     tracker, whole=False), metrics_of)

        cpu0 = time.thread_time()
        try:
            return self._segments(group, dims, tracker, state, hooks, inside)
        finally:
            self.control["cpu_s"] += time.thread_time() - cpu0

    def _segments(self, group, dims: ParallelDims, tracker, state: Running, hooks, inside) -> Stop | None:
        """``_train``'s loop: a segment, then the hooks at its last step. The controller
        thread's CPU time at a boundary — reading every rank's answer as the segment ends,
        then from its return to the next segment's calls all issued: the hooks' own work (the
        per-rank breakdown, a save's coordination) and the calls; not Ray's own threads, nor
        waits — is measured, and sizes the next segments (``cadence.segment_caps``)."""
        tr, step = self.spec.training, state.start
        back_cpu, read = None, 0.0
        while step < tr.steps:
            steps, until_s = self._segment_steps(step, state)
            stats = group.train_segment(steps, until_s, inside,
                                        functools.partial(self._end_segment_early, dims),
                                        save_pending=self.ckpts.writing)
            if back_cpu is not None and hasattr(group, "issued_cpu_s"):
                self.control["boundary_cpu_s"].append(group.issued_cpu_s - back_cpu + read)
            back_cpu, read = time.thread_time(), getattr(group, "read_cpu_s", 0.0)
            self.control["segments"] += 1
            why = stats[0].get("ended", "steps")
            self.control["ended"][why] = self.control["ended"].get(why, 0) + 1
            self.control["steps"] += stats[0]["step"] - step
            if self.control["first_step_s"] is None:
                self.control["first_step_s"] = time.monotonic() - self._t_run
                self.control["first_step_cpu_s"] = time.thread_time() - self._t_run_cpu
            step = stats[0]["step"]
            done = AfterStep(step, step == tr.steps, stats, stats[0]["wall_s"], group, dims, tracker)
            self.losses.append(stats[0]["loss"])
            for hook in hooks:
                stop = hook(done)
                if stop is not None:
                    return stop
        self.ckpts.settle(group, tracker)
        if state.stop is not None and state.start >= tr.steps:  # resumed at the end: nothing to run
            self._recovered(state, tracker)
        return None

    def _segment_steps(self, step: int, state: Running) -> tuple[int, float]:
        """How many steps the ranks run on their own from ``step``, and for how many seconds at
        most: to the next step that is a boundary — the first after a (re)start (its recovery
        is measured there), a checkpoint the cadence wants, an evaluation, a snapshot, the end
        — at most SEGMENT_STEPS and SEGMENT_S, more where the controller's boundaries so far
        took more than 1% of that or (up to 2 minutes) more than 0.25 ms a step
        (``cadence.segment_caps``, from their median). A notice or a
        request to end early end one sooner (``RankWorker.train_segment``)."""
        if step == state.start:
            return 1, SEGMENT_S
        boundaries = self.control["boundary_cpu_s"][-9:]
        cap, until_s = segment_caps(statistics.median(boundaries) if boundaries else 0.0,
                                    self.cadence.step_s() or 1.0)
        last = min(self.spec.training.steps, step + cap, self.cadence.next_boundary(step))
        for s in range(step + 1, last):
            if self.evals.due(s, False) or self.memory.due(s):
                return s - step, until_s
        return last - step, until_s

    def _end_segment_early(self, dims: ParallelDims) -> bool:
        """Asked while a segment runs (every ``ray_group.POLL_S``): a node of the job being
        drained, or accelerators come that a re-plan would use — a boundary now, not at the
        segment's end (the same checks run again there, and act)."""
        if self.boundary.draining(self.rank_nodes):
            return True
        self._grow_asked = self._grow_asked or self.boundary.may_grow(dims.world_size, checkpointing=False)
        return self._grow_asked

    def _after_step_hooks(self, state: Running, dims: ParallelDims) -> list[Hook]:
        """What happens after a segment's last step (a boundary), in this order."""
        metrics_of = step_metrics(self.spec, dims.world_size * self.peak_tflops)
        first: list[Hook] = []
        if state.stop is not None:  # a recovery is complete, and measured, once a step is done
            def recovered(s: AfterStep) -> None:
                if s.step == state.start + 1:
                    self._recovered(state, s.tracker)
            first = [recovered]
        def fill_ready(s: AfterStep) -> None:  # after a recovery's first step (not slowing it)
            if s.step == state.start + 1:
                self._fill_ready()
        return [
            self._poll_background_save,  # a background save that finished: its manifest
            # metrics, progress, the cadence's clock; stragglers judged from the 2nd step on
            # (the first compiles, warms caches and allocators unevenly)
            lambda s: self._log_step(s, metrics_of, judge=s.step > state.start + 1),
            *first,
            fill_ready,  # ready processes for the next failure: the job's nodes and a spare's worth
            self._evaluate,  # held-out loss, every eval.every steps and after the last
            self._on_preemption_notice,  # checkpoint, then stop: go on without those nodes
            self._checkpoint_or_grow,  # the cadence's checkpoint; a scale-up after one
            self._snapshot,  # the in-memory tier, every checkpoint.in_memory.every steps
        ]

    def _poll_background_save(self, s: AfterStep) -> None:
        self.ckpts.poll(s.group, [r.get("save") for r in s.stats], s.tracker)

    def _log_step(self, s: AfterStep, metrics_of, judge: bool = True) -> None:
        """The step's metrics; at a boundary also where it went on every rank (the per-rank
        breakdown, the straggler, the experts': sampled at each segment's last step)."""
        metrics = metrics_of(s.stats[0], s.seconds, s.dims.world_size)
        if not s.whole:  # rank 0's own; its experts' are every block's without pipeline
            experts = expert_metrics(s.stats) if s.dims.pp == 1 else {}
            s.tracker.log_metrics({**metrics, **flat_expert_metrics(experts)}, step=s.step)
            self.cadence.stepped(s.step, s.seconds, s.tracker)
            self._set(step=s.step, loss=metrics["loss"], tokens_per_s=metrics["tokens_per_s"])
            return
        stages = [s.dims.coords(r)[Axis.PP] for r in range(s.dims.world_size)]
        # compute, comm, bubble, data, memory; the straggler among ranks doing the same work
        where, straggler = breakdown_metrics(s.stats, stages, judge)
        metrics.update(where)
        self.breakdown = {"step": s.step, "ranks": [r.get("breakdown") for r in s.stats]}
        if straggler is not None:  # named in MLflow and counted for summary.json
            node = self.rank_nodes[straggler["rank"]] if straggler["rank"] < len(self.rank_nodes) else None
            s.tracker.event("straggler", step=s.step, node=node, **straggler)
            key = str(straggler["rank"])
            self.stragglers[key] = self.stragglers.get(key, 0) + 1
        experts = expert_metrics(s.stats)
        if experts:  # MoE: expert load, balancing loss, dropped tokens, bias norm per block
            self.experts = {"step": s.step, **experts,
                            "dropped_total": self.experts.get("dropped_total", 0)
                            + experts["all"]["dropped"]}
        s.tracker.log_metrics({**metrics, **flat_expert_metrics(experts)}, step=s.step)
        self.cadence.stepped(s.step, s.seconds, s.tracker)
        self._set(step=s.step, loss=metrics["loss"], tokens_per_s=metrics["tokens_per_s"])

    def _recovered(self, state: Running, tracker) -> None:
        rec = self.book.complete(state.stop, state.start, self.dims.as_dict(), state.mode)
        self.events.append(rec.line())
        tracker.event("recovery", **rec.as_dict())
        tracker.log_metrics({"recovery_downtime_s": rec.downtime_s,
                             "recovery_steps_lost": rec.steps_lost}, step=state.start)

    def _evaluate(self, s: AfterStep) -> None:
        if self.evals.due(s.step, s.last):
            self._set(eval_loss=self.evals.run(s.group, s.step, s.tracker))

    def _on_preemption_notice(self, s: AfterStep) -> Stop | None:
        notified = self.boundary.notified(s.stats, self.rank_nodes)
        if not notified or s.last:
            return None
        self._notice(f"preemption notice for rank(s) {notified} after step {s.step}: "
                     "checkpointing, then continuing without their node(s)")
        self._checkpoint(s.group, s.dims, s.step, s.tracker, background=False)
        self.ckpts.settle(s.group, s.tracker)  # its digests, while every rank is there to give them
        return Stop(PREEMPTION, PREEMPTION, s.step, s.dims.as_dict(), time.monotonic(),
                    f"preemption notice from ranks {notified} at step {s.step}", tuple(notified))

    def _checkpoint_or_grow(self, s: AfterStep) -> Stop | None:
        due = self.cadence.due(s.step)
        grow = not s.last and (self._grow_asked or self.boundary.may_grow(s.dims.world_size,
                                                                           checkpointing=due))
        self._grow_asked = False
        if due or grow or (s.last and self.spec.checkpoint.save_final):
            self._checkpoint(s.group, s.dims, s.step, s.tracker,
                             background=self.spec.checkpoint.async_save and not (s.last or grow))
            if grow:  # the resize restores from this checkpoint (its digests in first)
                self.ckpts.settle(s.group, s.tracker)
                return Stop(SCALE_UP, SCALE_UP, s.step, s.dims.as_dict(), time.monotonic())
        return None

    def _snapshot(self, s: AfterStep) -> None:
        if self.memory.due(s.step) and not s.last:
            t0 = time.perf_counter()
            s.tracker.log_metrics(self.memory.snapshot(s.group, s.step, self.rank_nodes, self.losses,
                                                       s.dims.as_dict()), step=s.step)
            self.control["snapshot_s"].append(time.perf_counter() - t0)

    def _checkpoint(self, group, dims: ParallelDims, step: int, tracker, background: bool) -> None:
        meta = step_meta(self.eff, dims, step, self.losses, self.recoveries, tracker.run_id)
        self.cadence.saving(step)
        t0 = time.perf_counter()
        self.ckpts.save(group, step, meta, tracker, background)
        self.control["save_s"].append(time.perf_counter() - t0)


def _stages(eff, pp: int) -> tuple[str, int, tuple[int, ...] | None]:
    """The run's pipeline layout as the save's prediction reads it: its schedule, chunks a
    rank and split (used while pp × vpp is its length, as the ranks use it)."""
    par = eff.parallelism
    split = par.stage_layers
    return (eff.schedule.name, par.vpp,
            tuple(split) if split and len(split) == pp * par.vpp else None)
