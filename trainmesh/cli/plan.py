"""``trainmesh plan``: rank the feasible meshes for a spec on a cluster, as a table or JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys

from trainmesh.cli.loading import add_overrides_arg, device_kind, load_spec
from trainmesh.planning.explain import explain
from trainmesh.planning.job_plan import PlanError, plan_job, request_for
from trainmesh.planning.published import compare, price, published_layout
from trainmesh.planning.topology import Topology, topology_from_ray
from trainmesh.spec.job import JobSpec


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="rank feasible (tp, pp, dp, vpp, ...) plans for a cluster")
    p.add_argument("spec", help="job spec YAML")
    add_overrides_arg(p)
    p.add_argument("--nodes", type=int, help="plan for a hand-described cluster of N nodes")
    p.add_argument("--gpus-per-node", type=int, default=8, help="accelerators per node")
    p.add_argument("--device", default=None, type=device_kind,
                   help="h100, h200, a100-40gb, a100-80gb, b200, l40s, cpu")
    p.add_argument("--top", type=int, default=10, help="rows to show (of the plans weighed: "
                   "those leaving the fewest accelerators idle, at least 10 where as many fit)")
    p.add_argument("--json", action="store_true", help="print the plans as JSON (best first)")
    return p


def cluster_topology(spec: JobSpec, args: argparse.Namespace) -> Topology:
    device = args.device or spec.topology.device
    ray_module = sys.modules.get("ray")
    if args.nodes is not None:
        topo = Topology.uniform(args.nodes, args.gpus_per_node, device or "h100")
    elif ray_module is not None and ray_module.is_initialized():  # (the Python API's caller's)
        topo = topology_from_ray(device, spec.runtime.cpus_per_rank)
    elif spec.runtime.ray_address == "local":  # this machine, as `trainmesh run` would use it
        ranks = int((os.cpu_count() or 1) // spec.runtime.cpus_per_rank) or 1
        topo = Topology.uniform(1, ranks, device or "cpu")
    else:
        import ray

        from trainmesh.controller.launch import quiet_ray_start_notices

        quiet_ray_start_notices()
        ray.init(address=spec.runtime.ray_address, log_to_driver=False)
        try:
            topo = topology_from_ray(device, spec.runtime.cpus_per_rank)
        finally:
            ray.shutdown()
    return topo.with_overrides(spec.topology.overrides())


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec, args.overrides)
    if args.nodes is not None and (args.nodes < 1 or args.gpus_per_node < 1):
        print("--nodes/--gpus-per-node: must be at least 1; give a positive count",
              file=sys.stderr)
        return 2
    topo = cluster_topology(spec, args)
    try:
        _, result = plan_job(spec, topo)
    except PlanError as err:
        print(err, file=sys.stderr)
        return 2
    rows = [p.as_row() for p in result.first(args.top)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0 if rows else 1
    _print_table(spec, topo, rows)
    print(explain(result))
    pub = published_layout(spec.model)
    if pub is not None:  # the layout the model's authors published, priced here beside it
        auto = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(
            update={"auto": True})})
        print()
        print(compare(result, price(request_for(auto), topo, pub), pub,
                      max(n.accelerators for n in topo.nodes)))
    return 0


def _print_table(spec: JobSpec, topo: Topology, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    sizes = sorted({n.accelerators for n in topo.nodes})
    per = str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}–{sizes[-1]}"
    title = (f"{spec.name}: {len(topo.nodes)} node(s) × {per} {topo.device.name} "
             f"= {topo.world_size} accelerators")
    table = Table(title=title)
    moe = spec.model.moe is not None  # the expert-parallel degree, for MoE models
    # context parallel ("cp": degree and mode) where any plan shown uses it
    cp = any(r["cp"] > 1 for r in rows)
    # zero3: "keep" gathers each rank's parameters once per step and reduce-scatters once;
    # "regather" gathers and reduce-scatters every microbatch (less memory, more traffic);
    # hsdp: "r×s" hybrid sharding, ZeRO-3 inside groups of s replicas, r groups ("-": over dp).
    cols = ["tp", "pp", "dp", *(["cp"] if cp else []), *(["ep"] if moe else []), "idle", "vpp",
            "schedule", "mbs", "micro", "recompute", "zero3", "hsdp", "mem GiB", "step s",
            "tokens/s", "TFLOP/s/gpu", "MFU", "bubble"]
    for c in cols:
        table.add_column(c, justify="left" if c in ("schedule", "recompute", "zero3", "hsdp")
                         else "right")
    for r in rows:
        cp_cell = [f"{r['cp']} {r['cp_mode']}" if r["cp"] > 1 else "1"] if cp else []
        table.add_row(str(r["tp"]), str(r["pp"]), str(r["dp"]), *cp_cell,
                      *([str(r["ep"])] if moe else []),
                      str(r["idle"]), str(r["vpp"]), r["schedule"],
                      str(r["microbatch_size"]), str(r["num_microbatches"]), r["recompute"],
                      "keep" if r["keep_gathered"] else "regather",
                      (f"{r['dp_replicate']}×{r['dp'] // r['dp_replicate']}"
                       if r["dp_replicate"] > 1 else "-"),
                      f"{r['memory_per_rank_gib']:.1f}", f"{r['step_time_s']:.3g}",
                      f"{r['tokens_per_s']:,.0f}", f"{r['tflops_per_gpu']:.1f}",
                      f"{r['mfu']:.1%}", f"{r['bubble_fraction']:.1%}")
    Console(width=160).print(table)
