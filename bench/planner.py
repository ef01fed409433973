"""Planning time from 8 to 16,384 accelerators (target: under 1 s at 16,384).

    .venv/bin/python bench/planner.py
"""

from __future__ import annotations

import time

from trainmesh.cli.loading import load_spec
from trainmesh.planning.planner import PlanRequest, plan
from trainmesh.planning.topology import Topology


def main() -> None:
    model = load_spec(None, ["model.preset=70b"]).model
    print(f"{'GPUs':>7} {'nodes':>6} {'plan s':>8} {'feasible':>9} {'rejected':>9}  best (tp, pp, dp, vpp)")
    for gpus in (8, 64, 512, 1024, 4096, 16384):
        topo = Topology.uniform(gpus // 8, 8, "h100")
        req = PlanRequest(model, global_batch_size=max(gpus, 1024), seq_len=8192)
        t0 = time.perf_counter()
        result = plan(req, topo)
        dt = time.perf_counter() - t0
        best = "-"
        if result.plans:
            c = result.best.candidate
            best = f"({c.tp}, {c.pp}, {c.dp}, {c.vpp})"
        print(f"{gpus:>7} {gpus // 8:>6} {dt:>8.3f} {len(result.plans):>9} {len(result.rejected):>9}  {best}")


if __name__ == "__main__":
    main()
