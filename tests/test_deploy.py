"""Kubernetes rendering (`trainmesh k8s render`) and the Helm chart, checked without a cluster:
Helm's own Go SDK (helm-python-sdk) lints and renders the chart, kubernetes-validate checks the
core kinds, and KubeRay's RayCluster/RayJob are checked against what KubeRay requires (their
pod templates as core PodTemplates)."""

from __future__ import annotations

import copy
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
import yaml

from trainmesh.deploy import kuberay
from trainmesh.deploy.render import RenderOptions
from trainmesh.jobs.cli import main
from trainmesh.jobs.k8s_cli import rayjob as render_rayjob
from trainmesh.jobs.loading import load_spec, spec_from_dict
from trainmesh.platform.job_plan import PlanError
from trainmesh.spec.job import SPEC_ENV

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "trainmesh"
K8S = "1.33.0"


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


def _pods(doc: dict) -> list[dict]:
    if doc["kind"] in ("RayCluster", "RayJob"):
        return [t["spec"] for _, t in kuberay.pod_templates(doc)]
    if doc["kind"] == "Deployment":
        return [doc["spec"]["template"]["spec"]]
    return []


def _assert_restricted(doc: dict) -> None:
    for pod in _pods(doc):
        assert pod["securityContext"]["runAsNonRoot"] is True, doc["kind"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, doc["kind"]
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (doc["kind"], c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (doc["kind"], c["name"])
            assert not sc.get("privileged"), (doc["kind"], c["name"])


# -- trainmesh k8s render -----------------------------------------------------------------

def test_rayjob_for_the_70b_reference_job_is_sized_from_its_plan():
    spec = load_spec(str(ROOT / "jobs" / "llama-70b.yaml"))
    doc = render_rayjob(spec, RenderOptions(image="registry.example/trainmesh:1", namespace="ml"))
    job = kuberay.check(doc)
    assert isinstance(job, kuberay.RayJob) and doc["metadata"]["namespace"] == "ml"
    [workers] = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    # tp 8 × pp 8 × dp 16 = 1024 GPUs = 128 nodes of 8; elastic 512..1024 GPUs = 64..128 nodes.
    assert (workers["replicas"], workers["minReplicas"], workers["maxReplicas"]) == (128, 64, 128)
    assert workers["rayStartParams"] == {"num-gpus": "8"}
    assert doc["spec"]["rayClusterSpec"]["enableInTreeAutoscaling"] is True
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
    _validate_pods(doc)
    _assert_restricted(doc)


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


def test_kuberay_check_names_what_is_wrong():
    doc = render_rayjob(load_spec(str(ROOT / "jobs" / "llama-70b.yaml")))
    bad = copy.deepcopy(doc)
    bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["minReplicas"] = 500
    with pytest.raises(ValueError, match="minReplicas ≤ replicas ≤ maxReplicas"):
        kuberay.check(bad)
    bad = copy.deepcopy(doc)
    bad["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0
    with pytest.raises(ValueError, match="rayStartParams.num-gpus"):
        kuberay.check(bad)
    bad = copy.deepcopy(doc)
    bad["spec"]["clusterSelector"] = {"ray.io/cluster": "x"}
    with pytest.raises(ValueError, match="exactly one of rayClusterSpec and clusterSelector"):
        kuberay.check(bad)
    assert kuberay.dns_name("My_Job.v2") == "my-job-v2"


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
            kuberay.check(doc)
            _validate_pods(doc)
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
    "no-networkpolicy-no-sa": {"networkPolicy": {"enabled": False},
                               "serviceAccount": {"create": False, "name": "existing"}},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chart_variants_render_and_validate(chart, variant):
    docs = _render(chart, VARIANTS[variant])
    _check_all(docs)
    kinds = _by_kind(docs)
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
    if variant.startswith("rayjob"):
        [job] = kinds["RayJob"]
        [cm] = kinds["ConfigMap"]
        spec_text = cm["data"]["job.yaml"]
        spec_from_dict(yaml.safe_load(spec_text))  # a valid trainmesh spec
        assert job["spec"]["entrypoint"].startswith("python -m trainmesh run /etc/trainmesh/jobs/job.yaml")
        heads = [t for w, t in kuberay.pod_templates(job) if w == "headGroupSpec"]
        if variant == "rayjob-on-the-raycluster":
            cluster = kinds["RayCluster"][0]["metadata"]["name"]
            assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster}
            heads = [kinds["RayCluster"][0]["spec"]["headGroupSpec"]["template"]]
        mounts = heads[0]["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "job-spec", "mountPath": "/etc/trainmesh/jobs", "readOnly": True} in mounts
    if variant == "no-networkpolicy-no-sa":
        assert "NetworkPolicy" not in kinds and "ServiceAccount" not in kinds
        head = kinds["RayCluster"][0]["spec"]["headGroupSpec"]["template"]["spec"]
        assert head["serviceAccountName"] == "existing"


def test_chart_names_fit_kubernetes_limits_for_long_release_names(chart):
    docs = _render(chart, {"rayJob": {"enabled": True}}, name="a-very-long-release-name-for-a-training-team-x" * 1)
    _check_all(docs)
    [job] = _by_kind(docs)["RayJob"]
    assert len(job["metadata"]["name"]) <= kuberay.MAX_RAYJOB_NAME


@pytest.mark.parametrize(("values", "message"), [
    ({"rayCluster": {"workers": {"gpusPerNode": "eight"}}}, "/rayCluster/workers/gpusPerNode"),
    ({"mlflow": {"backendStore": {"type": "postgres"}}}, "value must be one of 'sqlite', 'external'"),
    ({"rayCluster": {"head": {"serviceType": "Ingress"}}}, "/rayCluster/head/serviceType"),
    ({"workers": {"replicas": 2}}, "additional properties 'workers' not allowed"),
])
def test_chart_schema_rejects_bad_values_with_the_key(chart, values, message):
    with pytest.raises(helm_python.HelmValuesError, match=message.replace("(", r"\(").replace(")", r"\)")):
        chart.validate_schema(values)


@pytest.mark.parametrize(("values", "message"), [
    ({"rayCluster": {"workers": {"replicas": 5, "maxReplicas": 2}}},
     "rayCluster.workers: need minReplicas <= replicas <= maxReplicas"),
    ({"mlflow": {"enabled": False}}, "mlflow.external.existingSecret: name a Secret"),
    ({"mlflow": {"backendStore": {"type": "external"}}}, "mlflow.backendStore.existingSecret"),
])
def test_chart_refuses_inconsistent_values_with_a_fix(chart, values, message):
    with pytest.raises(helm_python.HelmError, match=message):
        chart.render(values, name="tm", namespace="ml")


def test_values_are_all_documented():
    """Every key in values.yaml is documented by a comment above it, or sits inside a
    documented map (STYLE.md: charts document every value)."""
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
