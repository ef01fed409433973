"""Data parallel on CPU ranks, in one run: ZeRO-3 over all of dp against hybrid sharding
(HSDP, ZeRO-3 inside groups, gradients all-reduced across them) at dp 4, under both ZeRO-3
policies, a dp that does not divide the batch (dp 3 over 8 microbatches: one replica runs
a padding microbatch) against dp 4 and dp 2, and an MoE model at ep 2 under either sharding
(``--moe-preset``: its experts split over ep, sharded over the rest of the shard group).

    .venv/bin/python bench/data_parallel.py [--preset small] [--moe-preset tiny-moe] [--steps 5]

Real rank actors (gloo) on a local Ray instance; the first step is a warm-up and is not timed.
On this machine the ranks share its cores, so the figures show each layout's overhead, not the
speed-up a cluster gives; the HSDP case is what a planner weighs at scale (fewer participants
per collective), measured here only for what it costs at 4 ranks.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

# (label, dp, dp_replicate, keep_gathered, ep: the MoE model's, 1 for the dense one)
CASES = [("zero3 dp4 keep", 4, 1, True, 1), ("hsdp 2x2 keep", 4, 2, True, 1),
         ("zero3 dp4 regather", 4, 1, False, 1), ("hsdp 2x2 regather", 4, 2, False, 1),
         ("zero3 dp3 (uneven) keep", 3, 1, True, 1), ("zero3 dp2 keep", 2, 1, True, 1),
         ("moe zero3 dp4 ep2 keep", 4, 1, True, 2), ("moe hsdp 2x2 ep2 keep", 4, 2, True, 2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--moe-preset", default="tiny-moe")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()

    import ray

    from trainmesh.cli.loading import load_spec
    from trainmesh.controller.ray_group import RayWorkerGroup, placement_for
    from trainmesh.data.shards import ensure_tiny_corpus
    from trainmesh.parallel.dims import ParallelDims
    from trainmesh.planning.topology import Topology

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = str(ensure_tiny_corpus(os.path.join(tmp, "data")))
        for label, dp, rep, keep, ep in CASES:
            preset = args.moe_preset if ep > 1 else args.preset
            spec = load_spec(None, [f"model.preset={preset}", f"parallelism.dp={dp}",
                                    f"parallelism.ep={ep}",
                                    f"parallelism.dp_replicate={rep}",
                                    f"parallelism.keep_gathered={str(keep).lower()}",
                                    f"training.seq_len={args.seq_len}",
                                    "training.global_batch_size=8", "training.microbatch_size=1",
                                    "optimizer.warmup_steps=1", f"training.steps={args.steps + 1}",
                                    "runtime.device=cpu"])
            dims = ParallelDims(dp=dp, ep=ep)
            group = RayWorkerGroup(spec, dims, placement_for(spec, dims, Topology.uniform(1, dp, "cpu")),
                                   {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
            try:
                group.build(spec.model_dump_json(), dims, data_dir)
                group.train_step()  # warm-up
                t0 = time.perf_counter()
                losses = [group.train_step()[0]["loss"] for _ in range(args.steps)]
                dt = (time.perf_counter() - t0) / args.steps
                mem = group.memory_reports()
            finally:
                group.shutdown()
            state = max(m["params"] + m["grads"] + m["optimizer"] for m in mem) / 2**20
            rows.append((label, dt, 8 * args.seq_len / dt, state, losses[-1], ep))
    ray.shutdown()
    base = {}  # each model's dp-4 ZeRO-3 row
    for row in rows:
        base.setdefault(row[5], row[1])
    print(f"model={args.preset} (moe rows: {args.moe_preset}) seq={args.seq_len} global batch 8 × "
          f"microbatch 1, {args.steps} timed steps")
    print(f"{'layout':<26} {'step s':>8} {'tokens/s':>10} {'vs dp4 zero3':>13} "
          f"{'state MiB/rank':>15} {'last loss':>10}")
    for label, dt, tps, state, loss, ep in rows:
        print(f"{label:<26} {dt:>8.3f} {tps:>10.0f} {dt / base[ep]:>13.2f} {state:>15.1f} {loss:>10.4f}")


if __name__ == "__main__":
    main()
