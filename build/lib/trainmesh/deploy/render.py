"""A KubeRay RayJob for a job spec, sized from its plan (the caller's). Pure: no torch, no
cluster, no planner.

The worker group gets one pod per node with ``gpus_per_node`` GPUs; replicas are the nodes the
plan uses, and the autoscaling bounds come from the elastic policy (whole nodes). The spec
travels in the Ray runtime environment (``TRAINMESH_SPEC``) and is run with
``python -m trainmesh run env:TRAINMESH_SPEC``; the MLflow URI and credentials come from a Secret, never
from the manifest.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import yaml

from trainmesh.deploy import kuberay
from trainmesh.spec.job import SPEC_ENV, JobSpec

RAY_VERSION = "2.60.0"
SHARED_MOUNT = "/mnt/trainmesh"
NCCL_ENV = {
    "NCCL_DEBUG": "WARN",
    # 2 = CleanUpOnly: on an error or a watchdog timeout the communicators are aborted and the
    # collective fails, but the process lives on (1 and torch's default 3 end it), so warm
    # recovery can keep the survivors. The old name is set too for older torch.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "NCCL_ASYNC_ERROR_HANDLING": "2",
    "NCCL_SOCKET_IFNAME": "eth0",
}


@dataclass(frozen=True)
class RenderOptions:
    image: str = "ghcr.io/trainmesh/trainmesh:latest"
    namespace: str = "default"
    gpus_per_node: int = 8
    nodes: int | None = None  # default: what the spec's degrees need
    device: str = "h100"
    mlflow_secret: str = "trainmesh-mlflow"  # keys: uri, and optionally username/password
    shared_pvc: str | None = None  # a ReadWriteMany claim for checkpoints, mounted on every pod
    shm_size: str = "64Gi"
    worker_cpu: str = "32"
    worker_memory: str = "512Gi"


@dataclass(frozen=True)
class MeshSize:
    """The plan's degrees, from the caller (``trainmesh k8s render`` plans; deploy does not)."""

    tp: int
    pp: int
    dp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


def sizing(spec: JobSpec, opts: RenderOptions, mesh: MeshSize) -> dict[str, int]:
    """Nodes for the plan, and the elastic bounds in whole nodes."""
    g = opts.gpus_per_node
    replicas = math.ceil(mesh.world_size / g)
    el = spec.elastic
    low = min(replicas, math.ceil(el.min_world_size / g))
    high = max(replicas, math.ceil((el.max_world_size or mesh.world_size) / g))
    return {"replicas": replicas, "min_replicas": max(1, low), "max_replicas": high,
            "world_size": mesh.world_size, "tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp}


def _security() -> tuple[dict[str, Any], dict[str, Any]]:
    pod = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100,
           "seccompProfile": {"type": "RuntimeDefault"}}
    container = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                 "privileged": False}
    return pod, container


def _mlflow_env(secret: str) -> list[dict[str, Any]]:
    def ref(name: str, key: str, optional: bool) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key,
                                                             "optional": optional}}}

    return [ref("MLFLOW_TRACKING_URI", "uri", False),
            ref("MLFLOW_TRACKING_USERNAME", "username", True),
            ref("MLFLOW_TRACKING_PASSWORD", "password", True)]


def _pod(role: str, opts: RenderOptions, resources: dict[str, Any], ports: list[dict[str, Any]],
         extra_env: dict[str, str], api_token: bool = False) -> dict[str, Any]:
    pod_sc, container_sc = _security()
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory",
                                                                   "sizeLimit": opts.shm_size}}]
    if opts.shared_pvc:
        mounts.append({"name": "shared", "mountPath": SHARED_MOUNT})
        volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": opts.shared_pvc}})
    env = [{"name": k, "value": v} for k, v in extra_env.items()] + _mlflow_env(opts.mlflow_secret)
    container = {"name": f"ray-{role}", "image": opts.image, "imagePullPolicy": "IfNotPresent",
                 "resources": resources, "env": env, "volumeMounts": mounts,
                 "securityContext": container_sc}
    if ports:
        container["ports"] = ports
    return {"metadata": {"labels": {"app.kubernetes.io/name": "trainmesh",
                                    "app.kubernetes.io/component": f"ray-{role}"}},
            "spec": {"securityContext": pod_sc, "automountServiceAccountToken": api_token,
                     "containers": [container], "volumes": volumes}}


def _submitter(opts: RenderOptions) -> dict[str, Any]:
    """The pod that submits the job (KubeRay fills in its command). Given here because KubeRay's
    default one has no security context."""
    pod_sc, container_sc = _security()
    return {"metadata": {"labels": {"app.kubernetes.io/name": "trainmesh",
                                    "app.kubernetes.io/component": "ray-submitter"}},
            "spec": {"restartPolicy": "Never", "securityContext": pod_sc,
                     "automountServiceAccountToken": False,
                     "containers": [{"name": "ray-job-submitter", "image": opts.image,
                                     "imagePullPolicy": "IfNotPresent", "securityContext": container_sc,
                                     "resources": {"requests": {"cpu": "200m", "memory": "256Mi"},
                                                   "limits": {"cpu": "1", "memory": "1Gi"}}}]}}


class _Dumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks (``|``), so the embedded spec stays readable."""


_Dumper.add_representer(str, lambda d, v: d.represent_scalar(
    "tag:yaml.org,2002:str", v, style="|" if "\n" in v else None))


def to_yaml(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False)


def render_rayjob(spec: JobSpec, opts: RenderOptions, mesh: MeshSize) -> dict[str, Any]:
    """The RayJob for ``spec`` on the plan ``mesh``."""
    size = sizing(spec, opts, mesh)
    runtime = {"ray_address": "auto", "device": "cuda"}
    if opts.shared_pvc:
        runtime["output_dir"] = f"{SHARED_MOUNT}/{spec.name}"
    job_spec = spec.model_copy(update={
        "runtime": spec.runtime.model_copy(update=runtime),
        "tracking": spec.tracking.model_copy(update={"uri": None}),  # from the Secret instead
    })
    g = str(opts.gpus_per_node)
    autoscaling = size["min_replicas"] != size["max_replicas"]
    # With the autoscaler on, KubeRay adds its container to the head pod and binds a Role to the
    # pod's ServiceAccount: the pod must mount that account's token.
    head = _pod("head", opts, {"requests": {"cpu": "4", "memory": "16Gi"},
                               "limits": {"cpu": "8", "memory": "32Gi"}},
                [{"containerPort": 6379, "name": "gcs"}, {"containerPort": 8265, "name": "dashboard"},
                 {"containerPort": 10001, "name": "client"}], {}, api_token=autoscaling)
    worker = _pod("worker", opts, {"requests": {"cpu": opts.worker_cpu, "memory": opts.worker_memory,
                                                "nvidia.com/gpu": g},
                                   "limits": {"memory": opts.worker_memory, "nvidia.com/gpu": g}},
                  [], NCCL_ENV)
    worker["spec"]["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists",
                                      "effect": "NoSchedule"}]
    name = kuberay.dns_name(spec.name, kuberay.MAX_RAYJOB_NAME)
    doc = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": name, "namespace": opts.namespace,
                     "labels": {"app.kubernetes.io/name": "trainmesh", "trainmesh.io/job": name},
                     "annotations": {"trainmesh.io/plan": json.dumps(
                         {k: size[k] for k in ("tp", "pp", "dp", "world_size")})}},
        "spec": {
            "entrypoint": f"python -m trainmesh run env:{SPEC_ENV} --no-progress",
            "runtimeEnvYAML": to_yaml({"env_vars": {SPEC_ENV: to_yaml(job_spec.model_dump(mode="json"))}}),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 3600,
            "backoffLimit": 0,
            "submissionMode": "K8sJobMode",
            "submitterPodTemplate": _submitter(opts),
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": autoscaling,
                "headGroupSpec": {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
                                  "template": head},
                "workerGroupSpecs": [{
                    "groupName": "gpu",
                    "replicas": size["replicas"],
                    "minReplicas": size["min_replicas"],
                    "maxReplicas": size["max_replicas"],
                    "rayStartParams": {"num-gpus": g},
                    "template": worker,
                }],
            },
        },
    }
    if autoscaling:
        doc["spec"]["rayClusterSpec"]["autoscalerOptions"] = {
            "securityContext": _security()[1],
            "resources": {"requests": {"cpu": "250m", "memory": "512Mi"},
                          "limits": {"cpu": "1", "memory": "1Gi"}}}
    return kuberay.check(doc)
