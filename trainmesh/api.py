"""trainmesh from Python: what the command line does, as functions returning data.

    from trainmesh import api

    spec = api.load_spec("jobs/tiny-cpu.yaml", ["training.steps=20"])
    rows = api.plan(spec, nodes=16, gpus_per_node=8, device="h100")   # best first
    summary = api.run(spec)                     # blocks; summary.json's content
    loss = api.evaluate(spec)                   # held-out loss of the run's newest checkpoint
    api.export("runs/tiny-cpu", "out/")         # a Hugging Face directory
    model = api.load_model("runs/tiny-cpu")     # the newest checkpoint as a plain nn.Module

A bad spec raises ``SpecError`` (its ``problems`` name each field and its fix), a plan that
cannot fit ``PlanError``, a job that cannot go on ``JobFailed``: the messages the command line
prints. The Python API and the command line are the two front ends: nothing else imports
either."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from trainmesh.cli.loading import load_spec as _load_spec
from trainmesh.controller.elastic import JobFailed
from trainmesh.planning.job_plan import PlanError
from trainmesh.spec.job import JobSpec
from trainmesh.spec.problems import SpecError

if TYPE_CHECKING:
    import torch

__all__ = ["JobFailed", "JobSpec", "PlanError", "SpecError", "evaluate", "export", "load_model",
           "load_spec", "plan", "run"]


def load_spec(path: str | None = None, overrides: Sequence[str] = ()) -> JobSpec:
    """A job spec from a YAML file (None: the built-in defaults) with ``section.field=value``
    overrides (a list; one string is one override), validated as ``trainmesh validate`` does."""
    return _load_spec(path, [overrides] if isinstance(overrides, str) else list(overrides))


def plan(spec: JobSpec, nodes: int | None = None, gpus_per_node: int = 8,
         device: str | None = None, top: int = 10) -> list[dict[str, Any]]:
    """The planner's ranked layouts for ``nodes`` × ``gpus_per_node`` accelerators of kind
    ``device`` (default: the spec's ``topology.device``, else h100), best first, as
    ``trainmesh plan --json`` prints them; without ``nodes``, for the cluster the spec's
    ``runtime.ray_address`` names (``local``: this machine's CPUs). At most ``top``, of the
    plans the search weighs: those leaving the fewest accelerators idle, at least 10 where
    as many fit (the rest leave more idle, and are not priced)."""
    from trainmesh.cli.plan import cluster_topology
    from trainmesh.planning.job_plan import plan_job

    topo = cluster_topology(spec, SimpleNamespace(nodes=nodes, gpus_per_node=gpus_per_node,
                                                  device=device))
    _, result = plan_job(spec, topo)
    return [p.as_row() for p in result.first(top)]


def run(spec: JobSpec, environ: Mapping[str, str] | None = None,
        show_progress: bool = False) -> dict[str, Any]:
    """Train ``spec`` to its end on the Ray cluster it names, as ``trainmesh run`` does (a
    program already connected to Ray runs there); returns the run summary (also
    ``OUTPUT/summary.json``). ``environ``: where ``MLFLOW_TRACKING_URI`` and the like are read
    (default: this process's environment, which for a local cluster is then kept on loopback
    as the command line keeps it: ``GLOO_SOCKET_IFNAME=lo`` where it was not set)."""
    from trainmesh.controller.launch import run_job

    return run_job(spec, _environment(spec, environ), show_progress=show_progress)


def evaluate(spec: JobSpec, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The held-out loss of the run's newest checkpoint (of ``model.init_from``, or the initial
    model, without one), as ``trainmesh eval --json`` prints it: ``eval_loss``, ``batches``,
    ``checkpoint``, ``step``, ``init_from``."""
    from trainmesh.controller.launch import evaluate_job
    from trainmesh.spec.validate import held_out_problems

    problems = held_out_problems(spec)
    if problems:
        raise SpecError(problems)
    return evaluate_job(spec, _environment(spec, environ))


def _environment(spec: JobSpec, environ: Mapping[str, str] | None) -> Mapping[str, str]:
    from trainmesh.controller.launch import loopback_environment

    if environ is None:
        if spec.runtime.ray_address == "local":  # (as the command line: before Ray starts)
            loopback_environment(os.environ)
        return os.environ
    return environ


def export(source: str, out: str, dtype: str | None = None) -> dict[str, Any]:
    """Write a run's newest checkpoint (``source``: its output directory) or a checkpoint
    directory as a Hugging Face model directory; returns what was written."""
    from trainmesh.interop.hf_export import export as _export

    return _export(source, out, dtype=dtype)


def load_model(source: str, device: str = "cpu") -> torch.nn.Module:
    """A run's newest checkpoint (``source``: its output directory) or a checkpoint directory,
    whatever mesh wrote it, as the whole model in one process: a plain ``nn.Module`` (the
    model's class, parameter names as in the checkpoint), in evaluation mode."""
    import torch

    from trainmesh.checkpoint.dcp_io import load_full_model
    from trainmesh.engine.engine import build_model
    from trainmesh.interop.hf_export import find_checkpoint

    directory, manifest = find_checkpoint(source)
    spec = JobSpec.model_validate({**manifest["spec"], "model": {  # (torch's kernels: any device)
        **manifest["spec"]["model"], "init_from": None, "kernels": "torch"}})
    model = build_model(spec, torch.device("cpu"))
    load_full_model(model, directory)
    return model.to(device).eval()
