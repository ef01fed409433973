"""The ``trainmesh`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from trainmesh.jobs import data_cli, goodput_cli, k8s_cli, plan_cli, schedule_cli, submit_cli
from trainmesh.jobs.loading import SpecError, load_spec, unsupported_problems
from trainmesh.platform.elastic import JobFailed
from trainmesh.platform.job_plan import PlanError

EXIT_BAD_INPUT = 2


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="job spec YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set training.steps=20 (repeatable)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="trainmesh", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check a job spec and print it resolved")
    _add_spec_args(p)
    p = sub.add_parser("run", help="train a job on a local or remote Ray cluster")
    _add_spec_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true",
                   help="plan, place and build every rank, print each rank's memory beside the "
                        "plan's prediction, and exit (no training, saving or tracking)")
    p.add_argument("--step", action="store_true",
                   help="with --dry-run: also train (one step creates the optimizer state, a "
                        "second is measured: the steady-state peak)")
    p.add_argument("--json", action="store_true", help="with --dry-run: JSON, one object per rank")
    p = sub.add_parser("doctor", help="what trainmesh sees (software, Ray cluster, "
                                      "accelerators, tracking, checkpoints), with a fix per problem")
    p.add_argument("spec", nargs="?", default=None, help="job spec YAML (default: the built-in spec)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    plan_cli.add_parser(sub)
    goodput_cli.add_parser(sub)
    schedule_cli.add_parser(sub)
    k8s_cli.add_parser(sub)
    submit_cli.add_parsers(sub)
    data_cli.add_parsers(sub, _add_spec_args)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "validate":
            return _validate(args)
        if args.command == "run":
            return _run(args)
        if args.command == "doctor":
            from trainmesh.jobs import doctor

            return doctor.run(args, load_spec)
        if args.command == "plan":
            return plan_cli.run(args)
        if args.command == "goodput":
            return goodput_cli.run(args)
        if args.command == "schedule":
            return schedule_cli.run(args)
        if args.command == "k8s":
            return k8s_cli.run(args)
        if args.command == "submit":
            return submit_cli.submit(args)
        if args.command == "jobs":
            return submit_cli.jobs(args)
        if args.command == "data":
            return data_cli.prepare(args)
        if args.command == "eval":
            return data_cli.evaluate(args)
        if args.command == "export":
            return data_cli.export(args)
    except SpecError as err:
        for problem in err.problems:
            print(problem, file=sys.stderr)
        return EXIT_BAD_INPUT
    except submit_cli.JobsError as err:
        print(err, file=sys.stderr)
        return EXIT_BAD_INPUT
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except JobFailed as err:
        print(f"job failed: {err}", file=sys.stderr)
        return 1
    return 1


def _validate(args: argparse.Namespace) -> int:
    import yaml

    spec = load_spec(args.spec, args.overrides)
    print(yaml.safe_dump(json.loads(spec.model_dump_json()), sort_keys=False), end="")
    return 0


def _run(args: argparse.Namespace) -> int:
    if (args.step or args.json) and not args.dry_run:
        raise SpecError(["--step and --json go with --dry-run; add --dry-run, or drop them to train"])
    spec = load_spec(args.spec, args.overrides)
    problems = unsupported_problems(spec)
    if problems:
        raise SpecError(problems)
    from trainmesh.jobs.runner import dry_run_job, loopback_environment, run_job

    if spec.runtime.ray_address == "local":
        loopback_environment(os.environ)
    if args.dry_run:
        from trainmesh.platform.dry_run import format_rows

        rows = dry_run_job(spec, os.environ, step=args.step)
        print(json.dumps(rows, indent=1) if args.json else format_rows(rows, args.step))
        return 0
    summary = run_job(spec, os.environ, show_progress=not args.no_progress)
    out = spec.resolved_output_dir()
    print(f"done: {summary['steps_done']} steps, final loss {summary['final_loss']:.4f}; "
          f"summary {out}/summary.json; MLflow run {summary['mlflow_run_id']} "
          f"at {summary['tracking_uri']}")
    return 0 if summary["status"] == "FINISHED" else 1


if __name__ == "__main__":
    sys.exit(main())
