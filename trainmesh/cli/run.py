"""``trainmesh run``: train a job on a local or remote Ray cluster (or, with ``--dry-run``, plan,
place and build every rank and print its memory beside the plan's)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from trainmesh.cli.loading import SpecError, add_spec_args, load_spec, unsupported_problems


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
    problems = unsupported_problems(spec)
    if problems:
        raise SpecError(problems)
    from trainmesh.controller.launch import dry_run_job, loopback_environment, run_job

    if spec.runtime.ray_address == "local":
        loopback_environment(os.environ)
    if args.dry_run:
        from trainmesh.controller.dry_run import format_rows

        rows = dry_run_job(spec, os.environ, step=args.step)
        print(json.dumps(rows, indent=1) if args.json else format_rows(rows, args.step))
        return 0
    reached = _checkpoint_step(spec)
    if reached is not None and reached >= spec.training.steps:  # known before any rank starts
        return _nothing_to_train(spec, reached, "its newest checkpoint is at step")
    summary = run_job(spec, os.environ, show_progress=not args.no_progress)
    out = spec.resolved_output_dir()
    resumed = summary.get("resumed_at") or 0
    if resumed >= spec.training.steps:  # the newest checkpoint the ranks verified is the end
        return _nothing_to_train(spec, resumed, "this run resumed from its checkpoint at step")
    again = f" (resumed from step {resumed})" if resumed else ""
    held_out = f", held-out loss {summary['eval'][-1]['loss']:.4f}" if summary.get("eval") else ""
    print(f"done: {summary['steps_done']} steps{again}, final loss {summary['final_loss']:.4f}"
          f"{held_out}; "
          f"summary {out}/summary.json; MLflow run {summary['mlflow_run_id']} "
          f"at {summary['tracking_uri']}")
    return 0 if summary["status"] == "FINISHED" else 1


def _checkpoint_step(spec) -> int | None:
    """The step of the newest complete checkpoint a run of ``spec`` would resume from (files
    present at their sizes; the ranks check the digests when they restore), or None."""
    from pathlib import Path

    from trainmesh.controller.checkpointing import Checkpointer

    found = Checkpointer(spec, Path(spec.resolved_output_dir()), lambda message: None).latest()
    return None if found is None else int(found[1]["data_position"]["step"])


def _nothing_to_train(spec, step: int, where: str) -> int:
    print(f"training.steps: {spec.training.steps}, but {where} {step}: nothing to train; raise "
          f"training.steps above {step} to train further, or start anew with another "
          "runtime.output_dir or checkpoint.resume=never", file=sys.stderr)
    return 2
