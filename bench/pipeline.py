"""Pipeline schedules on this machine: measured vs predicted, and ours vs torch's.

    .venv/bin/python bench/pipeline.py [--steps 3]

For 1F1B, interleaved 1F1B and the zero-bubble ZB-H1 and ZBV at pp = 2 and 4 (8
microbatches, the `tiny` shape with 8 layers): our executor's measured step time against the
simulator's prediction (fed the measured median time of each kind of action), the measured
bubble against the planner's, the simulated step under NCCL's rules (blocking sends, one stream
per rank; deadlock-free, slower as receives block the stream), and, in the same run on the same
model, mesh and microbatches, torch.distributed.pipelining's Schedule1F1B /
ScheduleInterleaved1F1B (torch has no single-chunk ZB-H1; its ZBV is not compared). Ranks share
2 cores here, so absolute times are dominated by oversubscription; the ratios are what to read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from trainmesh.actors.rank_worker import RankWorker  # noqa: E402
from trainmesh.actors.worker_group import RANK_CONCURRENCY_GROUPS  # noqa: E402


class TorchPipelineWorker(RankWorker):
    """A rank that also runs torch.distributed.pipelining on the same stage modules."""

    def build_torch(self, spec_json: str, dims: dict, data_dir: str) -> None:
        import torch
        from torch.distributed.pipelining import PipelineStage as TorchStage
        from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

        from trainmesh.models.llama.model import LlamaArgs, cross_entropy_loss
        from trainmesh.models.llama.stage import PipelineStage, rank_model
        from trainmesh.parallel.dims import Axis, ParallelDims
        from trainmesh.parallel.mesh import Mesh
        from trainmesh.spec.job import JobSpec

        self.build(spec_json, dims, data_dir)  # our engine, for data and comparison
        spec = JobSpec.model_validate_json(spec_json)
        mesh = self.engine.mesh
        pp, vpp = mesh.size(Axis.PP), spec.parallelism.vpp
        if spec.schedule.name.startswith("zb"):  # our executor only (see the docstring)
            self.torch_sched = None
            return
        model, stage_ids = rank_model(LlamaArgs.from_config(spec.model), mesh.coord(Axis.PP), pp, vpp)
        model.init_weights(spec.training.seed)
        group = mesh[Axis.PP].get_group()
        stages = [TorchStage(PipelineStage(model, s, pp * vpp), s, pp * vpp, self.device, group=group)
                  for s in stage_ids]
        tr = spec.training
        n_micro = tr.global_batch_size // tr.microbatch_size
        if spec.schedule.name == "interleaved-1f1b":
            self.torch_sched = ScheduleInterleaved1F1B(stages, n_micro, loss_fn=cross_entropy_loss)
        else:
            self.torch_sched = Schedule1F1B(stages[0], n_micro, loss_fn=cross_entropy_loss)
        self.torch_model = model
        self.torch_first = 0 in stage_ids
        self.torch_last = pp * vpp - 1 in stage_ids
        _ = (torch, Mesh, ParallelDims)

    def torch_step(self) -> float:
        import torch

        if self.torch_sched is None:
            return float("nan")
        tr = self.engine.spec.training
        mbs = self.engine.dataset.microbatches(tr.seed, 0, tr.global_batch_size, 0, 1,
                                               tr.microbatch_size)
        x = torch.cat([m[0] for m in mbs])
        y = torch.cat([m[1] for m in mbs])
        t0 = time.perf_counter()
        args = (x,) if self.torch_first else ()
        kwargs = {"target": y, "losses": []} if self.torch_last else {}
        self.torch_sched.step(*args, **kwargs)
        self.torch_model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def timed_step(self) -> float:
        """Our executor on the same microbatches (forwards and backwards only, like torch's
        ``schedule.step``; no optimizer)."""
        eng = self.engine
        tr = eng.spec.training
        mbs = eng.dataset.microbatches(tr.seed, 0, tr.global_batch_size, 0, 1, tr.microbatch_size)
        t0 = time.perf_counter()
        eng.executor.step(mbs)
        dt = time.perf_counter() - t0
        eng.optimizer.zero_grad(set_to_none=True)
        return dt


def measure(kind: str, pp: int, vpp: int, steps: int, data_dir: str):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from trainmesh.cli.loading import load_spec
    from trainmesh.parallel.dims import ParallelDims
    from trainmesh.parallel.pipeline.schedules import build_schedule, pipe_shape
    from trainmesh.parallel.pipeline.simulate import simulate
    from trainmesh.parallel.pipeline.trace import measured_costs
    from trainmesh.planning.candidate import bubble_fraction

    spec = load_spec(None, ["model.preset=tiny", "model.n_layers=8", "training.seq_len=64",
                            "training.global_batch_size=16", "training.microbatch_size=2",
                            f"parallelism.pp={pp}", f"parallelism.vpp={vpp}",
                            f"schedule.name={kind}", "optimizer.warmup_steps=1",
                            "runtime.device=cpu"])
    dims = ParallelDims(pp=pp)
    pg = placement_group([{"CPU": pp}])
    ray.get(pg.ready())
    cls = ray.remote(concurrency_groups=RANK_CONCURRENCY_GROUPS)(TorchPipelineWorker)
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    workers = [cls.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(pg),
                           runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo",
                                                     "OMP_NUM_THREADS": "1"}}).remote(r, pp, 1)
               for r in range(pp)]
    try:
        host, port = ray.get(workers[0].create_store.remote(60.0))
        ray.get([w.init_process_group.remote(host, port, "cpu", 60.0) for w in workers])
        d = {"pp": pp, "dp": 1, "tp": 1}
        ray.get([w.build_torch.remote(spec.model_dump_json(), d, data_dir) for w in workers])
        ours, theirs = [], []
        for i in range(steps + 1):
            t = max(ray.get([w.timed_step.remote() for w in workers]))
            u = max(ray.get([w.torch_step.remote() for w in workers]))
            if i:  # the first step warms up
                ours.append(t)
                theirs.append(u)
        timelines = ray.get([w.timeline.remote() for w in workers])
    finally:
        for w in workers:
            ray.kill(w)
        remove_placement_group(pg)
    m = 16 // 2
    costs = measured_costs(timelines)
    sched, shape = build_schedule(kind, pp, vpp, m), pipe_shape(kind, pp, vpp, m)
    sim = simulate(sched, pp * vpp, m, costs, shape=shape)
    nccl = simulate(sched, pp * vpp, m, costs, nccl=True, shape=shape)
    t0 = min(s for row in timelines for _, s, _ in row)
    span = max(e for row in timelines for _, _, e in row) - t0
    busy = sum(e - s for row in timelines for n, s, e in row if "+" not in n
               and not any(k in n for k in ("RF", "SF", "RB", "SB")))  # compute only
    measured_bubble = 1 - busy / (pp * span)
    _ = dims
    return {"schedule": kind, "pp": pp, "vpp": vpp, "ours_s": statistics.median(ours),
            "predicted_s": sim.step_time, "nccl_s": nccl.step_time,
            "torch_s": statistics.median(theirs),
            "bubble_measured": measured_bubble, "bubble_formula": bubble_fraction(kind, pp, vpp, m)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    import ray

    from trainmesh.data.shards import ensure_tiny_corpus

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = str(ensure_tiny_corpus(os.path.join(tmp, "data")))
        for kind, vpp in (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2)):
            for pp in (2, 4):
                rows.append(measure(kind, pp, vpp, args.steps, data_dir))
    ray.shutdown()
    print(f"{'schedule':<17} {'pp':>2} {'vpp':>3} {'ours s':>7} {'sim s':>7} {'ours/sim':>8} "
          f"{'sim nccl s':>10} {'torch s':>8} {'ours/torch':>10} {'bubble meas':>11} "
          f"{'bubble plan':>11}")
    for r in rows:
        print(f"{r['schedule']:<17} {r['pp']:>2} {r['vpp']:>3} {r['ours_s']:>7.3f} "
              f"{r['predicted_s']:>7.3f} {r['ours_s'] / r['predicted_s']:>8.2f} "
              f"{r['nccl_s']:>10.3f} {r['torch_s']:>8.3f} {r['ours_s'] / r['torch_s']:>10.2f} "
              f"{r['bubble_measured']:>11.1%} {r['bubble_formula']:>11.1%}")


if __name__ == "__main__":
    main()
