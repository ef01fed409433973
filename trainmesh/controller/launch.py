"""Run a job: connect to (or start) Ray, start the controller actor, show progress."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from trainmesh.controller.preflight import nothing_to_train, prepare_run
from trainmesh.spec.job import JobSpec
from trainmesh.spec.problems import Problem, SpecError

LOCAL = "local"


def loopback_environment(environ: dict[str, str] | os._Environ) -> None:
    """Keep a local Ray cluster and gloo on 127.0.0.1 (Ray binds the external interface by
    default). Must run before ``import ray``."""
    environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def worker_env(spec: JobSpec, local: bool) -> dict[str, str]:
    threads = str(max(1, int(spec.runtime.cpus_per_rank)))
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    if local:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


class _RayStartNotice(logging.Filter):
    """Drops Ray's notice that a new local cluster has token authentication on (its secure
    default, which trainmesh keeps): a line on every run that reads like something to act on.
    Ray's warnings about something wrong (authentication off, a token missing) still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Token authentication is enabled for this Ray cluster")


_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def quiet_ray_start_notices() -> None:
    """Keep Ray's start-up notices out of trainmesh's output (idempotent)."""
    log = logging.getLogger(_RAY_AUTH_LOGGER)
    if not any(isinstance(f, _RayStartNotice) for f in log.filters):
        log.addFilter(_RayStartNotice())


WORKER_DEATH = "A worker died or was killed"  # how Ray's raylet announces a process it lost


_QUIET = {"jobs": 0, "printer": None}  # the jobs running in this process, Ray's own printer
_QUIET_LOCK = threading.Lock()


@contextlib.contextmanager
def worker_deaths_logged_not_printed() -> Iterator[None]:
    """While jobs run in this process, Ray's notices of a dead worker process (a rank trainmesh
    aborted, killed or lost with its node, and recovered from: the console has trainmesh's own
    line for that, and the MLflow ``failure`` event the error) go to the ``trainmesh.ray`` log
    at INFO instead of the console; Ray's own logs keep them, and every other message Ray prints
    still reaches the console. Ray's driver prints them from a thread through
    ``ray._private.worker.print_to_stdstream``: wrapped once for all the jobs of the process
    (however they overlap), put back when the last ends; where it is not there, nothing
    changes."""
    from ray._private import worker

    with _QUIET_LOCK:
        if _QUIET["jobs"] == 0:
            printer = getattr(worker, "print_to_stdstream", None)
            if printer is not None:
                _QUIET["printer"] = printer
                worker.print_to_stdstream = functools.partial(_printed, printer)
        _QUIET["jobs"] += 1
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _QUIET["jobs"] -= 1
            if _QUIET["jobs"] == 0 and _QUIET["printer"] is not None:
                worker.print_to_stdstream, _QUIET["printer"] = _QUIET["printer"], None


def _printed(printer, data, *args, **kwargs):
    lines = data.get("lines") or []
    if data.get("pid") == "raylet" and lines and all(str(x).startswith(WORKER_DEATH) for x in lines):
        log = logging.getLogger("trainmesh.ray")
        for line in lines:
            log.info("%s", line)
        return None
    return printer(data, *args, **kwargs)


@contextlib.contextmanager
def ray_session(spec: JobSpec) -> Iterator[bool]:
    """Yields True when the cluster is on this machine. Shuts down only what it started."""
    import ray

    if ray.is_initialized():  # a program that called ray.init: its cluster, if the spec agrees
        elsewhere = _other_cluster(spec.runtime.ray_address, ray.get_runtime_context().gcs_address)
        if elsewhere:
            raise SpecError([Problem("runtime.ray_address", elsewhere, "call ray.shutdown() "
                                     "before running the job, or set runtime.ray_address to "
                                     "local (the cluster this process is connected to)")])
        yield spec.runtime.ray_address == LOCAL
        return
    quiet_ray_start_notices()
    if spec.runtime.ray_address == LOCAL:
        need = math.ceil(spec.parallelism.world_size * spec.runtime.cpus_per_rank)
        # address="local": always a new instance, never one that happens to run on this machine
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    else:
        unreachable = _unreachable(spec.runtime.ray_address)
        if unreachable:  # ray.init would retry for minutes before saying so
            raise SpecError([Problem("runtime.ray_address", f"no Ray cluster reachable at "
                                     f"{spec.runtime.ray_address!r} ({unreachable})",
                                     "start the cluster (`ray start --head`), give its address "
                                     "(host:6379 or auto), or use local")])
        try:
            ray.init(address=spec.runtime.ray_address, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise SpecError([Problem("runtime.ray_address", f"no Ray cluster reachable at "
                                     f"{spec.runtime.ray_address!r} ({first})",
                                     "start the cluster (`ray start --head`), give its address "
                                     "(host:6379 or auto), or use local")]) from None
    try:
        yield spec.runtime.ray_address == LOCAL
    finally:
        ray.shutdown()


def _other_cluster(address: str, connected: str) -> str | None:
    """Why a spec's ``host:port`` address is not the cluster this process is connected to
    (its GCS at ``connected``), or None (the same one, or local/auto/ray://: this one)."""
    import socket

    host, sep, port = address.rpartition(":")
    if address in (LOCAL, "auto") or "://" in address or not sep or not port.isdigit():
        return None
    c_host, _, c_port = connected.rpartition(":")
    try:
        same = (socket.gethostbyname(host), int(port)) == (socket.gethostbyname(c_host), int(c_port))
    except (OSError, ValueError):
        same = False
    return None if same else (f"this process is connected to the Ray cluster at {connected}, "
                              f"not {address!r}")


def _unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why nothing answers at a Ray ``host:port`` (or ``ray://host:port``) address, or None
    (reachable, or not an address this can check: ``auto``)."""
    import socket

    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        return f"{host}:{port}: {err.strerror or err}"
    return None


def run_job(spec: JobSpec, environ: Mapping[str, str], show_progress: bool = True,
            job_env: Mapping[str, str] | None = None, rank_cls: type | None = None) -> dict[str, Any]:
    """Train ``spec`` to the end; returns the run summary (also in OUTPUT/summary.json).
    Everything a run checks before it starts is checked here (``preflight.prepare_run``):
    a problem raises ``SpecError`` naming the field and the fix, as does a run whose
    checkpoint already held its last step. ``job_env``: environment variables the job's
    processes get (the controller and every rank) besides trainmesh's own: an object store's
    endpoint and credentials, ``NCCL_DEBUG``; ``rank_cls``: the rank actor's class,
    ``RankWorker`` or a subclass (``actors/rank_worker.py``)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from trainmesh.controller.controller import Controller

    ready = prepare_run(spec, environ)
    spec, uri = ready.spec, ready.tracking_uri
    with ray_session(spec) as local, worker_deaths_logged_not_printed():
        # The controller lives on the driver's node (the head, for submitted jobs): it must
        # outlive the accelerator nodes it recovers from.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        env = {"env_vars": dict(job_env)} if job_env else None
        actor = ray.remote(Controller).options(max_concurrency=4, num_cpus=0, runtime_env=env,
                                               scheduling_strategy=here).remote(
            spec.model_dump_json(), uri, {**(job_env or {}), **worker_env(spec, local)},
            rank_cls=rank_cls)
        try:
            ref = actor.run.remote()
            if show_progress:
                _follow(actor, ref)
            else:
                _report(actor, ref)
            summary = ray.get(ref)
        except ray.exceptions.RayTaskError as err:
            raise _user_error(err) from None
        finally:
            ray.kill(actor)
    resumed = summary.get("resumed_at") or 0
    if resumed >= spec.training.steps:  # the newest checkpoint the ranks verified is the end
        raise nothing_to_train(spec, resumed, "this run resumed from its checkpoint at step")
    return summary


def dry_run_job(spec: JobSpec, environ: Mapping[str, str], step: bool) -> list[dict[str, Any]]:
    """Plan, place and build every rank (one step with ``step``); per-rank memory rows
    (``trainmesh.controller.dry_run``). Nothing is trained, saved or tracked."""
    return _controller_once(spec, environ, "dry_run", step)


def evaluate_job(spec: JobSpec, environ: Mapping[str, str]) -> dict[str, Any]:
    """Build every rank, restore the run's newest checkpoint (or the initial model) and
    return the held-out loss (``trainmesh.controller.evaluation``)."""
    return _controller_once(spec, environ, "evaluate")


def _controller_once(spec: JobSpec, environ: Mapping[str, str], method: str, *args: Any) -> Any:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from trainmesh.controller.controller import Controller

    spec = prepare_run(spec, environ, train=False).spec
    with ray_session(spec) as local:
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        actor = ray.remote(Controller).options(num_cpus=0, scheduling_strategy=here).remote(
            spec.model_dump_json(), None, worker_env(spec, local))
        try:
            return ray.get(getattr(actor, method).remote(*args))
        except ray.exceptions.RayTaskError as err:
            raise _user_error(err) from None
        finally:
            ray.kill(actor)


def _user_error(err: Exception) -> Exception:
    """A refusal raised inside the controller (a plan that cannot fit, ...) as itself: the
    person gets its message, not a remote traceback."""
    from trainmesh.controller.elastic import JobFailed
    from trainmesh.planning.job_plan import PlanError

    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, PlanError | JobFailed | SpecError) else err


def _report(actor, ref, every_s: float = 10.0) -> None:
    """Without a terminal (submitted jobs, logs): a progress line every ``every_s`` and every
    notice as it comes."""
    import ray

    seen, told, last = 0, 0, 0.0
    while True:
        done, _ = ray.wait([ref], timeout=1.0)
        p = ray.get(actor.progress.remote())
        for text in p["notices"][seen:]:
            print(f"warning: {text}", file=sys.stderr, flush=True)
        for text in p["events"][told:]:
            print(text, flush=True)
        seen, told = len(p["notices"]), len(p["events"])
        if time.monotonic() - last >= every_s and p["step"]:
            loss = f" loss {p['loss']:.4f}" if "loss" in p else ""
            tps = f" {p['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in p else ""
            print(f"{p['state']} step {p['step']}/{p['steps']}{loss}{tps}", flush=True)
            last = time.monotonic()
        if done:
            return


def _follow(actor, ref) -> None:
    """A rich progress bar fed by the controller's ``progress()`` until ``ref`` is done."""
    import ray
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("[bold]{task.fields[state]:<9}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("train", total=None, state="starting", loss="-", tps="-")
        seen = told = 0
        while True:
            done, _ = ray.wait([ref], timeout=0.5)
            p = ray.get(actor.progress.remote())
            loss = f"{p['loss']:.4f}" if "loss" in p else "-"
            tps = f"{p['tokens_per_s']:,.0f}" if "tokens_per_s" in p else "-"
            bar.update(task, total=p["steps"], completed=p["step"], state=p["state"], loss=loss,
                       tps=tps)
            for text in p["notices"][seen:]:
                bar.console.print(f"[yellow]warning:[/] {text}")
            for text in p["events"][told:]:
                bar.console.print(text, markup=False, highlight=False)
            seen, told = len(p["notices"]), len(p["events"])
            if done:
                break
