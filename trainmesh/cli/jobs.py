"""``trainmesh jobs list|status|logs|stop``: jobs on a Ray cluster, through the Ray Job Submission
API (the dashboard address, e.g. http://HEAD:8265); the client helpers ``trainmesh submit`` uses.
Errors are one line each: an unreachable address, an unknown job id."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


class JobsError(RuntimeError):
    """A problem to print as one line (exit 2)."""


def address_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("RAY_API_SERVER_ADDRESS") or
                   (os.environ.get("RAY_ADDRESS") if str(os.environ.get("RAY_ADDRESS", "")).startswith("http")
                    else None) or DEFAULT_ADDRESS,
                   help="Ray dashboard / job API address (default: $RAY_API_SERVER_ADDRESS, "
                        f"$RAY_ADDRESS if http, else {DEFAULT_ADDRESS})")


# What `submit` records with each job (Ray keeps a job's metadata as strings), so that `jobs
# list` shows trainmesh jobs by name and spec rather than by their launcher's shell line.
JOB_KEY, SPEC_KEY, OUTPUTS_KEY = "trainmesh.job", "trainmesh.spec", "trainmesh.outputs"
PROBE_KEY = "trainmesh.probe"  # submit's check of the cluster's interpreter: never listed


def job_metadata(name: str, spec: str, overrides: list[str], outputs: str) -> dict[str, str]:
    """The metadata a submitted job carries: its name, how it was asked for (the spec file and
    its ``--set`` overrides, as typed) and where its outputs go on the cluster."""
    typed = " ".join([str(spec)] + [f"--set {o}" for o in overrides])
    return {JOB_KEY: name, SPEC_KEY: typed, OUTPUTS_KEY: str(outputs)}


def add_parser(sub) -> argparse.ArgumentParser:
    top = sub.add_parser("jobs", help="list, inspect and stop submitted jobs")
    jobs = top.add_subparsers(dest="jobs_cmd", required=True)
    p = jobs.add_parser("list", help="jobs on the cluster, newest last")
    address_arg(p)
    for name, text in (("status", "a job's status"), ("stop", "stop a running job")):
        p = jobs.add_parser(name, help=text)
        p.add_argument("job_id", help="the submission id `trainmesh submit` printed")
        address_arg(p)
    p = jobs.add_parser("logs", help="a job's driver logs")
    p.add_argument("job_id", help="the submission id `trainmesh submit` printed")
    p.add_argument("--follow", action="store_true", help="stream until the job ends")
    address_arg(p)
    return top


def connect(address: str):
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except ConnectionError as err:
        raise JobsError(f"--address {address}: cannot reach a Ray job API there ({first_line(err)}); "
                        "start the cluster or pass the dashboard address, e.g. http://HEAD:8265") from None
    except Exception as err:  # noqa: BLE001 - Ray raises several kinds for a bad address or token
        raise JobsError(f"--address {address}: {first_line(err)}; check the address and, with token "
                        "authentication, RAY_AUTH_MODE=token and the cluster's token") from None


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def call(what: str, fn, *args):
    try:
        return fn(*args)
    except RuntimeError as err:
        text = str(err)
        if "404" in text or "does not exist" in text:
            raise JobsError(f"{what}: no such job on this cluster; see `trainmesh jobs list`") from None
        raise JobsError(f"{what}: {first_line(err)}") from None


def follow(client, job_id: str) -> int:
    async def tail():
        async for chunk in client.tail_job_logs(job_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    asyncio.run(tail())
    status = wait_terminal(client, job_id)
    print(f"job {job_id}: {status}")
    return 0 if status == "SUCCEEDED" else 1


def wait_terminal(client, job_id: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    status = str(call(job_id, client.get_job_status, job_id))
    while status.split(".")[-1] not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.5)
        status = str(call(job_id, client.get_job_status, job_id))
    return status.split(".")[-1]


def run(args: argparse.Namespace) -> int:
    client = connect(args.address)
    if args.jobs_cmd == "list":
        rows = sorted((j for j in client.list_jobs() if PROBE_KEY not in (j.metadata or {})),
                      key=lambda j: j.start_time or 0)
        print(f"{'id':<32} {'status':<10} {'name':<24} spec (outputs)")
        for j in rows:
            meta = j.metadata or {}
            # A job trainmesh did not submit is shown by its entrypoint, cut to a line.
            what = (f"{meta[SPEC_KEY]} ({meta.get(OUTPUTS_KEY, '?')})" if SPEC_KEY in meta
                    else j.entrypoint[:80])
            print(f"{j.submission_id or j.job_id:<32} {str(j.status).split('.')[-1]:<10} "
                  f"{meta.get(JOB_KEY, '-'):<24} {what}")
        return 0
    job_id = args.job_id
    if args.jobs_cmd == "status":
        info = call(job_id, client.get_job_info, job_id)
        status = str(info.status).split(".")[-1]
        print(f"{job_id}: {status}" + (f" ({info.message})" if info.message else ""))
        return 0
    if args.jobs_cmd == "logs":
        call(job_id, client.get_job_status, job_id)  # one clear line for an unknown id
        if args.follow:
            return follow(client, job_id)
        sys.stdout.write(call(job_id, client.get_job_logs, job_id))
        return 0
    if args.jobs_cmd == "stop":
        stopped = call(job_id, client.stop_job, job_id)
        status = wait_terminal(client, job_id)
        print(f"{job_id}: {'stopped' if stopped else 'was not running'} ({status})")
        return 0
    return 2
