"""Tokens/s and peak memory per rank for tp = 1, 2, 4 (dp = 1), on this machine.

    .venv/bin/python bench/tensor_parallel.py [--preset small] [--steps 5]

Runs the real rank actors (gloo on CPU, NCCL on GPUs) on a local Ray instance; the first step
is a warm-up and is not timed. On CPU, ranks share the machine's cores, so TP > 1 shows the
communication and partitioning overhead rather than a speed-up.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()

    import ray

    from trainmesh.cli.loading import load_spec
    from trainmesh.controller.ray_group import RayWorkerGroup, placement_for
    from trainmesh.data.shards import ensure_tiny_corpus
    from trainmesh.parallel.dims import ParallelDims
    from trainmesh.planning.topology import Topology
    from trainmesh.spec.mesh_rules import valid_tp_degrees

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = str(ensure_tiny_corpus(os.path.join(tmp, "data")))
        shape = load_spec(None, [f"model.preset={args.preset}"]).model
        for tp in [t for t in (1, 2, 4) if t in valid_tp_degrees(shape.n_heads, shape.n_kv_heads)]:
            spec = load_spec(None, [f"model.preset={args.preset}", f"parallelism.tp={tp}",
                                    "parallelism.sequence_parallel=" + str(tp > 1).lower(),
                                    f"training.seq_len={args.seq_len}",
                                    f"training.global_batch_size={args.batch}",
                                    "training.microbatch_size=2", "optimizer.warmup_steps=1",
                                    f"training.steps={args.steps + 1}", "runtime.device=auto"])
            dims = ParallelDims(tp=tp)
            group = RayWorkerGroup(spec, dims, placement_for(spec, dims, Topology.uniform(1, tp, "cpu")),
                              {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
            try:
                group.build(spec.model_dump_json(), dims, data_dir)
                group.train_step()  # warm-up
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    group.train_step()
                dt = (time.perf_counter() - t0) / args.steps
                mem = group.memory_reports()
            finally:
                group.shutdown()
            tokens = args.batch * args.seq_len
            peak = max(m["peak"] for m in mem) / 2**20
            on_gpu = mem[0]["device"].startswith("cuda")
            rows.append((tp, dt, tokens / dt, 0.0 if on_gpu else peak, peak if on_gpu else 0.0))
    ray.shutdown()
    base = rows[0][2]
    print(f"model={args.preset} seq={args.seq_len} batch={args.batch} backend={group.backend}")
    print(f"{'tp':>3} {'step s':>8} {'tokens/s':>10} {'vs tp=1':>8} {'peak RSS MiB/rank':>18} "
          f"{'CUDA peak MiB':>14}")
    for tp, dt, tps, rss, cuda in rows:
        print(f"{tp:>3} {dt:>8.3f} {tps:>10.0f} {tps / base:>8.2f} {rss:>18.0f} {cuda:>14.0f}")


if __name__ == "__main__":
    main()
