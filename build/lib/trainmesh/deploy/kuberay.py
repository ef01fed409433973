"""What a KubeRay operator accepts: its CRD schema (``kuberay_schema``) and the rules the operator
itself enforces before it reconciles a RayCluster or RayJob.

The rules follow ``ray-operator/controllers/ray/utils/validation.go`` of KubeRay
``kuberay_schema.KUBERAY_VERSION`` (functions named beside each rule) with the operator's default
feature gates; a resource that breaks one is accepted by the API server and then marked
ValidationFailed (RayJob) or never reconciled (RayCluster). Rules about fields trainmesh never
renders (RayService, RayCronJob, TLS and history-server details) are left out; a field that needs
a feature gate off by default is refused. Pod templates inside are core Kubernetes and are
validated as such (``pod_templates``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import yaml

from trainmesh.deploy import kuberay_schema
from trainmesh.deploy.kuberay_schema import KUBERAY_VERSION

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_RAYCLUSTER_NAME = 53  # utils.MaxRayClusterNameLength
MAX_RAYJOB_NAME = MAX_RAYCLUSTER_NAME - 6  # utils.MaxRayJobNameLength: its cluster is <name>-xxxxx
CLUSTER_SELECTOR_KEY = "ray.io/cluster"
AUTOSCALER_V2_ENV = "RAY_enable_autoscaler_v2"
_START_RESOURCES = ("num-cpus", "num-gpus", "memory", "resources")
_GATED_OFF = {"networkPolicy": "RayClusterNetworkPolicy", "tlsOptions": "RayClusterMTLS",
              "historyServerOptions": "RayClusterHistoryServer"}
_QUALIFIED = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


def check(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` if KubeRay would accept and run it; else ``ValueError`` listing every problem."""
    found = problems(doc)
    if found:
        name = (doc.get("metadata") or {}).get("name")
        raise ValueError(f"{doc.get('kind')} {name} (KubeRay {KUBERAY_VERSION}): " + "; ".join(found))
    return doc


def problems(doc: dict[str, Any]) -> list[str]:
    """Schema problems (refused or pruned by the API server), then the operator's refusals."""
    found = kuberay_schema.problems(doc)
    if found:
        return found
    name = doc["metadata"].get("name", "")
    if doc["kind"] == "RayCluster":
        return (_name("RayCluster", name, MAX_RAYCLUSTER_NAME)
                + _cluster_spec(doc["spec"], doc["metadata"].get("annotations") or {}))
    return _name("RayJob", name, MAX_RAYJOB_NAME) + _job_spec(doc)


def _name(kind: str, name: str, limit: int) -> list[str]:
    """ValidateRayClusterMetadata / ValidateRayJobMetadata."""
    out = []
    if len(name) > limit:
        out.append(f"metadata.name: {kind} names are at most {limit} characters, {name!r} has {len(name)}")
    if not DNS1035.match(name):
        out.append(f"metadata.name: {name!r} is not a DNS-1035 label (lower-case letters, digits and "
                   "'-', starting with a letter)")
    return out


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _cluster_spec(spec: dict[str, Any], annotations: dict[str, str], where: str = "spec") -> list[str]:
    """ValidateRayClusterSpec (with validateRayGroupResources, validateRayGroupLabels,
    validateWorkerGroupIdleTimeout)."""
    out: list[str] = []
    head = spec["headGroupSpec"]
    head_pod = head["template"].get("spec", {})
    if not head_pod.get("containers"):
        return [f"{where}.headGroupSpec: needs at least one container"]
    head_env = _env(head_pod["containers"][0])
    autoscaling = bool(spec.get("enableInTreeAutoscaling"))
    options = spec.get("autoscalerOptions") or {}
    v2 = options.get("version") == "v2" or head_env.get(AUTOSCALER_V2_ENV) in ("1", "true")
    groups = [("headGroupSpec", "Head", head)] + [
        (f"workerGroupSpecs[{i}]", g["groupName"], g) for i, g in enumerate(spec.get("workerGroupSpecs", []))]
    for path, group, g in groups:
        at = f"{where}.{path}"
        params = g.get("rayStartParams", {})
        if any(params.get(k) for k in _START_RESOURCES) and g.get("resources"):
            out.append(f"{at}: resources set both in rayStartParams and resources ({group}); use one")
        if "labels" in params:
            out.append(f"{at}.rayStartParams.labels: not supported; use {path}.labels")
        for key, val in (g.get("labels") or {}).items():
            if not _QUALIFIED.match(key) or not _LABEL_VALUE.match(val) or len(val) > 63:
                out.append(f"{at}.labels: {key}={val!r} is not a valid Kubernetes label")
        if path == "headGroupSpec":
            continue
        if not g["template"].get("spec", {}).get("containers"):
            out.append(f"{at}: worker group {group} needs at least one container")
        # (the operator's "must set minReplicas and maxReplicas" cannot fire: the CRD defaults them)
        low, high = g.get("minReplicas", 0), g.get("maxReplicas", 2**31 - 1)
        for key, val in (("minReplicas", low), ("maxReplicas", high)):
            if val is not None and val < 0:
                out.append(f"{at}.{key}: negative ({val})")
        if low is not None and high is not None and low > high:
            out.append(f"{at}: minReplicas {low} is greater than maxReplicas {high}")
        if (g.get("idleTimeoutSeconds") or 0) < 0:
            out.append(f"{at}.idleTimeoutSeconds: negative")
        elif g.get("idleTimeoutSeconds") is not None and not v2:
            out.append(f"{at}.idleTimeoutSeconds: needs autoscaler v2 (autoscalerOptions.version: v2)")
        if g.get("priority") and _version(spec) < (2, 56):
            out.append(f"{at}.priority: needs rayVersion 2.56 or later")
        elif g.get("priority") and not v2:
            out.append(f"{at}.priority: needs autoscaler v2 (autoscalerOptions.version: v2)")
        if g.get("suspend") and autoscaling:
            out.append(f"{at}.suspend: a worker group cannot be suspended with the autoscaler on")
    out += _gcs_ft(spec, annotations, head_env, where)
    if head.get("rayStartParams", {}).get("redis-username") or "REDIS_USERNAME" in head_env:
        out.append(f"{where}.headGroupSpec: set the redis username in gcsFaultToleranceOptions")
    if not autoscaling and head_env.get(AUTOSCALER_V2_ENV) in ("1", "true"):
        out.append(f"{where}.headGroupSpec: {AUTOSCALER_V2_ENV} is on but enableInTreeAutoscaling is off")
    if autoscaling and options.get("version") and AUTOSCALER_V2_ENV in head_env:
        out.append(f"{where}: both autoscalerOptions.version and the head's {AUTOSCALER_V2_ENV} are set")
    account = head_pod.get("serviceAccountName", "")
    if autoscaling and account and account != _check_name(account):
        out.append(f"{where}.headGroupSpec: with the autoscaler, KubeRay renames the head's "
                   f"ServiceAccount {account!r} to {_check_name(account)!r} (utils.CheckName: at most "
                   "50 characters, starting with a letter) but binds its Role to the account it "
                   "finds under the full name: use an account name that CheckName leaves alone")
    if autoscaling and options.get("version") == "v2":
        for path, _, g in groups:
            policy = g["template"].get("spec", {}).get("restartPolicy", "")
            if policy not in ("", "Never"):
                out.append(f"{where}.{path}: restartPolicy must be Never or unset with autoscaler v2")
    if (options.get("idleTimeoutSeconds") or 0) < 0:
        out.append(f"{where}.autoscalerOptions.idleTimeoutSeconds: negative")
    if any(e.get("name") == "KUBERAY_GEN_AUTOSCALER_START_CMD" for e in options.get("env", [])):
        out.append(f"{where}.autoscalerOptions.env: KUBERAY_GEN_AUTOSCALER_START_CMD is KubeRay's")
    for key, gate in _GATED_OFF.items():
        if spec.get(key) is not None:
            out.append(f"{where}.{key}: needs the {gate} feature gate (off by default)")
    auth = spec.get("authOptions") or {}
    if auth.get("mode") == "token":
        need = (2, 55) if auth.get("enableK8sTokenAuth") else (2, 52)
        if _version(spec) < need:
            out.append(f"{where}.authOptions: token auth needs rayVersion {need[0]}.{need[1]} or later")
        if auth.get("enableK8sTokenAuth") and auth.get("secretName"):
            out.append(f"{where}.authOptions: enableK8sTokenAuth excludes secretName")
    elif auth.get("enableK8sTokenAuth"):
        out.append(f"{where}.authOptions: enableK8sTokenAuth needs mode: token")
    return out


def _gcs_ft(spec: dict[str, Any], annotations: dict[str, str], head_env: dict[str, Any],
            where: str) -> list[str]:
    """ValidateRayClusterSpec's GCS fault tolerance rules (with validateGcsFaultToleranceBackend)."""
    options = spec.get("gcsFaultToleranceOptions")
    head = spec["headGroupSpec"]
    if options is None:
        if str(annotations.get("ray.io/ft-enabled", "")).lower() != "true" and "RAY_REDIS_ADDRESS" in head_env:
            return [f"{where}.headGroupSpec: RAY_REDIS_ADDRESS needs gcsFaultToleranceOptions"]
        return []
    out = []
    if annotations.get("ray.io/ft-enabled"):
        out.append(f"{where}: the ray.io/ft-enabled annotation and gcsFaultToleranceOptions are both set")
    if annotations.get("ray.io/external-storage-namespace"):
        out.append(f"{where}: use gcsFaultToleranceOptions.externalStorageNamespace, not the annotation")
    if head.get("rayStartParams", {}).get("redis-password") or "REDIS_PASSWORD" in head_env:
        out.append(f"{where}.headGroupSpec: set the redis password in gcsFaultToleranceOptions")
    if "RAY_REDIS_ADDRESS" in head_env:
        out.append(f"{where}.headGroupSpec: set the redis address in gcsFaultToleranceOptions")
    if options.get("backend") == "rocksdb":
        out.append(f"{where}.gcsFaultToleranceOptions.backend: rocksdb needs the "
                   "GCSFaultToleranceEmbeddedStorage feature gate (off by default)")
    elif options.get("storage") is not None:
        out.append(f"{where}.gcsFaultToleranceOptions.storage: only for the rocksdb backend")
    return out


def _version(spec: dict[str, Any]) -> tuple[int, ...]:
    """rayVersion as numbers; () when unset or unreadable (older than any version)."""
    parts = re.findall(r"\d+", spec.get("rayVersion") or "")
    return tuple(int(x) for x in parts[:3])


def _check_name(name: str) -> str:
    """KubeRay's utils.CheckName: the last 50 characters; a leading digit or punctuation → 'r'."""
    name = name[-50:]
    return "r" + name[1:] if name and not name[0].isalpha() else name


def _job_spec(doc: dict[str, Any]) -> list[str]:
    """ValidateRayJobSpec (with validateDeletionConfiguration)."""
    spec = doc["spec"]
    out: list[str] = []
    shutdown = bool(spec.get("shutdownAfterJobFinishes"))
    selector = spec.get("clusterSelector") or {}
    mode = spec.get("submissionMode", "K8sJobMode")
    backoff = spec.get("backoffLimit")
    if spec.get("suspend") and not shutdown:
        out.append("spec.suspend: a RayJob without shutdownAfterJobFinishes cannot be suspended")
    if (spec.get("ttlSecondsAfterFinished") or 0) < 0:
        out.append("spec.ttlSecondsAfterFinished: negative")
    if (spec.get("ttlSecondsAfterFinished") or 0) > 0 and not shutdown:
        out.append("spec.ttlSecondsAfterFinished: only allowed with shutdownAfterJobFinishes: true "
                   "(it is the delay before the job's RayCluster is deleted)")
    deletion = spec.get("deletionStrategy")
    if deletion is not None:
        rules = deletion.get("deletionRules") or []
        legacy = deletion.get("onSuccess") is not None or deletion.get("onFailure") is not None
        if rules and shutdown:
            out.append("spec.deletionStrategy.deletionRules: exclusive with shutdownAfterJobFinishes")
        if rules and legacy:
            out.append("spec.deletionStrategy: deletionRules and onSuccess/onFailure are exclusive")
        if not rules and not (deletion.get("onSuccess") and deletion.get("onFailure")):
            out.append("spec.deletionStrategy: needs both onSuccess and onFailure, or deletionRules")
        elif legacy and not rules:
            out += _legacy_deletion(spec, shutdown, selector)
    if selector:
        if spec.get("suspend"):
            out.append("spec.suspend: not supported with clusterSelector")
        if not selector.get(CLUSTER_SELECTOR_KEY):
            out.append(f"spec.clusterSelector: needs a non-empty {CLUSTER_SELECTOR_KEY!r}")
        if mode == "SidecarMode":
            out.append("spec.submissionMode: SidecarMode does not support clusterSelector")
        if (backoff or 0) > 0:
            out.append("spec.backoffLimit: incompatible with clusterSelector")
    elif spec.get("rayClusterSpec") is None:
        out.append("spec: needs rayClusterSpec or clusterSelector")
    if mode == "InteractiveMode" and (backoff or 0) > 0:
        out.append("spec.backoffLimit: incompatible with InteractiveMode")
    if mode == "SidecarMode":
        for key in ("submitterPodTemplate", "submitterConfig"):
            if spec.get(key) is not None:
                out.append(f"spec.{key}: not supported in SidecarMode")
        head = ((spec.get("rayClusterSpec") or {}).get("headGroupSpec") or {}).get("template", {})
        if head.get("spec", {}).get("restartPolicy", "") not in ("", "Never"):
            out.append("spec.rayClusterSpec.headGroupSpec: restartPolicy must be Never or unset in SidecarMode")
    if spec.get("rayClusterSpec") is not None:
        cluster = spec["rayClusterSpec"]
        if (cluster.get("authOptions") or {}).get("enableK8sTokenAuth"):
            out.append("spec.rayClusterSpec.authOptions.enableK8sTokenAuth: not supported for RayJob")
        if (cluster.get("upgradeStrategy") or {}).get("type"):
            out.append("spec.rayClusterSpec.upgradeStrategy: not allowed on a RayJob's cluster")
        out += _cluster_spec(cluster, doc["metadata"].get("annotations") or {}, "spec.rayClusterSpec")
    try:
        env = yaml.safe_load(spec.get("runtimeEnvYAML") or "")
        if env is not None and not isinstance(env, dict):
            out.append("spec.runtimeEnvYAML: must be a YAML mapping")
    except yaml.YAMLError as err:
        out.append(f"spec.runtimeEnvYAML: not YAML ({err})")
    for key in ("activeDeadlineSeconds", "preRunningDeadlineSeconds"):
        if spec.get(key) is not None and spec[key] <= 0:
            out.append(f"spec.{key}: must be positive")
    if (backoff or 0) < 0:
        out.append("spec.backoffLimit: negative")
    return out


def _legacy_deletion(spec: dict[str, Any], shutdown: bool, selector: dict[str, str]) -> list[str]:
    """validateLegacyDeletionPolicies."""
    policies = {k: (spec["deletionStrategy"][k] or {}).get("policy") for k in ("onSuccess", "onFailure")}
    if None in policies.values():
        return ["spec.deletionStrategy: onSuccess.policy and onFailure.policy must both be set"]
    out = []
    if selector and set(policies.values()) & {"DeleteCluster", "DeleteWorkers"}:
        out.append("spec.deletionStrategy: clusterSelector allows neither DeleteCluster nor DeleteWorkers")
    if "DeleteWorkers" in policies.values() and (spec.get("rayClusterSpec") or {}).get("enableInTreeAutoscaling"):
        out.append("spec.deletionStrategy: DeleteWorkers does not work with the autoscaler")
    if shutdown and "DeleteNone" in policies.values():
        out.append("spec.deletionStrategy: DeleteNone contradicts shutdownAfterJobFinishes: true")
    return out


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


def created_pods(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod spec) for every pod the operator creates from ``doc``, with what KubeRay adds:
    its autoscaler container in the head pod (security context and resources from
    ``autoscalerOptions``, none otherwise) and, for a RayJob in K8sJobMode, its own submitter pod
    when no ``submitterPodTemplate`` is given (a container with no security context)."""
    spec = doc["spec"]
    cluster = spec.get("rayClusterSpec") if doc["kind"] == "RayJob" else spec
    for where, template in pod_templates(doc):
        pod = dict(template.get("spec", {}))
        if where == "headGroupSpec" and cluster.get("enableInTreeAutoscaling"):
            options = cluster.get("autoscalerOptions") or {}
            added = {"name": "autoscaler", "image": options.get("image", pod["containers"][0]["image"])}
            added.update({k: options[k] for k in ("securityContext", "resources") if k in options})
            pod["containers"] = [*pod["containers"], added]
        yield where, pod
    if (doc["kind"] == "RayJob" and spec.get("submissionMode", "K8sJobMode") == "K8sJobMode"
            and not spec.get("submitterPodTemplate")):
        yield "submitter (KubeRay's default)", {"restartPolicy": "Never", "containers": [
            {"name": "ray-job-submitter", "image": "the head's image"}]}


def dns_name(text: str, limit: int) -> str:
    """``text`` as a DNS-1035 label of at most ``limit`` characters: lower case, [a-z0-9-],
    starting with a letter (a name that starts otherwise gets ``tm-`` in front)."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if not name[:1].isalpha():
        name = f"tm-{name}"
    return name[:limit].rstrip("-")
