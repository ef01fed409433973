"""``trainmesh k8s render``: print the KubeRay RayJob that runs a spec on Kubernetes."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from trainmesh.cli.loading import add_overrides_arg, device_kind, load_spec
from trainmesh.deploy.render import MeshSize, RenderOptions, render_rayjob, to_yaml
from trainmesh.planning.job_plan import PlanError, plan_job
from trainmesh.planning.topology import Topology
from trainmesh.spec.job import JobSpec


def add_parser(sub) -> argparse.ArgumentParser:
    k8s = sub.add_parser("k8s", help="Kubernetes manifests").add_subparsers(dest="k8s_cmd", required=True)
    p = k8s.add_parser("render", help="print a KubeRay RayJob (ray.io/v1) sized from the plan")
    p.add_argument("spec", help="job spec YAML")
    add_overrides_arg(p)
    d = RenderOptions()
    p.add_argument("--image", default=d.image, help="container image with trainmesh installed")
    p.add_argument("--namespace", default=d.namespace, help="Kubernetes namespace of the RayJob")
    p.add_argument("--nodes", type=int, help="GPU nodes to plan for (default: what the degrees need)")
    p.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node, help="accelerators per node")
    p.add_argument("--device", default=None, type=device_kind,
                   help="h100, h200, a100-80gb, ... (default: the spec's or h100)")
    p.add_argument("--mlflow-secret", default=d.mlflow_secret,
                   help="Secret with key 'uri' (and optional 'username', 'password')")
    p.add_argument("--shared-pvc", default=None,
                   help="ReadWriteMany claim mounted on every pod for checkpoints and outputs")
    return p


def rayjob(spec: JobSpec, opts: RenderOptions | None = None) -> dict[str, Any]:
    """Plan for ``opts.nodes`` × ``opts.gpus_per_node`` (default: the nodes the spec's degrees
    need), then render the RayJob with the plan's degrees."""
    opts = opts or RenderOptions()
    g = opts.gpus_per_node
    if opts.nodes is None:
        if spec.parallelism.auto:
            raise ValueError("parallelism: auto needs a cluster size to plan for; pass --nodes")
        nodes = math.ceil(spec.parallelism.world_size / g)
    else:
        nodes = opts.nodes
    topo = Topology.uniform(nodes, g, opts.device).with_overrides(spec.topology.overrides())
    dims, _ = plan_job(spec, topo)
    return render_rayjob(spec, opts, MeshSize(tp=dims.tp, pp=dims.pp, dp=dims.dp))


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec, args.overrides)
    if args.gpus_per_node < 1 or (args.nodes is not None and args.nodes < 1):
        print("--nodes/--gpus-per-node: must be at least 1; give a positive count", file=sys.stderr)
        return 2
    opts = RenderOptions(image=args.image, namespace=args.namespace, gpus_per_node=args.gpus_per_node,
                         nodes=args.nodes, device=args.device or spec.topology.device or "h100",
                         mlflow_secret=args.mlflow_secret, shared_pvc=args.shared_pvc)
    try:
        doc = rayjob(spec, opts)
    except (PlanError, ValueError) as err:
        print(err, file=sys.stderr)
        return 2
    print(to_yaml(doc), end="")
    return 0
