"""``trainmesh submit``: run a spec on a remote Ray cluster through the Ray Job Submission API
(the dashboard address, e.g. http://HEAD:8265; ``trainmesh jobs`` follows it there).

The spec is validated here, then travels in the job's runtime environment (``TRAINMESH_SPEC``)
and runs as ``python -m trainmesh run env:TRAINMESH_SPEC`` on the cluster, connected to it
(``runtime.ray_address=auto``), with the interpreter that runs Ray on the head — no
``trainmesh`` script or activated environment needed on the cluster's PATH. A probe job checks
first that this interpreter imports trainmesh at the client's version. Errors are one line
each: an unreachable address, a cluster without trainmesh, an unknown job id, a rejected spec.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from trainmesh.cli.jobs import (
    PROBE_KEY,
    JobsError,
    address_arg,
    call,
    connect,
    first_line,
    follow,
    job_metadata,
    wait_terminal,
)
from trainmesh.cli.loading import SpecError, add_spec_args, load_spec
from trainmesh.controller.preflight import preflight_problems, with_absolute_output
from trainmesh.spec.job import SPEC_ENV

# A job's entrypoint is a shell command run by its supervisor, a Ray worker on the head: the
# shell's parent. Its interpreter is read from the Ray extension it has loaded
# (PREFIX/lib/pythonX.Y/site-packages/ray/_raylet.so -> PREFIX/bin/python), which finds a
# venv or conda environment that was never activated; python3 where that is not possible.
CLUSTER_PYTHON = (
    "PY=$(sed -n 's#^.* \\(/.*\\)/lib/python[0-9.]*/site-packages/ray/_raylet[.]so$#\\1/bin/python#p'"
    " /proc/$PPID/maps 2>/dev/null | head -n 1); [ -x \"$PY\" ] || PY=python3; ")
_PROBE = "import sys, trainmesh; print('trainmesh-probe', trainmesh.__version__, sys.executable)"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("submit", help="submit a spec to a Ray cluster's job API")
    add_spec_args(p)
    address_arg(p)
    p.add_argument("--follow", action="store_true", help="stream the logs; exit with the job's status")
    p.add_argument("--submission-id", default=None, help="job id to use (default: generated)")
    return p


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec, args.overrides)
    problems = preflight_problems(spec, os.environ)
    if problems:
        raise SpecError(problems)
    # Relative paths (the default runs/<name> too) would resolve in the head's working
    # directory, wherever that is: they are made absolute here, against the directory the
    # user submits from, and the outputs' place is said.
    spec = with_absolute_output(spec, Path.cwd())
    spec = spec.model_copy(update={"runtime": spec.runtime.model_copy(update={"ray_address": "auto"})})
    client = connect(args.address)
    python = _probe(client, args.address)
    job_id = _submit(client, f"{CLUSTER_PYTHON}exec \"$PY\" -m trainmesh run env:{SPEC_ENV} --no-progress",
                     {"env_vars": {SPEC_ENV: spec.model_dump_json()}}, args.submission_id,
                     job_metadata(spec.name, args.spec, args.overrides, spec.runtime.output_dir))
    print(f"submitted {job_id} ({spec.name}) to {args.address}, run by {python}; outputs "
          f"under {spec.runtime.output_dir} on the cluster's filesystem")
    if not args.follow:
        return 0
    return follow(client, job_id)


def _submit(client, entrypoint: str, runtime_env: dict | None, submission_id: str | None,
            metadata: dict) -> str:
    deadline = time.monotonic() + 60
    while True:  # a freshly started head takes a few seconds before its agent takes jobs
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                                     submission_id=submission_id, metadata=metadata)
        except RuntimeError as err:
            if "No available agent" not in str(err) or time.monotonic() > deadline:
                raise JobsError(f"submit: {first_line(err)}") from None
            time.sleep(1.0)


def _probe(client, address: str) -> str:
    """A tiny job: does the cluster's interpreter import trainmesh at this client's version?
    Returns that interpreter; otherwise says what to install."""
    from trainmesh import __version__

    job_id = _submit(client, f"{CLUSTER_PYTHON}exec \"$PY\" -c \"{_PROBE}\"", None, None,
                     {PROBE_KEY: "1"})
    status = wait_terminal(client, job_id, timeout_s=120)
    logs = str(call(job_id, client.get_job_logs, job_id))
    found = [line.split() for line in logs.splitlines() if line.startswith("trainmesh-probe ")]
    if status == "SUCCEEDED":  # its work is done: it does not stay in the cluster's job list
        try:
            client.delete_job(job_id)
        except Exception:  # noqa: BLE001 - an older server without delete: `jobs list` hides it
            pass
    install = (f"install it where Ray runs on the cluster (`pip install trainmesh=={__version__}` "
               "in the image or the environment `ray start` runs from), then submit again")
    if status != "SUCCEEDED" or not found:
        last = (logs.strip().splitlines() or ["no output"])[-1][:200]
        raise JobsError(f"--address {address}: the cluster's Python cannot import trainmesh "
                        f"({last}); {install}")
    _, theirs, python = found[-1][:3]
    if theirs != __version__:
        raise JobsError(f"--address {address}: the cluster has trainmesh {theirs}, this client "
                        f"{__version__}; {install}")
    return python


