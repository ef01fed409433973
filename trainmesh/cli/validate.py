"""``trainmesh validate``: check a job spec and print it resolved (one line per problem, exit 2)."""

from __future__ import annotations

import argparse
import json

import yaml

from trainmesh.cli.loading import add_spec_args, load_spec
from trainmesh.controller.preflight import read_datasets
from trainmesh.spec.problems import SpecError
from trainmesh.spec.validate import dataset_problems


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("validate", help="check a job spec and print it resolved")
    add_spec_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec, args.overrides)
    problems = dataset_problems(spec, read_datasets(spec, local_only=True))  # what can be seen here
    if problems:
        raise SpecError(problems)
    print(yaml.safe_dump(json.loads(spec.model_dump_json()), sort_keys=False), end="")
    return 0
