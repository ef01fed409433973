"""``trainmesh eval``: the held-out loss of a run's newest checkpoint (or of ``model.init_from``),
on any mesh."""

from __future__ import annotations

import argparse
import json
import os

from trainmesh.cli.loading import SpecError, add_spec_args, load_spec
from trainmesh.spec.validate import held_out_problems


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", help="held-out loss of a run's newest checkpoint (or of "
                                    "model.init_from when the run has none)")
    add_spec_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def run(args: argparse.Namespace) -> int:
    from trainmesh.controller.launch import evaluate_job, loopback_environment

    spec = load_spec(args.spec, args.overrides)
    problems = held_out_problems(spec)  # the rest: evaluate_job's pre-flight
    if problems:
        raise SpecError(problems)
    if spec.runtime.ray_address == "local":
        loopback_environment(os.environ)
    result = evaluate_job(spec, os.environ)
    if args.json:
        print(json.dumps(result))
    else:
        at = (f"checkpoint {result['checkpoint']} (step {result['step']})" if result["checkpoint"]
              else result["init_from"] or "the initial model (no checkpoint yet)")
        print(f"eval loss {result['eval_loss']:.4f} over {result['batches']} batch(es) for {at}")
    return 0
