"""KubeRay's own v1 schemas for RayCluster and RayJob, and a check of a document against them the
way the Kubernetes API server treats a custom resource.

``kuberay-v1.7.0.json`` beside this file is *derived* from KubeRay's CRDs (ray-project/kuberay,
tag v1.7.0, ``ray-operator/config/crd/bases/ray.io_rayclusters.yaml`` and ``ray.io_rayjobs.yaml``,
Apache-2.0) by ``python -m trainmesh.deploy.kuberay_schema --crds DIR`` and is not edited by
hand: the ``spec`` schema of version v1 with what does not decide acceptance dropped
(descriptions, list/map-type markers), the ``spec`` of each embedded pod template replaced by a
marker (a core ``PodSpec``, checked against Kubernetes' own schemas; the template's ``metadata``
keeps KubeRay's schema, which prunes all but name, namespace, labels, annotations and
finalizers), and RayJob's ``rayClusterSpec`` by a reference to RayCluster's spec (the generator
checks they are the same). To follow a newer KubeRay, run the generator on its checkout and
update ``KUBERAY_VERSION``.

What the API server does with a custom resource, and so what ``problems`` reports:
- a field the schema does not know is **pruned silently** (unless the schema preserves unknown
  fields) — reported, since a pruned field is a setting that silently does nothing;
- a wrong type, a value outside an ``enum``, a failed ``pattern``, ``maxLength``/``minLength``,
  ``minimum``, ``minItems``, a ``required`` field missing that has no default, an int32 out of
  range: refused;
- ``null`` where the schema is not ``nullable``: pruned — reported.
CEL rules (``x-kubernetes-validations``) are not evaluated: a field carrying one other than the
immutability rule ``self == oldSelf`` (``managedBy``, ``deletionStrategy``; trainmesh sets
neither) is reported as unchecked rather than passed.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import re
from pathlib import Path
from typing import Any

import yaml

KUBERAY_VERSION = "v1.7.0"
SCHEMA_FILE = Path(__file__).with_name(f"kuberay-{KUBERAY_VERSION}.json")
POD = "x-trainmesh-core"  # marker: a core object, checked with Kubernetes' schemas
REF = "x-trainmesh-ref"  # marker: the named schema of this file
_KEEP = {"type", "properties", "items", "required", "format", "additionalProperties", "anyOf",
         "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields", "pattern", "enum",
         "maxLength", "minLength", "minimum", "maximum", "nullable", "minItems", "maxItems",
         "default", "x-kubernetes-validations"}
_INT_RANGE = {"int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1)}


@functools.lru_cache(maxsize=1)
def schemas() -> dict[str, Any]:
    """{"RayCluster": spec schema, "RayJob": spec schema} of ``KUBERAY_VERSION``."""
    return json.loads(SCHEMA_FILE.read_text())["schemas"]


def problems(doc: dict[str, Any]) -> list[str]:
    """What KubeRay's CRD schema refuses or would prune in ``doc`` (a RayCluster or RayJob)."""
    kind = doc.get("kind")
    out: list[str] = []
    if doc.get("apiVersion") != "ray.io/v1":
        out.append(f"apiVersion: {doc.get('apiVersion')!r} is not ray.io/v1")
    if kind not in ("RayCluster", "RayJob"):
        return out + [f"kind: {kind!r} is not RayCluster or RayJob"]
    extra = set(doc) - {"apiVersion", "kind", "metadata", "spec", "status"}
    out += [f"{k}: not a field of {kind} (pruned)" for k in sorted(extra)]
    if not isinstance(doc.get("metadata"), dict):
        out.append("metadata: required")
    if "spec" not in doc:
        return out + ["spec: required"]
    _check(doc["spec"], schemas()[kind], "spec", out)
    return out


def _check(value: Any, schema: dict[str, Any], path: str, out: list[str]) -> None:
    if POD in schema:
        if not isinstance(value, dict):
            out.append(f"{path}: must be an object (a core {schema[POD]})")
        return
    if REF in schema:
        schema = schemas()[schema[REF]]
    if value is None:
        if not schema.get("nullable"):
            out.append(f"{path}: null (pruned: the schema is not nullable)")
        return
    if not _type_ok(value, schema):
        want = "integer or string" if schema.get("x-kubernetes-int-or-string") else schema.get("type")
        out.append(f"{path}: must be {want}, got {type(value).__name__} {value!r}")
        return
    rules = [v["rule"] for v in schema.get("x-kubernetes-validations", []) if v["rule"] != "self == oldSelf"]
    if rules:
        out.append(f"{path}: carries KubeRay's CEL rules {rules}, which this check does not evaluate")
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        if "pattern" in schema and not _go_search(schema["pattern"], value):
            out.append(f"{path}: {value!r} does not match {schema['pattern']}")
        if len(value) > schema.get("maxLength", len(value)):
            out.append(f"{path}: longer than {schema['maxLength']}")
        if len(value) < schema.get("minLength", 0):
            out.append(f"{path}: shorter than {schema['minLength']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        lo, hi = _INT_RANGE.get(schema.get("format", ""), (None, None))
        lo = schema.get("minimum", lo)
        hi = schema.get("maximum", hi)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            out.append(f"{path}: {value} outside [{lo}, {hi}]")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            out.append(f"{path}: needs at least {schema['minItems']} item(s)")
        for i, item in enumerate(value):
            _check(item, schema.get("items", {}), f"{path}[{i}]", out)
    if isinstance(value, dict):
        _check_object(value, schema, path, out)


def _check_object(value: dict[str, Any], schema: dict[str, Any], path: str, out: list[str]) -> None:
    props = schema.get("properties")
    for key in schema.get("required", []):
        if key not in value and "default" not in (props or {}).get(key, {}):  # defaults fill in
            out.append(f"{path}.{key}: required")
    for key, item in value.items():
        sub = f"{path}.{key}"
        if props is not None and key in props:
            _check(item, props[key], sub, out)
        elif isinstance(schema.get("additionalProperties"), dict):
            _check(item, schema["additionalProperties"], sub, out)
        elif not schema.get("x-kubernetes-preserve-unknown-fields") and (
                props is not None or schema.get("additionalProperties") is False):
            out.append(f"{sub}: not a field of KubeRay {KUBERAY_VERSION} (pruned)")


def _type_ok(value: Any, schema: dict[str, Any]) -> bool:
    if schema.get("x-kubernetes-int-or-string"):
        return isinstance(value, (int, str)) and not isinstance(value, bool)
    want = schema.get("type")
    if want is None:
        return True
    if want == "integer":  # JSON has no int type: 8.0 is accepted as 8
        return (isinstance(value, int) or isinstance(value, float) and value.is_integer()) \
            and not isinstance(value, bool)
    if want == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"string": str, "boolean": bool, "object": dict, "array": list}[want])


def _go_search(pattern: str, value: str) -> bool:
    """Go's regexp semantics for the CRDs' patterns: ``$`` is the end of the text only."""
    m = re.search(pattern, value)
    return m is not None and not (pattern.endswith("$") and value.endswith("\n"))


# -- the generator ---------------------------------------------------------------------------

def _derive(node: Any) -> Any:
    if isinstance(node, list):
        return [_derive(x) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, val in node.items():
        if key not in _KEEP:
            continue
        if key == "properties":
            out[key] = {name: _pod_template(sub) if _is_pod_template(sub) else _derive(sub)
                        for name, sub in val.items()}
        elif key == "x-kubernetes-validations":
            out[key] = [{"rule": v["rule"], "message": v.get("message", "")} for v in val]
        else:
            out[key] = _derive(val)
    return out


def _pod_template(schema: dict[str, Any]) -> dict[str, Any]:
    derived = _derive(schema)
    derived["properties"]["spec"] = {POD: "PodSpec"}
    return derived


def _is_pod_template(schema: dict[str, Any]) -> bool:
    props = schema.get("properties", {})
    return set(props) == {"metadata", "spec"} and "containers" in props["spec"].get("properties", {})


def _v1_spec(crd_file: Path) -> dict[str, Any]:
    crd = yaml.safe_load(crd_file.read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _derive(version["schema"]["openAPIV3Schema"]["properties"]["spec"])


def derive(crds: Path) -> dict[str, Any]:
    """The schema file's content from a directory holding KubeRay's two CRD files."""
    cluster = _v1_spec(crds / "ray.io_rayclusters.yaml")
    job = _v1_spec(crds / "ray.io_rayjobs.yaml")
    embedded = job["properties"]["rayClusterSpec"]
    if embedded != cluster:
        raise SystemExit("RayJob.spec.rayClusterSpec differs from RayCluster.spec: extend the "
                         "generator before dropping the reference")
    job = copy.deepcopy(job)
    job["properties"]["rayClusterSpec"] = {REF: "RayCluster"}
    return {"source": f"ray-project/kuberay {KUBERAY_VERSION}, ray-operator/config/crd/bases "
                      "(Apache-2.0); derived by trainmesh.deploy.kuberay_schema",
            "schemas": {"RayCluster": cluster, "RayJob": job}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--crds", type=Path, required=True,
                   help="KubeRay's ray-operator/config/crd/bases at tag " + KUBERAY_VERSION)
    p.add_argument("--check", action="store_true", help="compare with the committed file, write nothing")
    args = p.parse_args(argv)
    text = json.dumps(derive(args.crds), indent=1, sort_keys=True) + "\n"
    if args.check:
        same = SCHEMA_FILE.exists() and SCHEMA_FILE.read_text() == text
        print("same" if same else f"{SCHEMA_FILE.name} differs from the CRDs given")
        return 0 if same else 1
    SCHEMA_FILE.write_text(text)
    print(f"wrote {SCHEMA_FILE} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
