"""The ``trainmesh`` command line: one module per command, each with ``add_parser(sub)`` (its
arguments) and ``run(args)`` (exit status). Errors a person can fix are one line each, exit 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from trainmesh.cli import (
    data,
    doctor,
    evaluate,
    export,
    goodput,
    jobs,
    k8s,
    plan,
    run,
    schedule,
    submit,
    validate,
)
from trainmesh.cli.jobs import JobsError
from trainmesh.cli.loading import SpecError
from trainmesh.controller.elastic import JobFailed
from trainmesh.planning.job_plan import PlanError

EXIT_BAD_INPUT = 2

# In the order `trainmesh --help` lists them.
COMMANDS = (validate, run, doctor, plan, goodput, schedule, k8s, submit, jobs, data, evaluate, export)


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too) whose refusal is one line, naming the help."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="trainmesh", description="Elastic 3D-parallel training on Ray.")
    sub = ap.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub).set_defaults(handler=command.run)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except SpecError as err:
        for problem in err.problems:
            print(problem, file=sys.stderr)
    except JobsError as err:
        print(err, file=sys.stderr)
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
    except JobFailed as err:
        print(f"job failed: {err}", file=sys.stderr)
        return 1
    return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
