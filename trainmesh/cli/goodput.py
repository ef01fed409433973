"""``trainmesh goodput``: a job's goodput on a failing cluster, by simulation, for trainmesh's
recovery (warm, cold) and for restart-from-checkpoint, side by side on the same faults."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from trainmesh.cli.loading import add_overrides_arg, device_kind, load_spec
from trainmesh.controller.ray_group import HANG_FLOOR_S, HANG_STEPS, hang_found_after_s
from trainmesh.planning.cadence import choose, system_mtbf_s
from trainmesh.planning.failure_costs import MEASURED, SOURCES, Assumptions, MeshCosts, mesh_costs
from trainmesh.planning.goodput import CAUSES, KINDS, STRATEGIES, Cluster, Fault, poisson_faults, simulate
from trainmesh.planning.job_plan import PlanError, replan_job
from trainmesh.planning.topology import Topology
from trainmesh.spec.job import JobSpec


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("goodput", help="simulate a job's goodput on a failing cluster: trainmesh "
                                       "(warm, cold) beside restart-from-checkpoint")
    p.add_argument("spec", help="job spec YAML")
    add_overrides_arg(p)
    p.add_argument("--nodes", type=int, action="append", required=True,
                   help="nodes the job is planned on (repeat for several cluster sizes)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="accelerators per node")
    p.add_argument("--device", default=None, type=device_kind, help="h100, h200, a100-80gb, b200, ... "
                                                  "(default: the spec's topology.device, else h100)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--mtbf-node-hours", type=float,
                      help="mean hours between faults of one node (default: elastic.mtbf_node_hours)")
    rate.add_argument("--failures-per-day", type=float,
                      help="faults per day of the whole cluster (instead of --mtbf-node-hours)")
    rate.add_argument("--trace", help="faults to replay instead of random ones: a file of lines "
                                      "'HOURS NODE [crash|unreachable|hang|process|notice]'")
    p.add_argument("--days", type=float, default=30.0, help="wall-clock days simulated")
    p.add_argument("--spare-nodes", type=int, default=0, help="idle nodes beside the job's")
    p.add_argument("--replace-minutes", type=float, default=30.0,
                   help="a failed node is replaced and rejoins after this many minutes")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated failures")
    for f in dataclasses.fields(Assumptions):
        p.add_argument("--" + f.name.replace("_", "-"), type=float, default=None,
                       help=f"cost assumption (default {f.default})")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--png", help="write each strategy's hours lost over time (one panel per "
                   "cluster size) to this PNG")
    return p


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec, args.overrides)
    problem = _bad_args(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    a = assumptions(args)
    try:
        results = simulate_sizes(spec, args, a)
    except Refused as err:
        print(err, file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"assumptions": dataclasses.asdict(a), "measured": {
                              k: {"value": v, "source": SOURCES[k]}
                              for k, v in dataclasses.asdict(MEASURED).items()}, "days": args.days,
                          "results": results}, indent=1))
    else:
        _print(spec, args, a, results)
    if args.png:
        _plot(results, args.png)
        print(f"wrote {args.png}")
    return 0


class Refused(ValueError):
    """What a simulation cannot be run for, naming the flag to fix."""


def assumptions(args: argparse.Namespace) -> Assumptions:
    """The cost assumptions the flags give (the rest at their defaults)."""
    return Assumptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Assumptions)
                          if getattr(args, f.name) is not None})


def simulate_sizes(spec: JobSpec, args: argparse.Namespace, a: Assumptions) -> list[dict]:
    """Each ``--nodes`` cluster's simulation: its first mesh, the faults and every strategy's
    outcome (what ``--json`` prints under ``results``). ``Refused`` says which flag to fix."""
    horizon = args.days * 86400
    trace = _read_trace(args.trace) if args.trace else None
    results = []
    for nodes in args.nodes:
        hours = spec.elastic.mtbf_node_hours if args.mtbf_node_hours is None else args.mtbf_node_hours
        total = nodes + args.spare_nodes
        if args.failures_per_day:
            hours = total * 24 / args.failures_per_day
        cluster = Cluster(nodes, args.spare_nodes, hours, args.replace_minutes * 60)
        if trace and max(f.node for f in trace) >= cluster.total:
            raise Refused(f"--trace: node {max(f.node for f in trace)} is not in a cluster of "
                          f"{cluster.total} nodes (numbered from 0); fix the trace or add --nodes")
        plan = _planner(spec, args.gpus_per_node, args.device, a)
        try:
            every = _cadence(spec, hours)
            faults = trace or poisson_faults(cluster, horizon, args.seed, a)
            first = plan(nodes)
            hang = hang_found_after_s(spec.elastic.hang_timeout_s or max(
                HANG_FLOOR_S, HANG_STEPS * first.step_s)) if first is not None else None
            outs = [simulate(s, cluster, faults, horizon, plan, every,
                             spec.runtime.collective_timeout_s, a=a, hang_s=hang) for s in STRATEGIES]
        except ValueError as err:
            raise Refused(f"--nodes {nodes}: {err}") from None
        first = plan(nodes)
        results.append({"nodes": nodes, "gpus": nodes * args.gpus_per_node,
                        "mtbf_node_hours": hours, "faults": len(faults),
                        "mesh": first.label, "step_s": first.step_s,
                        "control_s_per_step": first.control_s,
                        "checkpoint_every_steps": every(first),
                        "outcomes": [o.as_dict() for o in outs]})
    return results


def _bad_args(args: argparse.Namespace) -> str | None:
    if any(n < 1 for n in args.nodes) or args.gpus_per_node < 1:
        return "--nodes/--gpus-per-node: must be at least 1; give a positive count"
    for flag in ("days", "mtbf_node_hours", "failures_per_day"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            return f"--{flag.replace('_', '-')}: must be above 0"
    if args.spare_nodes < 0 or args.replace_minutes < 0:
        return "--spare-nodes/--replace-minutes: must be 0 or more"
    if args.trace and not Path(args.trace).is_file():
        return f"--trace: {args.trace} is not a file; give a file of 'HOURS NODE [KIND]' lines"
    return None


def _read_trace(path: str) -> list[Fault]:
    faults = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        parts = line.split("#")[0].split()
        if not parts:
            continue
        try:
            kind = parts[2] if len(parts) > 2 else "crash"
            if len(parts) > 3 or kind not in KINDS:
                raise ValueError
            faults.append(Fault(float(parts[0]) * 3600, int(parts[1]), kind))
        except ValueError:
            raise SystemExit(f"--trace: {path}:{n}: {line.strip()!r} is not 'HOURS NODE "
                             f"[{'|'.join(KINDS)}]'") from None
    return sorted(faults, key=lambda f: f.t)


def _planner(spec: JobSpec, per_node: int, device: str | None, a: Assumptions):
    """Alive nodes → the mesh a re-plan picks there (pinned tp/pp kept, dp follows the
    cluster), with its costs; None where no plan fits."""
    cache: dict[int, MeshCosts | None] = {}
    dev = device or spec.topology.device or "h100"
    tokens = spec.training.global_batch_size * spec.training.seq_len

    def plan(nodes: int) -> MeshCosts | None:
        if nodes not in cache:
            topo = Topology.uniform(nodes, per_node, dev).with_overrides(spec.topology.overrides())
            try:
                r = replan_job(spec, topo)
            except PlanError:
                cache[nodes] = None
            else:
                d, best = r.dims, r.result.best
                used = sum(1 for k in best.node_ranks if k) or nodes
                cache[nodes] = mesh_costs(spec.model, d.tp, d.pp, d.dp, used,
                                          best.estimate.step_time_s, tokens,
                                          spec.checkpoint.async_save, a,
                                          dp_replicate=best.candidate.dp_replicate,
                                          stages=(best.candidate.schedule, best.candidate.vpp,
                                                  best.candidate.stage_layers))
        return cache[nodes]

    return plan


def _cadence(spec: JobSpec, mtbf_node_hours: float):
    every = spec.checkpoint.every
    if every != "auto":
        return lambda mesh: int(every)
    return lambda mesh: choose(mesh.save_blocked_s, mesh.save_durable_s - mesh.save_blocked_s,
                               mesh.step_s, system_mtbf_s(mtbf_node_hours, mesh.nodes),
                               "predicted").every_steps


def _print(spec: JobSpec, args, a: Assumptions, results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{spec.name}: goodput over {args.days:g} days (seed {args.seed})",
                  caption="goodput: the share of wall time that became kept training progress; "
                  "interruptions: the times training stopped for a fault; the hours: wall "
                  "time lost, by cause")
    cols = ["GPUs", "strategy", "goodput", "vs restart", "tokens (B)", "interruptions",
            *[c.replace("_", " ") + " h" for c in CAUSES[1:]]]
    for c in cols:
        table.add_column(c, justify="left" if c == "strategy" else "right")
    for r in results:
        base = next(o for o in r["outcomes"] if o["strategy"] == "restart")
        for o in r["outcomes"]:
            lost = o["hours_lost"]
            table.add_row(f"{r['gpus']:,}", o["strategy"], f"{o['goodput']:.2%}",
                          f"{o['goodput'] / base['goodput']:.3f}×", f"{o['tokens'] / 1e9:,.1f}",
                          str(o["interruptions"]), *[f"{lost[c]:.1f}" for c in CAUSES[1:]])
    Console(width=170).print(table)
    for r in results:
        print(f"{r['gpus']:,} GPUs: mesh {r['mesh']}, step {r['step_s']:.3g} s, checkpoint every "
              f"{r['checkpoint_every_steps']} steps, {r['faults']} faults "
              f"(node MTBF {r['mtbf_node_hours']:,.0f} h)")
    print("assumptions: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(a).items())
          + f", spare_nodes={args.spare_nodes}, replace_minutes={args.replace_minutes:g}")
    for r in results:
        print(f"{r['gpus']:,} GPUs: the control plane's part of the step "
              f"{r['control_s_per_step'] * 1e3:.3g} ms ({r['control_s_per_step'] / r['step_s']:.2%})")
    print("where each cost comes from:")
    for name, value in dataclasses.asdict(MEASURED).items():
        print(f"  {name} = {value:g}: {SOURCES[name]}")
    for name, value in dataclasses.asdict(a).items():
        print(f"  {name} = {value:g}: assumed (--{name.replace('_', '-')})")


# One look per strategy, the same in every panel; widths and dashes keep lines that coincide
# (strategies that lost the same) visible on top of one another.
_STRATEGY_STYLE = {"restart": {"color": "tab:red", "linewidth": 3.2, "alpha": 0.55, "zorder": 1},
                   "trainmesh warm": {"color": "tab:blue", "linewidth": 1.8, "zorder": 2},
                   "trainmesh cold": {"color": "tab:green", "linewidth": 1.2, "linestyle": "--",
                                      "zorder": 3}}


def goodput_figure(results: list[dict]):
    """Wall-clock hours lost so far (wall time less the useful work kept) over the simulated
    days: one panel per cluster size, every strategy on the panel's one axis, so the gap
    between them is the vertical distance between lines; the legend gives each goodput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 3.2 * len(results)), sharex=True,
                             squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        for o in r["outcomes"]:
            days = [t / 24 for t, _ in o["lost_hours"]]
            ax.plot(days, [h for _, h in o["lost_hours"]], **_STRATEGY_STYLE.get(o["strategy"], {}),
                    label=f"{o['strategy']}: goodput {o['goodput']:.2%}")
        ax.set_ylabel("hours lost (cumulative)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.set_title(f"{r['gpus']:,} GPUs, mesh {r['mesh']}, {r['faults']} faults: "
                     "wall time not spent on kept work", fontsize=10, loc="left")
        ax.legend(loc="upper left", fontsize=9)
    axes[-1, 0].set_xlabel("day")
    fig.tight_layout()
    return fig


def _plot(results: list[dict], path: str) -> None:
    import matplotlib.pyplot as plt

    fig = goodput_figure(results)
    fig.savefig(path, dpi=100)
    plt.close(fig)
