"""What KubeRay (ray.io/v1) requires of a RayCluster or RayJob, as pydantic models.

Kubernetes validators cannot check these custom resources (their schemas live in the KubeRay
operator's CRDs), so the renderer checks its own output with these, and the chart tests check
the chart's. Only the fields KubeRay needs or constrains are modelled; anything else passes.
Pod templates inside are core Kubernetes and are validated as such (``pod_templates``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
MAX_RAYJOB_NAME = 47  # KubeRay appends a suffix to name the RayCluster it creates
MAX_NAME = 63


class _Obj(BaseModel):
    model_config = ConfigDict(extra="allow")


class Metadata(_Obj):
    name: str = Field(pattern=DNS_LABEL, max_length=MAX_NAME)
    namespace: str | None = Field(None, pattern=DNS_LABEL)


class Container(_Obj):
    name: str = Field(min_length=1)
    image: str = Field(min_length=1)


class PodSpec(_Obj):
    containers: list[Container] = Field(min_length=1)


class PodTemplate(_Obj):
    spec: PodSpec


class HeadGroupSpec(_Obj):
    rayStartParams: dict[str, str] = {}  # KubeRay takes strings only  # noqa: N815
    template: PodTemplate


class WorkerGroupSpec(_Obj):
    groupName: str = Field(min_length=1)  # noqa: N815
    replicas: int = Field(ge=0)
    minReplicas: int = Field(ge=0)  # noqa: N815
    maxReplicas: int = Field(ge=0)  # noqa: N815
    rayStartParams: dict[str, str] = {}  # noqa: N815
    template: PodTemplate

    @model_validator(mode="after")
    def _bounds(self) -> WorkerGroupSpec:
        if not self.minReplicas <= self.replicas <= self.maxReplicas:
            raise ValueError(f"worker group {self.groupName}: need minReplicas ≤ replicas ≤ "
                             f"maxReplicas, got {self.minReplicas}, {self.replicas}, {self.maxReplicas}")
        return self


class RayClusterSpec(_Obj):
    headGroupSpec: HeadGroupSpec  # noqa: N815
    workerGroupSpecs: list[WorkerGroupSpec] = []  # noqa: N815


class RayCluster(_Obj):
    apiVersion: Literal["ray.io/v1"]  # noqa: N815
    kind: Literal["RayCluster"]
    metadata: Metadata
    spec: RayClusterSpec


class RayJobSpec(_Obj):
    entrypoint: str = Field(min_length=1)
    rayClusterSpec: RayClusterSpec | None = None  # noqa: N815
    clusterSelector: dict[str, str] | None = None  # noqa: N815
    runtimeEnvYAML: str | None = None  # noqa: N815
    shutdownAfterJobFinishes: bool = False  # noqa: N815

    @model_validator(mode="after")
    def _one_cluster(self) -> RayJobSpec:
        if (self.rayClusterSpec is None) == (self.clusterSelector is None):
            raise ValueError("a RayJob needs exactly one of rayClusterSpec and clusterSelector")
        return self


class RayJob(_Obj):
    apiVersion: Literal["ray.io/v1"]  # noqa: N815
    kind: Literal["RayJob"]
    metadata: Metadata
    spec: RayJobSpec

    @model_validator(mode="after")
    def _name(self) -> RayJob:
        if len(self.metadata.name) > MAX_RAYJOB_NAME:
            raise ValueError(f"RayJob name {self.metadata.name!r} is longer than {MAX_RAYJOB_NAME}")
        return self


def check(doc: dict[str, Any]) -> RayCluster | RayJob:
    """Parse a RayCluster or RayJob document; ``ValueError`` lists every problem by path."""
    model = {"RayCluster": RayCluster, "RayJob": RayJob}.get(doc.get("kind"))
    if model is None:
        raise ValueError(f"kind {doc.get('kind')!r} is not RayCluster or RayJob")
    try:
        return model.model_validate(doc)
    except ValidationError as err:
        lines = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()]
        raise ValueError(f"{doc['kind']} {doc.get('metadata', {}).get('name')}: " + "; ".join(lines)) from None


def pod_templates(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod template) for every pod a RayCluster or RayJob would create."""
    spec = doc["spec"]
    cluster = spec.get("rayClusterSpec") if doc["kind"] == "RayJob" else spec
    if doc["kind"] == "RayJob" and spec.get("submitterPodTemplate"):
        yield "submitterPodTemplate", spec["submitterPodTemplate"]
    if cluster:
        yield "headGroupSpec", cluster["headGroupSpec"]["template"]
        for g in cluster.get("workerGroupSpecs", []):
            yield f"workerGroupSpecs[{g['groupName']}]", g["template"]


def dns_name(text: str, limit: int = MAX_NAME) -> str:
    """``text`` as a Kubernetes name: lower case, [a-z0-9-], at most ``limit`` characters."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].rstrip("-")
    return name or "trainmesh"
