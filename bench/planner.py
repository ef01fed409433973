"""Planning time from 8 to 16,384 accelerators (target: under 1 s at 16,384): the search as it
runs (tiers of idle accelerators, fewest first) beside every candidate priced, with the first
plans priced stage by stage (each pipeline stage at its own cost, the simulator playing the
schedule: ``planner._by_stage``) and, beside it in the same run, with every plan priced
at the least its stages allow, no play (``candidate._least_makespan``: the bound the search
ranks by first); the cost model's step time by microbatch size beside what a GPU measured.

    .venv/bin/python bench/planner.py
"""

from __future__ import annotations

import dataclasses
import time

from trainmesh.cli.loading import load_spec
from trainmesh.planning import candidate, planner
from trainmesh.planning.candidate import Candidate
from trainmesh.planning.cost_model import estimate
from trainmesh.planning.devices import device_spec
from trainmesh.planning.planner import PlanRequest, plan
from trainmesh.planning.topology import Topology

# One H200, seq 2048, bf16, model.kernels=auto, eager: step seconds and the GPU's busy share by
# (model, global batch, microbatch size) (`bench/kernels.py --variants auto --microbatch M
# --global-batch B`; bench/history/journal.md, "Microbatch size on a GPU", 2026-11-27, and that day's
# earlier H200 kit for the 8B-shaped microbatch 2). The cost model's per-microbatch figures
# are fitted to the first four (devices.py); the rest are runs it was not fitted to.
H200_STEP_S = {("1b", 16, 1): (0.968, 71), ("1b", 16, 2): (0.568, 100), ("1b", 16, 4): (0.528, 100),
               ("1b", 16, 8): (0.492, 100), ("1b", 8, 2): (0.370, 72), ("1b", 8, 4): (0.272, 100),
               ("8b8", 8, 2): (0.457, None), ("8b8", 16, 4): (0.830, 100)}
# the cost model's fitting points (devices.py): not a check of it
FITTED = {("1b", 16, 1), ("1b", 16, 2), ("1b", 16, 4), ("1b", 16, 8)}
MODELS = {"1b": ["model.preset=1b"], "8b8": ["model.preset=8b", "model.n_layers=8"]}


def microbatch_table() -> None:
    h200 = device_spec("h200")
    flat = dataclasses.replace(h200, kernel_overhead_s=0.0, host_dispatch_s=0.0)
    print("\nOne H200, seq 2048: step s, the cost model beside what the GPU ran (8b8: 8 of 8B's "
          "blocks)\n'recorded': figures measured on one H200 on 2026-11-27 (bench/RESULTS.md), "
          "not measured by this run; rows marked * are the cost model's fitting points")
    print(f"{'model':>6} {'batch':>5} {'microbatch':>10} {'predicted':>10} {'FLOPs only':>10} "
          f"{'recorded':>9} {'ratio':>6} {'host-bound':>10} {'busy % pred':>11} {'GPU busy %':>10}")
    for (name, batch, mbs), (recorded, busy) in H200_STEP_S.items():
        model = load_spec(None, MODELS[name]).model
        c = Candidate(1, 1, 1, 1, "1f1b", mbs, batch // mbs, "none")
        e = estimate(model, c, 2048, h200, 1, compute_bytes=2, fused=True)
        flops_only = estimate(model, c, 2048, flat, 1, compute_bytes=2, fused=True).step_time_s
        device_s = estimate(model, c, 2048, dataclasses.replace(h200, host_dispatch_s=0.0), 1,
                            compute_bytes=2, fused=True).step_time_s
        fitted = "*" if (name, batch, mbs) in FITTED else " "
        print(f"{name:>5}{fitted} {batch:>5} {mbs:>10} {e.step_time_s:>10.3f} {flops_only:>10.3f} "
              f"{recorded:>9.3f} "
              f"{e.step_time_s / recorded:>6.2f} {'yes' if e.host_bound else 'no':>10} "
              f"{100 * device_s / e.step_time_s:>11.0f} {'-' if busy is None else busy:>10}")


def _cold() -> None:
    """The simulator's plays and the bubbles kept between searches, dropped."""
    candidate._played.cache_clear()
    candidate._least_makespan.cache_clear()
    candidate.bubble_fraction.cache_clear()


def _timed(req: PlanRequest, topo: Topology, every: bool = False) -> tuple[float, object]:
    _cold()
    t0 = time.perf_counter()
    result = plan(req, topo, every=every)
    return time.perf_counter() - t0, result


def _label(result) -> str:
    c = result.best.candidate if result.plans else None
    return f"({c.tp}, {c.pp}, {c.dp}, {c.ep}, {c.vpp})" if c else "-"


# float8 tensorwise under torch.compile on the same H200 (2026-11-27, bench/RESULTS.md): step s
# by (model, global batch, microbatch size); the cost model's float8 constants are fitted to
# the first (its cast bytes, to the step's ratio to bf16's) and the last (its host factor).
H200_FLOAT8_S = {("8b8", 16, 4): 0.695, ("8b8", 8, 2): 0.394, ("1b", 8, 2): 0.500}
FLOAT8_FITTED = {("8b8", 16, 4), ("1b", 8, 2)}


def float8_table() -> None:
    h200 = device_spec("h200")
    print("\nOne H200, seq 2048, float8 tensorwise: step s, the cost model beside what the GPU "
          "ran ('recorded', 2026-11-27); rows marked * are the float8 constants' fitting points")
    print(f"{'model':>6} {'batch':>5} {'microbatch':>10} {'bf16 pred':>9} {'float8 pred':>11} "
          f"{'recorded':>9} {'ratio':>6} {'host-bound':>10}")
    for (name, batch, mbs), recorded in H200_FLOAT8_S.items():
        model = load_spec(None, MODELS[name]).model
        c = Candidate(1, 1, 1, 1, "1f1b", mbs, batch // mbs, "none")
        bf16, f8 = (estimate(model, c, 2048, h200, 1, compute_bytes=2, fused=True, float8=f)
                    for f in ("none", "tensorwise"))
        fitted = "*" if (name, batch, mbs) in FLOAT8_FITTED else " "
        print(f"{name:>5}{fitted} {batch:>5} {mbs:>10} {bf16.step_time_s:>9.3f} "
              f"{f8.step_time_s:>11.3f} {recorded:>9.3f} {f8.step_time_s / recorded:>6.2f} "
              f"{'yes' if f8.host_bound else 'no':>10}")


def main() -> None:
    model = load_spec(None, ["model.preset=70b"]).model
    print("Llama 70B, seq 8192, global batch max(GPUs, 1024), nodes of 8 H100. 'plan s': the "
          "search (idle tiers, fewest first, until 10 plans); 'bound s': the same, no plan "
          "priced stage by stage; 'every s': every candidate priced")
    print(f"{'GPUs':>7} {'nodes':>6} {'plan s':>8} {'bound s':>8} {'every s':>8} {'weighed':>8} "
          f"{'feasible':>9} {'rejected':>9} {'unpriced':>9}  best (tp, pp, dp, ep, vpp)")
    first = planner.PRICED_FIRST
    for gpus in (8, 64, 512, 1024, 4096, 16384):
        topo = Topology.uniform(gpus // 8, 8, "h100")
        req = PlanRequest(model, global_batch_size=max(gpus, 1024), seq_len=8192)
        took, result = _timed(req, topo)
        planner.PRICED_FIRST = 0
        bound, _ = _timed(req, topo)
        planner.PRICED_FIRST = first
        every_s, every = _timed(req, topo, every=True)
        same = "" if _label(every) == _label(result) else f" (every: {_label(every)})"
        print(f"{gpus:>7} {gpus // 8:>6} {took:>8.3f} {bound:>8.3f} {every_s:>8.3f} "
              f"{len(result.plans):>8} {len(every.plans):>9} {len(every.rejected):>9} "
              f"{result.unpriced:>9}  {_label(result)}{same}")
    print("\nMoE and the largest dense preset, seq 4096, global batch max(GPUs, 15360) for "
          "DeepSeek-V3 and Kimi K2 (DeepSeek's), max(GPUs, 1024) for the rest, `parallelism: "
          "auto`")
    print("'+ table s': then the 10 rows of a plan's table priced stage by stage "
          "(`trainmesh plan` does; a re-plan does not)")
    print(f"{'model':>18} {'GPUs':>6} {'plan s':>8} {'+ table s':>9} {'every s':>8} {'ratio':>6} "
          f"{'weighed':>8} {'feasible':>9} {'rejected':>9}  best (tp, pp, dp, ep, vpp)")
    for preset in ("mixtral-8x22b", "qwen3-235b-a22b", "deepseek-v3-671b", "kimi-k2", "405b"):
        model = load_spec(None, [f"model.preset={preset}"]).model
        batch = 15360 if preset in ("deepseek-v3-671b", "kimi-k2") else 1024
        for gpus in (1024, 2048, 16384):
            topo = Topology.uniform(gpus // 8, 8, "h100")
            req = PlanRequest(model, global_batch_size=max(gpus, batch), seq_len=4096)
            took, result = _timed(req, topo)
            t0 = time.perf_counter()
            result.first(10)
            table = time.perf_counter() - t0
            every_s, every = _timed(req, topo, every=True)
            same = "" if _label(every) == _label(result) else f" (every: {_label(every)})"
            print(f"{preset:>18} {gpus:>6} {took:>8.3f} {table:>9.3f} {every_s:>8.3f} "
                  f"{took / every_s:>6.2f} "
                  f"{len(result.plans):>8} {len(every.plans):>9} {len(every.rejected):>9}  "
                  f"{_label(result)}{same}")
    microbatch_table()
    float8_table()

if __name__ == "__main__":
    main()
