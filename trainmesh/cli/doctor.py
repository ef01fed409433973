"""``trainmesh doctor [SPEC]``: what trainmesh sees from here, each problem with its fix.

Software (trainmesh, Python, torch, CUDA, NCCL, Triton), the Ray cluster the spec points at
(nodes, accelerators, what the planner would use and leave idle), the tracking URI and the
checkpoint directory. Read-only apart from a probe file written to and removed from the
checkpoint directory. Exit 0 when nothing is wrong, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from trainmesh.checkpoint.manifest import is_uri
from trainmesh.cli.loading import add_overrides_arg
from trainmesh.spec.job import JobSpec


@dataclass(frozen=True)
class Finding:
    topic: str
    ok: bool
    what: str
    fix: str = ""

    def line(self) -> str:
        mark = "ok  " if self.ok else "FAIL"
        return f"{mark} {self.topic:<11} {self.what}" + ("" if self.ok else f" — fix: {self.fix}")


def software() -> list[Finding]:
    import torch

    from trainmesh import __version__

    found = [Finding("trainmesh", True, f"{__version__} (Python {sys.version.split()[0]}, "
                                        f"{sys.executable})"),
             Finding("torch", True, f"{torch.__version__}, gloo "
                                    f"{'yes' if torch.distributed.is_gloo_available() else 'no'}")]
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        found.append(Finding("cuda", True, f"CUDA {torch.version.cuda}, NCCL {nccl}, "
                                           f"{torch.cuda.device_count()} × "
                                           f"{torch.cuda.get_device_name(0)} on this machine"))
    else:
        found.append(Finding("cuda", True, "no CUDA device on this machine (CPU ranks use gloo; "
                                           "GPU nodes of the cluster are read from Ray below)"))
    try:
        import triton

        found.append(Finding("triton", True, f"{triton.__version__}"))
    except ImportError:
        found.append(Finding("triton", True, "not installed: model.kernels=auto uses the torch "
                                             "references"))
    return found


def cluster(spec: JobSpec) -> list[Finding]:
    """Connect as ``trainmesh run`` would (a local instance for ``local``) and plan."""
    import ray

    from trainmesh.controller.launch import ray_session
    from trainmesh.controller.ray_group import live_topology
    from trainmesh.planning.job_plan import PlanError, plan_job

    address = spec.runtime.ray_address
    try:
        with ray_session(spec):
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            topo = live_topology(spec)
    except Exception as err:  # noqa: BLE001 - any failure to connect is the finding
        text = (str(err).strip().splitlines() or [type(err).__name__])[-1][:200]
        return [Finding("ray", False, f"runtime.ray_address={address}: cannot connect ({text})",
                        "start the cluster (`ray start --head`), or set runtime.ray_address to "
                        "its GCS address (HEAD:6379) or `local`")]
    sizes = ", ".join(f"{n.node_id[:8]}: {n.accelerators}" for n in topo.nodes)
    found = [Finding("ray", True, f"{address}: {len(nodes)} alive node(s), Ray {ray.__version__}"),
             Finding("accelerators", True, f"{topo.world_size} {topo.device.name} rank slot(s) "
                                           f"on {len(topo.nodes)} node(s) ({sizes})")]
    try:
        dims, result = plan_job(spec, topo)
        best = result.best
        found.append(Finding("plan", True, f"{degrees(dims)}: {dims.world_size} rank(s), "
                                           f"{best.idle} idle"))
    except PlanError as err:
        found.append(Finding("plan", False, str(err), "lower the degrees, set "
                                                      "parallelism=auto, or add accelerators"))
    return found


def degrees(dims) -> str:
    """A plan's degrees as ``tp=2 pp=1 dp=4``, with cp and ep where they are above 1."""
    extra = "".join(f" {k}={getattr(dims, k)}" for k in ("cp", "ep") if getattr(dims, k) > 1)
    return f"tp={dims.tp} pp={dims.pp} dp={dims.dp}{extra}"


def tracking(spec: JobSpec, environ: dict[str, str]) -> list[Finding]:
    from trainmesh.tracking.mlflow_tracker import resolve_tracking_uri

    if not spec.tracking.enabled:
        return [Finding("tracking", True, "off (tracking.enabled=false)")]
    uri = resolve_tracking_uri(spec.tracking.uri, environ.get("MLFLOW_TRACKING_URI"),
                               spec.resolved_output_dir())
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5) as r:
                ok = r.status == 200
        except OSError as err:
            return [Finding("tracking", False, f"{uri}: unreachable ({err})",
                            "start the MLflow server, or fix tracking.uri / MLFLOW_TRACKING_URI "
                            "(training goes on without it, metrics are kept and sent later)")]
        return [Finding("tracking", ok, f"{uri}: healthy", "check the server's logs")]
    if uri.startswith("sqlite:///"):
        parent = Path(uri[len("sqlite:///"):]).parent
        return [_writable("tracking", str(parent), f"{uri}", "point tracking.uri at a "
                          "writable place or runtime.output_dir at a writable directory")]
    return [Finding("tracking", True, f"{uri} (not checked)")]


def checkpoints(spec: JobSpec) -> list[Finding]:
    root = spec.checkpoint.dir or str(Path(spec.resolved_output_dir()) / "checkpoints")
    return [_writable("checkpoints", str(root), str(root), "set checkpoint.dir to a writable "
                      "directory — shared by every node on a multi-node cluster — or an object "
                      "store URI")]


S3_VARIABLES = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or give the pods an identity), "
                "AWS_DEFAULT_REGION, and for an S3-compatible store its endpoint in "
                "FSSPEC_S3_ENDPOINT_URL or AWS_ENDPOINT_URL (the Helm chart's objectStore values)")


def _writable(topic: str, root: str, label: str, fix: str) -> Finding:
    """A probe file written to ``root`` (a path or an fsspec URI) and removed; where it fails,
    the fix names the missing package, or for S3 the variables it reads."""
    from fsspec.core import url_to_fs

    try:
        fs, path = url_to_fs(root)
    except ImportError as err:
        return Finding(topic, False, f"{label}: no filesystem for it ({err})",
                       f"install the fsspec implementation it names ({err.name or 's3fs, gcsfs'}), "
                       "or give a local path")
    made = [] if is_uri(root) else _missing_dirs(Path(path))  # (an object store has none)
    try:
        fs.makedirs(path, exist_ok=True)
        probe = f"{path}/.trainmesh-doctor-{uuid.uuid4().hex}"
        fs.pipe_file(probe, b"ok")
        fs.rm(probe)
    except Exception as err:  # noqa: BLE001 - the failure is the finding
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        if root.startswith(("s3://", "s3a://")):
            fix = f"{S3_VARIABLES}; or {fix}"
        return Finding(topic, False, f"{label}: not writable ({first})", fix)
    finally:
        for directory in made:  # the directories the probe made, innermost first, if empty
            with contextlib.suppress(OSError):
                directory.rmdir()
    return Finding(topic, True, f"{label}: writable")


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, innermost first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("doctor", help="what trainmesh sees (software, Ray cluster, "
                                      "accelerators, tracking, checkpoints), with a fix per problem")
    p.add_argument("spec", nargs="?", default=None, help="job spec YAML (default: the built-in spec)")
    add_overrides_arg(p)
    return p


def run(args: argparse.Namespace) -> int:
    from trainmesh.cli.loading import load_spec

    spec = load_spec(args.spec, args.overrides)
    if spec.runtime.ray_address == "local":
        from trainmesh.controller.launch import loopback_environment

        loopback_environment(os.environ)
    findings = [*software(), *cluster(spec), *tracking(spec, dict(os.environ)),
                *checkpoints(spec)]
    for f in findings:
        print(f.line())
    bad = [f for f in findings if not f.ok]
    print(f"{len(bad)} problem(s)" if bad else "no problems found")
    return 1 if bad else 0
