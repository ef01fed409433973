"""Build time and peak memory per rank: the meta-device build (what trainmesh runs) against
building the whole model on every rank first (what it did before), in one run.

    .venv/bin/python bench/build.py [--preset 1b] [--ranks 4]

Both build the same ZeRO-3 (dp = ranks) model parts on CPU ranks (Ray actors, gloo). The full
build materialises and initialises the whole fp32 model in each rank and then shards it; its
ranks take turns (a barrier between them) so that this machine holds one whole model at a
time — each rank's peak is its own either way.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
GIB = 1024**3


class FullBuild:
    """One rank of the previous build: whole model, init, then FSDP2 over "dp"."""

    def build(self, spec_json: str, rank: int, world: int, store_path: str) -> dict:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from trainmesh.models.llama.model import Llama, LlamaArgs
        from trainmesh.parallel.zero import ZeroPolicy, apply_zero3
        from trainmesh.spec.job import JobSpec

        torch.set_num_threads(1)
        spec = JobSpec.model_validate_json(spec_json)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                                world_size=world)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        seconds = 0.0
        for turn in range(world):
            if turn == rank:
                t0 = time.perf_counter()
                model = Llama(LlamaArgs.from_config(spec.model, "cpu"))
                model.init_weights(spec.training.seed)
                apply_zero3(model, mesh["dp"], ZeroPolicy())
                seconds = time.perf_counter() - t0
            dist.barrier()
        params = sum(p.to_local().numel() * 4 for p in model.parameters())
        dist.destroy_process_group()
        return {"seconds": seconds, "params": params,
                "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--ranks", type=int, default=4)
    args = ap.parse_args()

    import ray

    from trainmesh.cli.loading import load_spec
    from trainmesh.controller.ray_group import RayWorkerGroup, placement_for
    from trainmesh.data.shards import ensure_tiny_corpus
    from trainmesh.models.llama.model_math import num_params
    from trainmesh.parallel.dims import ParallelDims
    from trainmesh.planning.topology import Topology

    n = args.ranks
    spec = load_spec(None, [f"model.preset={args.preset}", f"parallelism.dp={n}",
                            "training.seq_len=128", "training.microbatch_size=1",
                            f"training.global_batch_size={n}", "runtime.device=cpu"])
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    ray.init(address="local", num_cpus=n, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = str(ensure_tiny_corpus(os.path.join(tmp, "data")))
        dims = ParallelDims(dp=n)
        group = RayWorkerGroup(spec, dims, placement_for(spec, dims, Topology.uniform(1, n, "cpu")), env)
        try:
            t0 = time.perf_counter()
            group.build(spec.model_dump_json(), dims, data_dir)
            seconds = time.perf_counter() - t0
            results["meta (now)"] = [{"seconds": seconds, **r} for r in group.memory_reports()]
        finally:
            group.shutdown()
        actors = [ray.remote(num_cpus=1, runtime_env={"env_vars": env})(FullBuild).remote()
                  for _ in range(n)]
        store = os.path.join(tmp, "store")
        results["full (before)"] = ray.get([a.build.remote(spec.model_dump_json(), r, n, store)
                                            for r, a in enumerate(actors)])
    ray.shutdown()
    whole = 4 * num_params(spec.model) / GIB
    print(f"model {args.preset} ({whole:.2f} GiB fp32), ZeRO-3 over {n} CPU ranks")
    print(f"{'build':<14} {'s (slowest rank)':>17} {'params GiB/rank':>16} {'peak RSS GiB/rank':>18} "
          f"{'peak vs whole model':>20}")
    base = None
    for name, rows in results.items():
        peak = max(r["peak"] for r in rows) / GIB
        base = base or peak
        print(f"{name:<14} {max(r['seconds'] for r in rows):>17.1f} "
              f"{max(r['params'] for r in rows) / GIB:>16.3f} {peak:>18.2f} {peak / whole:>20.2f}")


if __name__ == "__main__":
    main()
