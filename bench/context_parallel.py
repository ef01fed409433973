"""Context parallel on CPU ranks, in one run: ring against all-gather attention at cp 1, 2
and 4 for the same model, batch and sequence — step time, the activations autograd saves per
rank, the time each rank spent blocked on the ring's communication (exposed) and the bytes it
sent over the ring.

    .venv/bin/python bench/context_parallel.py [--preset small] [--seq-len 2048] [--steps 3]
    .venv/bin/python bench/context_parallel.py --mla [--seq-len 2048]

``--mla``: a DeepSeek-V3-shaped model (Multi-head Latent Attention, ``MLA`` below) with each
layout twice, the ring moving the compressed latents (``parallelism.cp_latent``, expanded
where they arrive) and moving the expanded keys and values.

Real rank actors (gloo) on a local Ray instance; the first step is a warm-up and is not timed.
cp ranks split one sequence, so the batch's work is the same in every row: on this machine
the ranks share its cores, so the step times show each mode's overhead, not the speed-up of
a cluster. What cp buys is in the activations column: about 1/cp of a whole sequence's.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

CASES = [("cp1", 1, "ring"), ("cp2 ring", 2, "ring"), ("cp2 allgather", 2, "allgather"),
         ("cp4 ring", 4, "ring"), ("cp4 allgather", 4, "allgather")]
# tiny-dsv3 widened: 8 heads of 48 (query/key: 32 + 16 rotary) and 32 (values), a latent of
# 64 + 16: the ring moves 80 values a token where the expanded keys and values are 768
MLA = ["model.preset=tiny-dsv3", "model.dim=256", "model.n_heads=8", "model.n_kv_heads=8",
       "model.ffn_dim=704", "model.mla.q_lora_rank=64", "model.mla.kv_lora_rank=64",
       "model.mla.qk_nope_head_dim=32", "model.mla.qk_rope_head_dim=16",
       "model.mla.v_head_dim=32", "model.moe.expert_ffn_dim=128"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mla", action="store_true", help="MLA: the latent against expanded K/V")
    args = ap.parse_args()
    cases = [(label, cp, mode, None) for label, cp, mode in CASES]
    if args.mla:
        cases = [(f"{label} {'latent' if latent else 'expanded'}", cp, mode, latent)
                 for label, cp, mode in CASES for latent in ((True,) if cp == 1 else (True, False))]

    import ray

    from trainmesh.cli.loading import load_spec
    from trainmesh.controller.launch import quiet_ray_start_notices
    from trainmesh.controller.ray_group import RayWorkerGroup, placement_for
    from trainmesh.data.shards import ensure_tiny_corpus
    from trainmesh.parallel.dims import ParallelDims
    from trainmesh.planning.topology import Topology

    quiet_ray_start_notices()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = str(ensure_tiny_corpus(os.path.join(tmp, "data")))
        for label, cp, mode, latent in cases:
            model = MLA if args.mla else [f"model.preset={args.preset}"]
            if latent is not None:
                model = [*model, f"parallelism.cp_latent={latent}"]
            spec = load_spec(None, [*model,
                                    f"model.max_seq_len={args.seq_len}", f"parallelism.cp={cp}",
                                    f"parallelism.cp_mode={mode}", f"training.seq_len={args.seq_len}",
                                    "training.global_batch_size=2", "training.microbatch_size=1",
                                    "optimizer.warmup_steps=1", f"training.steps={args.steps + 1}",
                                    "runtime.device=cpu"])
            dims = ParallelDims(cp=cp)
            group = RayWorkerGroup(spec, dims, placement_for(spec, dims, Topology.uniform(1, cp, "cpu")),
                                   {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
            try:
                group.build(spec.model_dump_json(), dims, data_dir)
                group.train_step(measure_activations=True)  # warm-up; counts saved activations
                acts = max(m["activations"] for m in group.memory_reports()) / 2**20
                t0 = time.perf_counter()
                stats = [group.train_step() for _ in range(args.steps)]
                dt = (time.perf_counter() - t0) / args.steps
                losses = [s[0]["loss"] for s in stats]
                # each rank's measured exposed communication (the ring's waits, the loss mean)
                waited = max(sum(s[r]["breakdown"]["comm_s"] for s in stats) for r in range(cp))
                sent = max(s[r]["breakdown"].get("cp_sent_mib", 0.0) for s in stats for r in range(cp))
            finally:
                group.shutdown()
            rows.append((label, dt, 2 * args.seq_len / dt, acts, waited / args.steps, sent,
                         losses[-1]))
    ray.shutdown()
    base_dt, base_acts = rows[0][1], rows[0][3]
    print(f"model={'MLA' if args.mla else args.preset} seq={args.seq_len}, global batch 2 × "
          f"microbatch 1, {args.steps} timed steps; cp ranks share this machine's cores")
    print(f"{'layout':<24} {'step s':>8} {'tokens/s':>9} {'vs cp1':>7} {'acts MiB/rank':>14} "
          f"{'vs cp1':>7} {'exposed comm s':>15} {'sent MiB/rank':>14} {'last loss':>10}")
    for label, dt, tps, acts, waited, sent, loss in rows:
        print(f"{label:<24} {dt:>8.3f} {tps:>9.0f} {dt / base_dt:>7.2f} {acts:>14.1f} "
              f"{acts / base_acts:>7.2f} {waited:>15.3f} {sent:>14.1f} {loss:>10.4f}")


if __name__ == "__main__":
    main()
