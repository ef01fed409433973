"""``trainmesh submit`` and ``trainmesh jobs ...``: run specs on a remote Ray cluster through the
Ray Job Submission API (the dashboard address, e.g. http://HEAD:8265).

The spec is validated here, then travels in the job's runtime environment (``TRAINMESH_SPEC``)
and runs as ``python -m trainmesh run env:TRAINMESH_SPEC`` on the cluster, connected to it
(``runtime.ray_address=auto``), with the interpreter that runs Ray on the head — no
``trainmesh`` script or activated environment needed on the cluster's PATH. A probe job checks
first that this interpreter imports trainmesh at the client's version. Errors are one line
each: an unreachable address, a cluster without trainmesh, an unknown job id, a rejected spec.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from trainmesh.jobs.loading import SpecError, load_spec, unsupported_problems
from trainmesh.spec.job import SPEC_ENV

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


# A job's entrypoint is a shell command run by its supervisor, a Ray worker on the head: the
# shell's parent. Its interpreter is read from the Ray extension it has loaded
# (PREFIX/lib/pythonX.Y/site-packages/ray/_raylet.so -> PREFIX/bin/python), which finds a
# venv or conda environment that was never activated; python3 where that is not possible.
CLUSTER_PYTHON = (
    "PY=$(sed -n 's#^.* \\(/.*\\)/lib/python[0-9.]*/site-packages/ray/_raylet[.]so$#\\1/bin/python#p'"
    " /proc/$PPID/maps 2>/dev/null | head -n 1); [ -x \"$PY\" ] || PY=python3; ")
_PROBE = "import sys, trainmesh; print('trainmesh-probe', trainmesh.__version__, sys.executable)"


class JobsError(RuntimeError):
    """A problem to print as one line (exit 2)."""


def _address_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("RAY_API_SERVER_ADDRESS") or
                   (os.environ.get("RAY_ADDRESS") if str(os.environ.get("RAY_ADDRESS", "")).startswith("http")
                    else None) or DEFAULT_ADDRESS,
                   help="Ray dashboard / job API address (default: $RAY_API_SERVER_ADDRESS, "
                        f"$RAY_ADDRESS if http, else {DEFAULT_ADDRESS})")


def add_parsers(sub) -> None:
    p = sub.add_parser("submit", help="submit a spec to a Ray cluster's job API")
    p.add_argument("spec", help="job spec YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    _address_arg(p)
    p.add_argument("--follow", action="store_true", help="stream the logs; exit with the job's status")
    p.add_argument("--submission-id", default=None, help="job id to use (default: generated)")
    jobs = sub.add_parser("jobs", help="list, inspect and stop submitted jobs").add_subparsers(
        dest="jobs_cmd", required=True)
    p = jobs.add_parser("list", help="jobs on the cluster, newest last")
    _address_arg(p)
    for name, text in (("status", "a job's status"), ("stop", "stop a running job")):
        p = jobs.add_parser(name, help=text)
        p.add_argument("job_id")
        _address_arg(p)
    p = jobs.add_parser("logs", help="a job's driver logs")
    p.add_argument("job_id")
    p.add_argument("--follow", action="store_true", help="stream until the job ends")
    _address_arg(p)


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except ConnectionError as err:
        raise JobsError(f"--address {address}: cannot reach a Ray job API there ({_first_line(err)}); "
                        "start the cluster or pass the dashboard address, e.g. http://HEAD:8265") from None
    except Exception as err:  # noqa: BLE001 - Ray raises several kinds for a bad address or token
        raise JobsError(f"--address {address}: {_first_line(err)}; check the address and, with token "
                        "authentication, RAY_AUTH_MODE=token and the cluster's token") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def _call(what: str, fn, *args):
    try:
        return fn(*args)
    except RuntimeError as err:
        text = str(err)
        if "404" in text or "does not exist" in text:
            raise JobsError(f"{what}: no such job on this cluster; see `trainmesh jobs list`") from None
        raise JobsError(f"{what}: {_first_line(err)}") from None


def submit(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec, args.overrides)
    problems = unsupported_problems(spec)
    if problems:
        raise SpecError(problems)
    spec = spec.model_copy(update={"runtime": spec.runtime.model_copy(update={"ray_address": "auto"})})
    client = _client(args.address)
    python = _probe(client, args.address)
    job_id = _submit(client, f"{CLUSTER_PYTHON}exec \"$PY\" -m trainmesh run env:{SPEC_ENV} --no-progress",
                     {"env_vars": {SPEC_ENV: spec.model_dump_json()}}, args.submission_id,
                     {"trainmesh.job": spec.name})
    print(f"submitted {job_id} ({spec.name}) to {args.address}, run by {python}")
    if not args.follow:
        return 0
    return _follow(client, job_id)


def _submit(client, entrypoint: str, runtime_env: dict | None, submission_id: str | None,
            metadata: dict) -> str:
    deadline = time.monotonic() + 60
    while True:  # a freshly started head takes a few seconds before its agent takes jobs
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                                     submission_id=submission_id, metadata=metadata)
        except RuntimeError as err:
            if "No available agent" not in str(err) or time.monotonic() > deadline:
                raise JobsError(f"submit: {_first_line(err)}") from None
            time.sleep(1.0)


def _probe(client, address: str) -> str:
    """A tiny job: does the cluster's interpreter import trainmesh at this client's version?
    Returns that interpreter; otherwise says what to install."""
    from trainmesh import __version__

    job_id = _submit(client, f"{CLUSTER_PYTHON}exec \"$PY\" -c \"{_PROBE}\"", None, None,
                     {"trainmesh.job": "probe"})
    status = _wait_terminal(client, job_id, timeout_s=120)
    logs = str(_call(job_id, client.get_job_logs, job_id))
    found = [line.split() for line in logs.splitlines() if line.startswith("trainmesh-probe ")]
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


def _follow(client, job_id: str) -> int:
    async def tail():
        async for chunk in client.tail_job_logs(job_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    asyncio.run(tail())
    status = _wait_terminal(client, job_id)
    print(f"job {job_id}: {status}")
    return 0 if status == "SUCCEEDED" else 1


def _wait_terminal(client, job_id: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    status = str(_call(job_id, client.get_job_status, job_id))
    while status.split(".")[-1] not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.5)
        status = str(_call(job_id, client.get_job_status, job_id))
    return status.split(".")[-1]


def jobs(args: argparse.Namespace) -> int:
    client = _client(args.address)
    if args.jobs_cmd == "list":
        rows = sorted(client.list_jobs(), key=lambda j: j.start_time or 0)
        print(f"{'id':<32} {'status':<10} {'name':<24} entrypoint")
        for j in rows:
            name = (j.metadata or {}).get("trainmesh.job", "-")
            print(f"{j.submission_id or j.job_id:<32} {str(j.status).split('.')[-1]:<10} {name:<24} "
                  f"{j.entrypoint[:60]}")
        return 0
    job_id = args.job_id
    if args.jobs_cmd == "status":
        info = _call(job_id, client.get_job_info, job_id)
        status = str(info.status).split(".")[-1]
        print(f"{job_id}: {status}" + (f" ({info.message})" if info.message else ""))
        return 0
    if args.jobs_cmd == "logs":
        _call(job_id, client.get_job_status, job_id)  # one clear line for an unknown id
        if args.follow:
            return _follow(client, job_id)
        sys.stdout.write(_call(job_id, client.get_job_logs, job_id))
        return 0
    if args.jobs_cmd == "stop":
        stopped = _call(job_id, client.stop_job, job_id)
        status = _wait_terminal(client, job_id)
        print(f"{job_id}: {'stopped' if stopped else 'was not running'} ({status})")
        return 0
    return 2
