"""The controller: owns the plan, the rank actors, checkpoints, tracking and the run summary.

It runs as a Ray actor (``max_concurrency > 1`` so ``progress()`` answers while ``run()``
works). The worker group is injected through a factory so the loop can be driven by fakes.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainmesh.checkpoint import manifest
from trainmesh.jobs.spec import JobSpec
from trainmesh.models.llama.model_math import flops_per_token
from trainmesh.parallel.dims import ParallelDims
from trainmesh.parallel.layout import Placement, plan_placement
from trainmesh.platform.job_plan import plan_job
from trainmesh.platform.topology import Topology, topology_from_ray

log = logging.getLogger(__name__)

RNG_FILE = "rng_state.bin"


def placement_for(spec: JobSpec, dims: ParallelDims, topo: Topology) -> Placement:
    """One bundle per node: a GPU per rank on accelerator clusters, CPUs otherwise."""
    per_rank = {"CPU": spec.runtime.cpus_per_rank}
    if topo.device.name != "cpu":
        per_rank["GPU"] = 1.0
    return plan_placement(dims, topo.per_node, per_rank)


class Controller:
    def __init__(self, spec_json: str, tracking_uri: str | None, worker_env: dict[str, str],
                 group_factory: Callable[..., Any] | None = None,
                 topology_fn: Callable[[JobSpec], Topology] | None = None):
        self.spec = JobSpec.model_validate_json(spec_json)
        self.out = Path(self.spec.resolved_output_dir())
        self.ckpt_root = self.out / "checkpoints"
        self.tracking_uri = tracking_uri
        self.worker_env = worker_env
        self._group_factory = group_factory or _RayGroup
        self._topology_fn = topology_fn or _live_topology
        self.plan_row: dict[str, Any] = {}
        self.peak_tflops = 1.0
        self.rank_nodes: list[str] = []
        self._progress: dict[str, Any] = {"state": "starting", "step": 0,
                                          "steps": self.spec.training.steps}
        self.losses: list[float] = []
        self.checkpoints: list[int] = []

    # -- public ----------------------------------------------------------------------------
    def progress(self) -> dict[str, Any]:
        return dict(self._progress)

    def run(self) -> dict[str, Any]:
        self.out.mkdir(parents=True, exist_ok=True)
        resume = self._find_resume()
        tracker = self._make_tracker(resume[1].get("mlflow_run_id") if resume else None)
        group = None
        status = "FAILED"
        dims = ParallelDims()
        try:
            topo = self._topology_fn(self.spec)
            dims, result = plan_job(self.spec, topo)
            self.peak_tflops = topo.device.peak_tflops
            self.plan_row = result.best.as_row()
            tracker.log_params(json.loads(self.spec.model_dump_json()))
            tracker.log_dict(json.loads(self.spec.model_dump_json()), "spec.json")
            self._set(state="placing")
            group = self._group_factory(self.spec, dims, placement_for(self.spec, dims, topo),
                                        self.worker_env)
            self.rank_nodes = group.rank_nodes()
            tracker.log_dict({**dims.as_dict(), "plan": self.plan_row,
                              "rank_to_node": self.rank_nodes}, "mesh.json")
            self._set(state="building")
            group.build(self.spec.model_dump_json(), dims, self._data_dir())
            start = self._restore(group, resume, tracker)
            tracker.event("start", step=start, mesh=dims.as_dict())
            self._train(group, dims, tracker, start)
            if dims.pp > 1:
                self._log_pipeline(group, dims, tracker)
            status = "FINISHED"
        finally:
            if group is not None:
                group.shutdown()
            summary = self._write_summary(dims, tracker, status)
            tracker.log_artifact(self.out / "summary.json")
            tracker.finish(status)
            self._set(state=status.lower())
        return summary

    # -- steps -----------------------------------------------------------------------------
    def _train(self, group, dims: ParallelDims, tracker, start: int) -> None:
        tr = self.spec.training
        fpt = flops_per_token(self.spec.model, tr.seq_len)
        peak = self.peak_tflops * 1e12
        every = self.spec.checkpoint.every
        self._set(state="training", step=start)
        for step in range(start, tr.steps):
            t0 = time.perf_counter()
            stats = group.train_step()
            dt = time.perf_counter() - t0
            tokens = tr.global_batch_size * tr.seq_len
            s0 = stats[0]
            self.losses.append(s0["loss"])
            tps = tokens / dt
            metrics = {"loss": s0["loss"], "lr": s0["lr"], "grad_norm": s0["grad_norm"],
                       "tokens_per_s": tps, "step_time_s": dt,
                       "mfu": fpt * tps / (dims.world_size * peak)}
            tracker.log_metrics(metrics, step=step + 1)
            self._set(step=step + 1, loss=s0["loss"], tokens_per_s=tps)
            last = step + 1 == tr.steps
            if (every and (step + 1) % every == 0) or (last and self.spec.checkpoint.save_final):
                self._checkpoint(group, dims, step + 1, tracker)

    def _checkpoint(self, group, dims: ParallelDims, step: int, tracker) -> None:
        partial = manifest.partial_dir(self.ckpt_root, step)
        rng = group.save(str(partial))
        if rng is not None:
            (partial / RNG_FILE).write_bytes(rng)
        tr = self.spec.training
        meta = {"step": step, "mesh": dims.as_dict(), "losses": list(self.losses),
                "data_position": {"seed": tr.seed, "step": step,
                                  "samples_consumed": step * tr.global_batch_size},
                "mlflow_run_id": tracker.run_id, "spec": json.loads(self.spec.model_dump_json())}
        final = manifest.commit(partial, meta)
        if step not in self.checkpoints:
            self.checkpoints.append(step)
        pruned = manifest.prune(self.ckpt_root, self.spec.checkpoint.keep_last)
        tracker.event("checkpoint", step=step, path=str(final), pruned=pruned)

    def _log_pipeline(self, group, dims: ParallelDims, tracker) -> None:
        """The planned schedule (grid + simulated PNG) beside the measured per-rank timeline of
        the last step (Chrome/Perfetto trace), in OUTPUT/ and MLflow."""
        from trainmesh.parallel.pipeline.ir import grid
        from trainmesh.parallel.pipeline.schedules import build_schedule
        from trainmesh.parallel.pipeline.simulate import simulate
        from trainmesh.parallel.pipeline.trace import chrome_trace, plot_schedule, write_json

        tr, vpp = self.spec.training, self.spec.parallelism.vpp
        m = tr.global_batch_size // (dims.dp * tr.microbatch_size)
        sched = build_schedule(self.spec.schedule.name, dims.pp, vpp, m)
        (self.out / "pipeline_schedule.txt").write_text(grid(sched) + "\n")
        plot_schedule(simulate(sched, dims.pp * vpp, m), self.spec.schedule.name,
                      self.out / "pipeline_schedule.png")
        # One row per pipeline rank: the ranks with dp = tp = 0.
        rows = group.timelines()
        stage_ranks = [dims.rank_of(i, 0, 0) for i in range(dims.pp)]
        write_json(chrome_trace([rows[r] for r in stage_ranks]), self.out / "pipeline_trace.json")
        for name in ("pipeline_schedule.txt", "pipeline_schedule.png", "pipeline_trace.json"):
            tracker.log_artifact(self.out / name)

    # -- resume ----------------------------------------------------------------------------
    def _find_resume(self) -> tuple[Path, dict[str, Any]] | None:
        if self.spec.checkpoint.resume != "auto":
            return None
        return manifest.latest(self.ckpt_root)

    def _restore(self, group, resume, tracker) -> int:
        if resume is None:
            return 0
        directory, meta = resume
        rng_path = directory / RNG_FILE
        rng = rng_path.read_bytes() if rng_path.exists() else None
        step = int(meta["step"])
        group.load(str(directory), step, rng)
        self.losses = list(meta.get("losses", []))[:step]
        self.checkpoints = manifest.complete_steps(self.ckpt_root)
        tracker.event("resume", step=step, path=str(directory), from_mesh=meta.get("mesh"))
        return step

    # -- helpers ---------------------------------------------------------------------------
    def _data_dir(self) -> str:
        if self.spec.data.path:
            return str(Path(self.spec.data.path).resolve())
        from trainmesh.data.shards import ensure_tiny_corpus

        return str(ensure_tiny_corpus(self.out / "data" / "tiny-corpus"))

    def _make_tracker(self, run_id: str | None):
        if not self.spec.tracking.enabled or not self.tracking_uri:
            from trainmesh.tracking.mlflow_tracker import NullTracker

            return NullTracker()
        from trainmesh.tracking.mlflow_tracker import MlflowTracker

        return MlflowTracker(self.tracking_uri, self.spec.tracking.experiment, self.spec.name,
                             run_id=run_id)

    def _write_summary(self, dims: ParallelDims, tracker, status: str) -> dict[str, Any]:
        summary = {
            "name": self.spec.name, "status": status, "steps_done": len(self.losses),
            "losses": self.losses, "final_loss": self.losses[-1] if self.losses else None,
            "mesh": {**dims.as_dict(), "vpp": self.plan_row.get("vpp", 1)},
            "plan": self.plan_row, "rank_to_node": self.rank_nodes,
            "checkpoints": [str(manifest.step_dir(self.ckpt_root, s)) for s in self.checkpoints
                            if manifest.step_dir(self.ckpt_root, s).exists()],
            "recoveries": [], "mlflow_run_id": tracker.run_id, "tracking_uri": tracker.uri,
        }
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1))
        os.replace(tmp, self.out / "summary.json")
        return summary

    def _set(self, **kw: Any) -> None:
        self._progress.update(kw)


class _RayGroup:
    """The real worker group behind the controller's narrow interface."""

    def __init__(self, spec: JobSpec, dims: ParallelDims, placement: Placement,
                 env: dict[str, str]):
        from trainmesh.actors.worker_group import WorkerGroup

        self.spec = spec
        self.timeout = spec.runtime.collective_timeout_s
        self.group = WorkerGroup(placement, env, ready_timeout_s=60,
                                 cpu_threads=max(1, int(spec.runtime.cpus_per_rank)))
        self.backend = self.group.setup_process_group(spec.runtime.device, self.timeout)

    def rank_nodes(self) -> list[str]:
        return [info["node_id"] for info in self.group.call("node_info", timeout_s=60)]

    def build(self, spec_json: str, dims: ParallelDims, data_dir: str) -> None:
        d = {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp}
        self.group.call("build", spec_json, d, data_dir, timeout_s=self.timeout + 120)

    def train_step(self) -> list[dict]:
        return self.group.call("train_step", timeout_s=self.timeout * 2)

    def save(self, directory: str) -> bytes | None:
        return self.group.call("save", directory, timeout_s=self.timeout * 2)[0]

    def load(self, directory: str, step: int, rng: bytes | None) -> None:
        self.group.call("load", directory, step, rng, timeout_s=self.timeout * 2)

    def save_to(self, directory: str) -> None:
        """A raw collective save (no manifest): for inspection and tests."""
        self.group.call("save", directory, timeout_s=self.timeout * 2)

    def full_state(self) -> dict:
        """Every parameter, unsharded, merged over the pipeline stages."""
        return {k: v for d in self.group.call("full_state", timeout_s=self.timeout)
                for k, v in d.items()}

    def timelines(self) -> list[list]:
        return self.group.call("timeline", timeout_s=self.timeout)

    def memory_stats(self) -> list[dict]:
        return self.group.call("memory_stats", timeout_s=self.timeout)

    def full_grads(self) -> dict:
        return {k: v for d in self.group.call("full_grads", timeout_s=self.timeout)
                for k, v in d.items()}

    def shutdown(self) -> None:
        self.group.shutdown()


def _live_topology(spec: JobSpec) -> Topology:
    device = "cpu" if spec.runtime.device == "cpu" else spec.topology.device
    topo = topology_from_ray(device, spec.runtime.cpus_per_rank)
    return topo.with_overrides(spec.topology.overrides())

