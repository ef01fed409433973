"""Kubernetes rendering (`trainmesh k8s render`) and the Helm chart, checked without a cluster:
Helm's own Go SDK (helm-python-sdk) lints and renders the chart, kubernetes-validate checks the
core kinds and every pod template (as a core PodTemplate), and RayCluster/RayJob are checked
against KubeRay's own CRD schema and the operator's validation rules (``kuberay``, KubeRay
v1.7.0). Every pod — KubeRay's injected autoscaler and submitter included — must meet the
restricted Pod Security Standard."""

from __future__ import annotations

import copy
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
import yaml

from trainmesh.cli.k8s import rayjob as render_rayjob
from trainmesh.cli.loading import load_spec, spec_from_dict
from trainmesh.cli.main import main
from trainmesh.deploy import kuberay, kuberay_schema
from trainmesh.deploy.render import RenderOptions
from trainmesh.planning.job_plan import PlanError
from trainmesh.spec.job import SPEC_ENV

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "trainmesh"
K8S = "1.33.0"
# The restricted Pod Security Standard (kubernetes.io/docs/concepts/security/pod-security-standards).
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def _validate_core(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S, strict=True)


def _validate_pods(doc: dict) -> None:
    for where, template in kuberay.pod_templates(doc):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate",
                   "metadata": {"name": f"check-{where.split('[')[0].lower()}"}, "template": template}
        try:
            _validate_core(wrapped)
        except kubernetes_validate.ValidationError as err:
            raise AssertionError(f"{doc['kind']} {where}: {err}") from None


def _pods(doc: dict) -> list[tuple[str, dict]]:
    if doc["kind"] in ("RayCluster", "RayJob"):
        return list(kuberay.created_pods(doc))
    if doc["kind"] == "Deployment":
        return [("pod", doc["spec"]["template"]["spec"])]
    return []


def _restricted_violations(pod: dict) -> list[str]:
    """What in ``pod`` (a PodSpec) the restricted Pod Security Standard forbids."""
    out = [f"{k}: true" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    out += [f"volume {v['name']}" for v in pod.get("volumes", []) if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    psc = pod.get("securityContext") or {}
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities must drop ALL and add at most NET_BIND_SERVICE")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            out.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
    return out


def _assert_restricted(doc: dict) -> None:
    for where, pod in _pods(doc):
        bad = _restricted_violations(pod)
        assert not bad, (doc["kind"], doc["metadata"]["name"], where, bad)


def _check_kuberay(doc: dict) -> None:
    """KubeRay's schema and operator accept ``doc``; its pods are valid core pods, restricted."""
    kuberay.check(doc)
    _validate_pods(doc)
    _assert_restricted(doc)


# -- KubeRay's rules --------------------------------------------------------------------------

def test_restricted_check_catches_kuberays_default_pods():
    """The PSS check is not vacuous: KubeRay's own default submitter pod, an autoscaler with no
    security context, and a root or hostPath pod all fail it."""
    job = render_rayjob(load_spec(str(ROOT / "jobs" / "llama-70b.yaml")))
    assert _restricted_violations(dict(kuberay.created_pods(job))["headGroupSpec"]) == []
    del job["spec"]["submitterPodTemplate"]
    del job["spec"]["rayClusterSpec"]["autoscalerOptions"]
    pods = dict(kuberay.created_pods(job))
    assert "ray-job-submitter: allowPrivilegeEscalation is not false" in \
        _restricted_violations(pods["submitter (KubeRay's default)"])
    assert "autoscaler: allowPrivilegeEscalation is not false" in _restricted_violations(pods["headGroupSpec"])
    pod = copy.deepcopy(pods["headGroupSpec"])
    pod["securityContext"]["runAsUser"] = 0
    pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    bad = _restricted_violations(pod)
    assert "volume host" in bad and "ray-head: runAsUser 0" in bad


def test_kuberay_schema_is_kuberays_and_checks_like_the_api_server():
    assert kuberay_schema.KUBERAY_VERSION in kuberay_schema.SCHEMA_FILE.name
    source = yaml.safe_load(kuberay_schema.SCHEMA_FILE.read_text())["source"]
    assert source.startswith(f"ray-project/kuberay {kuberay_schema.KUBERAY_VERSION}")
    doc = render_rayjob(load_spec(str(ROOT / "jobs" / "llama-70b.yaml")))
    assert kuberay_schema.problems(doc) == []
    bad = copy.deepcopy(doc)
    spec = bad["spec"]
    group = spec["rayClusterSpec"]["workerGroupSpecs"][0]
    group["replica"] = 3  # a typo the API server would prune silently
    group["maxReplicas"] = 2**31  # int32
    spec["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0  # strings only
    spec["rayClusterSpec"]["enableInTreeAutoscaling"] = "yes"
    spec["jobId"] = None
    spec["rayClusterSpec"]["upgradeStrategy"] = {"type": "Rolling"}  # not in the enum
    assert sorted(kuberay_schema.problems(bad)) == [
        "spec.jobId: null (pruned: the schema is not nullable)",
        "spec.rayClusterSpec.enableInTreeAutoscaling: must be boolean, got str 'yes'",
        "spec.rayClusterSpec.headGroupSpec.rayStartParams.num-gpus: must be string, got int 0",
        "spec.rayClusterSpec.upgradeStrategy.type: 'Rolling' is not one of ['Recreate', 'None']",
        "spec.rayClusterSpec.workerGroupSpecs[0].maxReplicas: 2147483648 outside [-2147483648, 2147483647]",
        "spec.rayClusterSpec.workerGroupSpecs[0].replica: not a field of KubeRay v1.7.0 (pruned)",
    ]
    wrong_kind = {**doc, "kind": "RayService"}
    assert kuberay_schema.problems(wrong_kind) == ["kind: 'RayService' is not RayCluster or RayJob"]


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["metadata"].update(name="x" * 48), "RayJob names are at most 47 characters"),
    (lambda d: d["metadata"].update(name="70b"), "'70b' is not a DNS-1035 label"),
    (lambda d: d["spec"].update(shutdownAfterJobFinishes=False),
     "ttlSecondsAfterFinished: only allowed with shutdownAfterJobFinishes: true"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(minReplicas=500),
     "minReplicas 500 is greater than maxReplicas 128"),
    (lambda d: d["spec"].update(clusterSelector={"ray.io/cluster": "x"}, backoffLimit=1),
     "spec.backoffLimit: incompatible with clusterSelector"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(idleTimeoutSeconds=60),
     "idleTimeoutSeconds: needs autoscaler v2"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(suspend=True),
     "a worker group cannot be suspended with the autoscaler on"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(resources={"GPU": "8"}),
     "resources set both in rayStartParams and resources (gpu)"),
    (lambda d: d["spec"].update(runtimeEnvYAML="a: [b"), "spec.runtimeEnvYAML: not YAML"),
    (lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"].update(
        serviceAccountName="a" * 51), "KubeRay renames the head's ServiceAccount"),
    (lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"].update(
        generateName="x-"), "template.metadata.generateName: not a field of KubeRay v1.7.0 (pruned)"),
])
def test_kuberay_operator_rules_name_what_is_wrong(change, message):
    doc = render_rayjob(load_spec(str(ROOT / "jobs" / "llama-70b.yaml")))
    _check_kuberay(doc)
    change(doc)
    with pytest.raises(ValueError, match="RayJob .*" + message.replace("(", r"\(").replace(")", r"\)")):
        kuberay.check(doc)


# -- trainmesh k8s render -----------------------------------------------------------------

def test_rayjob_for_the_70b_reference_job_is_sized_from_its_plan():
    spec = load_spec(str(ROOT / "jobs" / "llama-70b.yaml"))
    doc = render_rayjob(spec, RenderOptions(image="registry.example/trainmesh:1", namespace="ml"))
    _check_kuberay(doc)
    assert doc["metadata"]["namespace"] == "ml"
    cluster = doc["spec"]["rayClusterSpec"]
    [workers] = cluster["workerGroupSpecs"]
    # tp 8 × pp 8 × dp 16 = 1024 GPUs = 128 nodes of 8; elastic 512..1024 GPUs = 64..128 nodes.
    assert (workers["replicas"], workers["minReplicas"], workers["maxReplicas"]) == (128, 64, 128)
    assert workers["rayStartParams"] == {"num-gpus": "8"}
    assert cluster["enableInTreeAutoscaling"] is True
    # the autoscaler KubeRay adds to the head pod reads the pod's ServiceAccount token
    assert cluster["headGroupSpec"]["template"]["spec"]["automountServiceAccountToken"] is True
    assert workers["template"]["spec"]["automountServiceAccountToken"] is False
    assert cluster["autoscalerOptions"]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert doc["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["image"] == "registry.example/trainmesh:1"
    [c] = workers["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "8"
    env = {e["name"]: e for e in c["env"]}
    # survivors of a failed collective must live on for warm recovery: CleanUpOnly, not TearDown
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"]["value"] == "2"
    assert env["NCCL_ASYNC_ERROR_HANDLING"]["value"] == "2"
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        assert "value" not in env[name]  # never inlined
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "trainmesh-mlflow"
    shm = {v["name"]: v for v in workers["template"]["spec"]["volumes"]}["dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]


# spec, overrides, render options, whether the autoscaler is on (elastic bounds differ: the
# default elastic.min_world_size is 1, so every multi-node job may shrink to one node)
RENDERS = {
    "70b": ("llama-70b.yaml", [], {}, True),
    "4-gpu-nodes-pvc": ("small-gpu.yaml", [], {"gpus_per_node": 4, "shared_pvc": "ckpt"}, True),
    "fixed-size": ("small-gpu.yaml", ["elastic.min_world_size=8", "elastic.max_world_size=8"], {}, False),
    "elastic": ("small-gpu.yaml", ["elastic.min_world_size=4", "elastic.max_world_size=16"],
                {"gpus_per_node": 4}, True),
    "digit-name": ("small-gpu.yaml", ["name=70b"], {}, False),
    "long-name": ("small-gpu.yaml", ["name=" + ("Pretraining.Run_of_the_llama_family-" * 2)[:63]],
                  {"gpus_per_node": 1}, True),
    "auto-plan": ("tiny-cpu.yaml", ["parallelism=auto", "model.preset=8b", "training.global_batch_size=64",
                                    "training.seq_len=4096", "training.dtype=bfloat16"], {"nodes": 2}, True),
}


@pytest.mark.parametrize("case", list(RENDERS))
def test_rendered_rayjobs_are_accepted_by_kuberay(case):
    path, overrides, opts, autoscaling = RENDERS[case]
    doc = render_rayjob(load_spec(str(ROOT / "jobs" / path), overrides), RenderOptions(**opts))
    _check_kuberay(doc)
    spec = doc["spec"]
    cluster = spec["rayClusterSpec"]
    [workers] = cluster["workerGroupSpecs"]
    assert (workers["minReplicas"] != workers["maxReplicas"]) is autoscaling
    assert cluster["enableInTreeAutoscaling"] is autoscaling
    assert cluster["headGroupSpec"]["template"]["spec"]["automountServiceAccountToken"] is autoscaling
    assert ("autoscalerOptions" in cluster) is autoscaling
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    if case == "digit-name":
        assert doc["metadata"]["name"] == "tm-70b"
    if case == "long-name":
        assert len(doc["metadata"]["name"]) == kuberay.MAX_RAYJOB_NAME


def test_rendered_rayjob_carries_the_spec_the_cluster_will_run(monkeypatch):
    spec = load_spec(str(ROOT / "jobs" / "llama-70b.yaml"), ["tracking.uri=http://user:secret@mlflow:5000"])
    doc = render_rayjob(spec)
    assert "secret@" not in yaml.safe_dump(doc)
    env = yaml.safe_load(doc["spec"]["runtimeEnvYAML"])["env_vars"]
    monkeypatch.setenv(SPEC_ENV, env[SPEC_ENV])
    assert doc["spec"]["entrypoint"] == f"python -m trainmesh run env:{SPEC_ENV} --no-progress"
    carried = load_spec(f"env:{SPEC_ENV}")
    assert carried.runtime.ray_address == "auto" and carried.tracking.uri is None
    assert carried.model == spec.model and carried.parallelism == spec.parallelism
    assert carried.training == spec.training and carried.elastic == spec.elastic


def test_render_auto_plans_for_the_given_nodes_and_refuses_without_them():
    spec = load_spec(None, ["parallelism=auto", "model.preset=8b", "training.global_batch_size=64",
                            "training.seq_len=4096", "training.dtype=bfloat16"])
    with pytest.raises(ValueError, match="pass --nodes"):
        render_rayjob(spec)
    doc = render_rayjob(spec, RenderOptions(nodes=2, gpus_per_node=8))
    [workers] = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert 1 <= workers["replicas"] <= 2
    with pytest.raises(PlanError, match="no feasible plan"):
        render_rayjob(load_spec(None, ["model.preset=70b", "parallelism.tp=8"]),
                      RenderOptions(gpus_per_node=8, device="l40s"))


def test_k8s_render_cli(capsys):
    assert main(["k8s", "render", str(ROOT / "jobs" / "llama-70b.yaml"), "--image", "img:2",
                 "--namespace", "team-a", "--shared-pvc", "ckpt"]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    kuberay.check(doc)
    head = doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert {"name": "shared", "persistentVolumeClaim": {"claimName": "ckpt"}} in head["volumes"]
    assert main(["k8s", "render", str(ROOT / "jobs" / "llama-70b.yaml"), "--gpus-per-node", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["--nodes/--gpus-per-node: must be at least 1; give a positive count"]


# -- the Helm chart -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chart():
    c = helm_python.Chart.load(str(CHART))
    yield c
    c.close()


def _render(chart, values: dict | None, name: str = "tm", namespace: str = "ml") -> list[dict]:
    chart.validate_schema(values)
    out = chart.render(values, name=name, namespace=namespace)
    docs = []
    for path, text in out.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def _check_all(docs: list[dict]) -> None:
    for doc in docs:
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]
        if doc["apiVersion"] == "ray.io/v1":
            _check_kuberay(doc)
        else:
            _validate_core(doc)
            _assert_restricted(doc)
        if doc["kind"] == "Service":
            assert doc["spec"]["type"] == "ClusterIP"


def _by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def test_chart_lints_clean():
    report = helm_python.lint(str(CHART), strict=True, namespace="ml")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


def test_chart_defaults_render_a_raycluster_and_an_mlflow_server(chart):
    docs = _render(chart, None)
    _check_all(docs)
    kinds = _by_kind(docs)
    assert set(kinds) == {"RayCluster", "Secret", "Service", "PersistentVolumeClaim", "Deployment",
                          "ServiceAccount", "NetworkPolicy"}
    [rc] = kinds["RayCluster"]
    assert rc["spec"]["headGroupSpec"]["serviceType"] == "ClusterIP"
    [workers] = rc["spec"]["workerGroupSpecs"]
    [c] = workers["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "2"} in c["env"]
    uri = next(e for e in c["env"] if e["name"] == "MLFLOW_TRACKING_URI")
    [secret] = kinds["Secret"]
    assert uri["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    assert secret["stringData"]["uri"] == "http://tm-trainmesh-mlflow.ml.svc:5000"
    [deploy] = kinds["Deployment"]
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--backend-store-uri=sqlite:////mlflow/mlflow.db" in args
    [policy] = kinds["NetworkPolicy"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]


VARIANTS = {
    "gpu-autoscaling": {"rayCluster": {"enableInTreeAutoscaling": True, "workers": {
        "gpusPerNode": 4, "replicas": 2, "minReplicas": 1, "maxReplicas": 4,
        "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}}},
        "sharedStorage": {"existingClaim": "ckpt-rwx"}},
    "cpu-workers": {"rayCluster": {"workers": {"gpusPerNode": 0, "tolerations": []}}},
    "external-mlflow": {"mlflow": {"enabled": False, "external": {"existingSecret": "mlflow-creds"}}},
    "mlflow-postgres": {"mlflow": {"backendStore": {"type": "external", "existingSecret": "pg"},
                                   "persistence": {"enabled": False}}},
    "rayjob-on-the-raycluster": {"rayJob": {"enabled": True}},
    "rayjob-own-cluster": {"rayCluster": {"enabled": False},
                           "rayJob": {"enabled": True, "spec": {"name": "big", "model": {"preset": "1b"}}}},
    "rayjob-own-cluster-kept": {"rayCluster": {"enabled": False},
                                "rayJob": {"enabled": True, "shutdownAfterJobFinishes": False}},
    "rayjob-autoscaling-on-the-raycluster": {
        "rayJob": {"enabled": True},
        "rayCluster": {"enableInTreeAutoscaling": True, "workers": {"minReplicas": 0, "maxReplicas": 3}}},
    "numeric-start-params": {"rayCluster": {
        "head": {"rayStartParams": {"object-store-memory": 10000000000, "num-gpus": 0, "block": True}},
        "workers": {"rayStartParams": {"object-store-memory": 2.5e10, "min-worker-port": 10002}}}},
    "no-networkpolicy-no-sa": {"networkPolicy": {"enabled": False},
                               "serviceAccount": {"create": False, "name": "existing"}},
    "s3-compatible-store": {"objectStore": {"endpoint": "http://minio.storage.svc:9000",
                                            "region": "eu-west-1", "existingSecret": "s3-creds"},
                            "rayJob": {"enabled": True}},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chart_variants_render_and_validate(chart, variant):
    docs = _render(chart, VARIANTS[variant])
    _check_all(docs)
    kinds = _by_kind(docs)
    if variant == "s3-compatible-store":  # the head (controller) and workers (ranks) alike
        [rc] = kinds["RayCluster"]
        pods = [rc["spec"]["headGroupSpec"]["template"],
                *(g["template"] for g in rc["spec"]["workerGroupSpecs"])]
        for pod in pods:
            env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
            assert env["FSSPEC_S3_ENDPOINT_URL"]["value"] == "http://minio.storage.svc:9000"
            assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage.svc:9000"
            assert env["AWS_DEFAULT_REGION"]["value"] == "eu-west-1"
            for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
                assert env[var]["valueFrom"]["secretKeyRef"] == {"name": "s3-creds", "key": var}
    if variant == "gpu-autoscaling":
        [rc] = kinds["RayCluster"]
        assert rc["spec"]["enableInTreeAutoscaling"] is True
        [w] = rc["spec"]["workerGroupSpecs"]
        assert (w["replicas"], w["minReplicas"], w["maxReplicas"]) == (2, 1, 4)
        assert w["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "4"
        shared = {"name": "shared", "persistentVolumeClaim": {"claimName": "ckpt-rwx"}}
        assert shared in w["template"]["spec"]["volumes"]
    if variant == "cpu-workers":
        [w] = kinds["RayCluster"][0]["spec"]["workerGroupSpecs"]
        assert "nvidia.com/gpu" not in str(w) and w["rayStartParams"] == {}
    if variant == "external-mlflow":
        assert "Deployment" not in kinds and "Secret" not in kinds
        env = kinds["RayCluster"][0]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
        refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in env if e["name"].startswith("MLFLOW")]
        assert refs == ["mlflow-creds"] * 3
    if variant == "mlflow-postgres":
        [deploy] = kinds["Deployment"]
        c = deploy["spec"]["template"]["spec"]["containers"][0]
        assert "--backend-store-uri=$(MLFLOW_BACKEND_STORE_URI)" in c["args"]
        assert c["env"][-1]["valueFrom"]["secretKeyRef"] == {"name": "pg", "key": "backend-store-uri"}
        assert "PersistentVolumeClaim" not in kinds
    if variant == "gpu-autoscaling" or variant == "rayjob-autoscaling-on-the-raycluster":
        [rc] = kinds["RayCluster"]
        head = rc["spec"]["headGroupSpec"]["template"]["spec"]
        # the chart's ServiceAccount mounts no token; the autoscaler's head pod must
        assert head["automountServiceAccountToken"] is True
        assert rc["spec"]["autoscalerOptions"]["resources"]["limits"]["memory"] == "1Gi"
        [sa] = kinds["ServiceAccount"]
        assert head["serviceAccountName"] == sa["metadata"]["name"] and sa["automountServiceAccountToken"] is False
    if variant == "numeric-start-params":
        [rc] = kinds["RayCluster"]
        assert rc["spec"]["headGroupSpec"]["rayStartParams"] == {
            "object-store-memory": "10000000000", "num-gpus": "0", "block": "true", "dashboard-host": "0.0.0.0"}
        assert rc["spec"]["workerGroupSpecs"][0]["rayStartParams"] == {
            "object-store-memory": "25000000000", "min-worker-port": "10002", "num-gpus": "8"}
    if variant.startswith("rayjob"):
        [job] = kinds["RayJob"]
        own = "RayCluster" not in kinds
        assert ("ttlSecondsAfterFinished" in job["spec"]) is (variant == "rayjob-own-cluster")
        assert ("shutdownAfterJobFinishes" in job["spec"]) is own
        [cm] = kinds["ConfigMap"]
        spec_text = cm["data"]["job.yaml"]
        spec_from_dict(yaml.safe_load(spec_text))  # a valid trainmesh spec
        assert job["spec"]["entrypoint"].startswith("python -m trainmesh run /etc/trainmesh/jobs/job.yaml")
        heads = [t for w, t in kuberay.pod_templates(job) if w == "headGroupSpec"]
        if not own:
            cluster = kinds["RayCluster"][0]["metadata"]["name"]
            assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster}
            heads = [kinds["RayCluster"][0]["spec"]["headGroupSpec"]["template"]]
        mounts = heads[0]["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "job-spec", "mountPath": "/etc/trainmesh/jobs", "readOnly": True} in mounts
    if variant == "no-networkpolicy-no-sa":
        assert "NetworkPolicy" not in kinds and "ServiceAccount" not in kinds
        head = kinds["RayCluster"][0]["spec"]["headGroupSpec"]["template"]["spec"]
        assert head["serviceAccountName"] == "existing"


@pytest.mark.parametrize(("release", "values"), [
    ("a-very-long-release-name-for-the-pretraining-team-x", {}),
    ("x" * 53, {"rayCluster": {"enabled": False}}),
    ("70b", {"fullnameOverride": "llama-70b"}),
    ("a-very-long-release-name-for-the-pretraining-team-x", {"rayCluster": {
        "enableInTreeAutoscaling": True, "workers": {"minReplicas": 0, "maxReplicas": 4}}}),
])
def test_chart_names_fit_kuberays_limits(chart, release, values):
    docs = _render(chart, {**values, "rayJob": {"enabled": True}}, name=release)
    _check_all(docs)  # KubeRay's 53/47-character and DNS-1035 rules included
    kinds = _by_kind(docs)
    [job] = kinds["RayJob"]
    assert len(job["metadata"]["name"]) <= kuberay.MAX_RAYJOB_NAME
    for rc in kinds.get("RayCluster", []):
        assert len(rc["metadata"]["name"]) <= kuberay.MAX_RAYCLUSTER_NAME
        assert job["spec"]["clusterSelector"] == {"ray.io/cluster": rc["metadata"]["name"]}


@pytest.mark.parametrize(("values", "message"), [
    ({"rayCluster": {"workers": {"gpusPerNode": "eight"}}}, "/rayCluster/workers/gpusPerNode"),
    ({"mlflow": {"backendStore": {"type": "postgres"}}}, "value must be one of 'sqlite', 'external'"),
    ({"rayCluster": {"head": {"serviceType": "Ingress"}}}, "/rayCluster/head/serviceType"),
    ({"workers": {"replicas": 2}}, "additional properties 'workers' not allowed"),
    ({"objectStore": {"endpoint": "minio:9000"}}, "/objectStore/endpoint"),
])
def test_chart_schema_rejects_bad_values_with_the_key(chart, values, message):
    with pytest.raises(helm_python.HelmValuesError, match=message.replace("(", r"\(").replace(")", r"\)")):
        chart.validate_schema(values)


@pytest.mark.parametrize(("values", "message"), [
    ({"rayCluster": {"workers": {"replicas": 5, "maxReplicas": 2}}},
     "rayCluster.workers: need minReplicas <= replicas <= maxReplicas"),
    ({"mlflow": {"enabled": False}}, "mlflow.external.existingSecret: name a Secret"),
    ({"mlflow": {"backendStore": {"type": "external"}}}, "mlflow.backendStore.existingSecret"),
    ({"rayCluster": {"workers": {"maxReplicas": 4}}},
     "minReplicas 1 and maxReplicas 4 differ but rayCluster.enableInTreeAutoscaling is false"),
    ({"release": "70b"}, 'RayCluster name "70b-trainmesh-ray" is not a DNS-1035 label .* set fullnameOverride'),
    ({"rayCluster": {"enabled": False}, "rayJob": {"enabled": True}, "release": "7"},
     'RayJob name "7-trainmesh-job" is not a DNS-1035 label'),
    ({"serviceAccount": {"create": False, "name": "s" * 51}, "rayCluster": {"enableInTreeAutoscaling": True}},
     "KubeRay renames a ServiceAccount longer than 50 characters"),
])
def test_chart_refuses_inconsistent_values_with_a_fix(chart, values, message):
    values = dict(values)
    with pytest.raises(helm_python.HelmError, match=message):
        chart.render(values, name=values.pop("release", "tm"), namespace="ml")


def test_values_are_all_documented():
    """Every key in values.yaml is documented by a comment above it, or sits inside a
    documented map (a chart documents every value)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    undocumented = []
    for i, line in enumerate(lines):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if text.startswith("- ") or ":" not in text:
            continue  # list items belong to their documented key
        documented = i > 0 and lines[i - 1].strip().startswith("#")
        if not documented and not any(d for _, d in stack) and not text.endswith(":"):
            undocumented.append(text)
        stack.append((indent, documented))
    assert not undocumented, undocumented
