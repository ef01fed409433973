"""``trainmesh schedule``: print a pipeline schedule's grid, simulate it, optionally draw it."""

from __future__ import annotations

import argparse

from trainmesh.parallel.pipeline.ir import ScheduleKind, grid
from trainmesh.parallel.pipeline.schedules import build_schedule, pipe_shape
from trainmesh.parallel.pipeline.simulate import Costs, simulate
from trainmesh.parallel.pipeline.trace import plot_schedule


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("schedule", help="show a pipeline schedule as a grid (and a PNG)")
    p.add_argument("--pp", type=int, required=True, help="pipeline stages (ranks)")
    p.add_argument("--vpp", type=int, default=1, help="virtual chunks per rank")
    p.add_argument("--microbatches", type=int, required=True, help="microbatches per step")
    p.add_argument("--schedule", default=None, choices=[k.value for k in ScheduleKind],
                   help="default: interleaved-1f1b when vpp > 1, else 1f1b")
    p.add_argument("--backward-cost", type=float, default=2.0,
                   help="backward / forward time (a split backward: half input, half weight)")
    p.add_argument("--png", help="write the simulated timeline to this PNG file")
    return p


def run(args: argparse.Namespace) -> int:
    import sys

    kind = args.schedule or ("interleaved-1f1b" if args.vpp > 1 else "1f1b")
    try:
        sched = build_schedule(kind, args.pp, args.vpp, args.microbatches)
        shape = pipe_shape(kind, args.pp, args.vpp, args.microbatches)
    except ValueError as err:  # (a ScheduleMisfit says what would run)
        fix = "".join(f"; give --{k} {v}" for k, v in getattr(err, "need", {}).items())
        print(f"--schedule/--pp/--vpp/--microbatches: {err}{fix}", file=sys.stderr)
        return 2
    v = args.vpp
    sim = simulate(sched, args.pp * v, args.microbatches, Costs(1.0, args.backward_cost), shape=shape)
    print(f"{kind}: pp={args.pp} vpp={v} microbatches={args.microbatches}")
    print(grid(sched))
    print(f"step time {sim.step_time:.2f} (one chunk's forward = 1), bubble "
          f"{sim.bubble_fraction:.1%}, peak in-flight microbatch-chunks per rank "
          f"{sim.peak_in_flight}")
    if args.png:
        plot_schedule(sim, f"{kind} pp={args.pp} vpp={v} m={args.microbatches}", args.png)
        print(f"wrote {args.png}")
    return 0
