"""Per-step overhead: trainmesh vs a plain PyTorch DDP loop vs Ray Train v2's TorchTrainer, on
the same model class, shapes, data order and optimizer, in one run (CPU, gloo, 2 ranks); and
the plain loop over FSDP2 configured as trainmesh's ZeRO-3; trainmesh runs both ways (ZeRO-3
with ``parallelism.dp=2`` pinned, and ``parallelism: auto`` on the same 2 ranks, where the
planner chooses DDP on CPU ranks): each against the plain loop of the same algorithm is what
trainmesh itself adds.

All three train the ``small`` preset (seq 128, global batch 16, microbatch 4, dp = 2, AdamW);
the median step time is taken over the steps after the first few (warm-up). trainmesh's step
is the controller's wall time per step (an RPC to every rank, metrics queued for MLflow);
the DDP loop's is rank 0's loop time; Ray Train's includes a ``ray.train.report`` per step,
as a user of it would write.

    python bench/overhead.py [--steps 30] [--warmup 5] [--trials 3] [--skip-ray-train]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

ARGS = ["model.preset=small", "training.seq_len=128", "training.global_batch_size=16",
        "training.microbatch_size=4", "parallelism.dp=2", "runtime.device=cpu",
        "checkpoint.every=0", "checkpoint.save_final=false", "optimizer.warmup_steps=2"]


def _spec(steps: int, out: Path, extra=()):
    from trainmesh.cli.loading import load_spec

    return load_spec(None, [*ARGS, f"training.steps={steps}", f"runtime.output_dir={out}", *extra])


def _loop(rank: int, world: int, spec, data_dir: str, report=None, fsdp: bool = False) -> list[float]:
    """The plain data-parallel loop: DDP, gradient accumulation over microbatches. ``fsdp``:
    the same loop over FSDP2 as trainmesh's ZeRO-3 keeps it (a unit per block and the root,
    gathered all step, gradients reduce-scattered after the last microbatch)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from trainmesh.data.dataset import TokenDataset
    from trainmesh.data.shards import read_tokens
    from trainmesh.engine.step import build_lr_scheduler, build_optimizer
    from trainmesh.models.llama.model import Llama, LlamaArgs

    torch.set_num_threads(1)
    model = Llama(LlamaArgs.from_config(spec.model))
    model.init_weights(spec.training.seed)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh, reshard_after_forward=False)
        ddp = fully_shard(model, mesh=mesh, reshard_after_forward=False)
    else:
        ddp = DistributedDataParallel(model)
    opt = build_optimizer(model, spec.optimizer)  # over the sharded parameters under FSDP2
    sched = build_lr_scheduler(opt, spec.optimizer, spec.training.steps)
    tr = spec.training
    data = TokenDataset(read_tokens(data_dir), tr.seq_len)
    times = []
    for step in range(tr.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        mbs = data.microbatches(tr.seed, step, tr.global_batch_size, rank, world, tr.microbatch_size)
        for i, (x, y) in enumerate(mbs):
            if fsdp:
                ddp.set_requires_gradient_sync(i == len(mbs) - 1)
                (ddp(x, y) / len(mbs)).backward()
            elif i < len(mbs) - 1:
                with ddp.no_sync():
                    (ddp(x, y) / len(mbs)).backward()
            else:
                (ddp(x, y) / len(mbs)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.optimizer.grad_clip)
        opt.step()
        sched.step()
        if report is not None:
            report(step)
        times.append(time.perf_counter() - t0)
    return times


def _ddp_worker(rank: int, world: int, spec_json: str, data_dir: str, port: int, out: str,
                fsdp: bool = False) -> None:
    import json

    import torch.distributed as dist

    from trainmesh.spec.job import JobSpec

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    times = _loop(rank, world, JobSpec.model_validate_json(spec_json), data_dir, fsdp=fsdp)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def plain_ddp(spec, data_dir: str, tmp: Path, fsdp: bool = False) -> list[float]:
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / ("fsdp.json" if fsdp else "ddp.json")
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(_ddp_worker, args=(2, spec.model_dump_json(), data_dir, port, str(out), fsdp),
             nprocs=2)
    return json.loads(out.read_text())


def _ray_train_loop(config) -> None:
    import ray.train
    import torch.distributed as dist

    from trainmesh.spec.job import JobSpec

    spec = JobSpec.model_validate_json(config["spec"])
    times = _loop(dist.get_rank(), dist.get_world_size(), spec, config["data_dir"],
                  report=lambda step: ray.train.report({"step": step + 1}))
    if dist.get_rank() == 0:
        Path(config["out"]).write_text(__import__("json").dumps(times))


def ray_train(spec, data_dir: str, tmp: Path) -> list[float]:
    import json

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = tmp / "ray-train.json"
    TorchTrainer(_ray_train_loop,
                 train_loop_config={"spec": spec.model_dump_json(), "data_dir": data_dir,
                                    "out": str(out)},
                 scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                              resources_per_worker={"CPU": 1}),
                 run_config=RunConfig(name="bench-overhead", storage_path=str(tmp / "rt"))).fit()
    return json.loads(out.read_text())


def trainmesh_steps(spec) -> tuple[list[float], dict]:
    """The controller's step times of a trainmesh run of ``spec``, and the plan it ran."""
    from mlflow.tracking import MlflowClient

    from trainmesh.controller.launch import run_job

    summary = run_job(spec, environ={}, show_progress=False)
    hist = MlflowClient(summary["tracking_uri"]).get_metric_history(summary["mlflow_run_id"],
                                                                    "step_time_s")
    return [m.value for m in sorted(hist, key=lambda m: m.step)], summary["plan"]


def _layout(plan: dict) -> str:
    """How a run's data parallel ran, from its summary's plan."""
    ddp = plan["dp"] > 1 and plan["dp_replicate"] == plan["dp"]
    return f"tp={plan['tp']} pp={plan['pp']} dp={plan['dp']}, {'DDP' if ddp else 'ZeRO-3'}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--trials", type=int, default=1,
                    help="run every system this many times, one after another in turn; a ratio "
                    "is taken within a trial (this machine's speed drifts between minutes)")
    ap.add_argument("--skip-ray-train", action="store_true")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="extra spec overrides for the trainmesh run only")
    args = ap.parse_args()
    import ray

    from trainmesh.data.shards import ensure_tiny_corpus

    extra = f", {', '.join(args.overrides)}" if args.overrides else ""
    ddp, fsdp = "plain DDP loop (torch.multiprocessing)", "plain FSDP2 loop (ZeRO-3 as trainmesh keeps it)"
    trials: list[dict[str, float]] = []  # per trial: system -> median step s
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        spec = _spec(args.steps, tmp / "tm")
        data_dir = str(ensure_tiny_corpus(tmp / "data"))
        for t in range(args.trials):
            rows = {ddp: plain_ddp(spec, data_dir, tmp), fsdp: plain_ddp(spec, data_dir, tmp, fsdp=True)}
            ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
            try:
                rows[f"trainmesh run (parallelism.dp=2 pinned: ZeRO-3{extra})"], _ = trainmesh_steps(
                    _spec(args.steps, tmp / f"tm{t}", args.overrides))
                # the planner's own choice for the same 2 ranks (on CPU ranks: DDP)
                times, chosen = trainmesh_steps(_spec(args.steps, tmp / f"tm-auto{t}", [
                    "parallelism=auto", "elastic.max_world_size=2", *args.overrides]))
                rows[f"trainmesh run (parallelism: auto on 2 ranks, the planner's choice: "
                     f"{_layout(chosen)}{extra})"] = times
                if not args.skip_ray_train and t == 0:
                    rows["Ray Train v2 TorchTrainer"] = ray_train(spec, data_dir, tmp)
            finally:
                ray.shutdown()
            trials.append({name: statistics.median(times[args.warmup:]) for name, times in rows.items()})
    print(f"\nsmall preset, seq 128, global batch 16, microbatch 4, dp=2, CPU/gloo; median of "
          f"steps {args.warmup + 1}..{args.steps}; {args.trials} trial(s): medians over trials, "
          f"ratios taken within each trial (min–max beside)")
    print("| system | median step s | vs plain DDP loop | vs plain FSDP2 loop |")
    print("|---|---:|---:|---:|")

    def ratio(name: str, base: str) -> str:
        r = [tr[name] / tr[base] for tr in trials if name in tr]
        spread = f" ({min(r):.2f}–{max(r):.2f})" if len(r) > 1 else ""
        return f"{statistics.median(r):.2f}×{spread}"

    for name in trials[0]:
        med = statistics.median(tr[name] for tr in trials if name in tr)
        print(f"| {name} | {med:.3f} | {ratio(name, ddp)} | {ratio(name, fsdp)} |")


if __name__ == "__main__":
    sys.exit(main())
