"""``trainmesh run``: train a job on a local or remote Ray cluster (or, with ``--dry-run``, plan,
place and build every rank and print its memory beside the plan's)."""

from __future__ import annotations

import argparse
import json
import os

from trainmesh.cli.loading import SpecError, add_spec_args, load_spec


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("run", help="train a job on a local or remote Ray cluster")
    add_spec_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true",
                   help="plan, place and build every rank, print each rank's memory beside the "
                        "plan's prediction, and exit (no training, saving or tracking)")
    p.add_argument("--step", action="store_true",
                   help="with --dry-run: also train (one step creates the optimizer state, a "
                        "second is measured: the steady-state peak)")
    p.add_argument("--json", action="store_true", help="with --dry-run: JSON, one object per rank")
    return p


def run(args: argparse.Namespace) -> int:
    if (args.step or args.json) and not args.dry_run:
        raise SpecError(["--step and --json go with --dry-run; add --dry-run, or drop them to train"])
    spec = load_spec(args.spec, args.overrides)
    from trainmesh.controller.launch import dry_run_job, loopback_environment, run_job

    if spec.runtime.ray_address == "local":
        loopback_environment(os.environ)
    if args.dry_run:
        from trainmesh.controller.dry_run import format_rows

        rows = dry_run_job(spec, os.environ, step=args.step)
        print(json.dumps(rows, indent=1) if args.json else format_rows(rows, args.step))
        return 0
    summary = run_job(spec, os.environ, show_progress=not args.no_progress)
    resumed = summary.get("resumed_at") or 0
    again = f" (resumed from step {resumed})" if resumed else ""
    held_out = f", held-out loss {summary['eval'][-1]['loss']:.4f}" if summary.get("eval") else ""
    print(f"done: {summary['steps_done']} steps{again}, final loss {summary['final_loss']:.4f}"
          f"{held_out}; "
          f"summary {spec.resolved_output_dir()}/summary.json; MLflow run {summary['mlflow_run_id']} "
          f"at {summary['tracking_uri']}")
    return 0 if summary["status"] == "FINISHED" else 1
