"""JSON Schemas for what the chart renders: KubeRay's CRDs as the API server would check them, and
the core Kubernetes kinds (kubernetes-validate ships their OpenAPI schemas per Kubernetes release).

A CRD's openAPIV3Schema is not quite JSON Schema: `nullable` fields also take null, `required`
fields with a default may be left out, and the API server prunes unknown fields (here: rejects
them, so a typo in the chart fails instead of vanishing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import yaml

KUBE_VERSION = "1.30"  # the oldest Kubernetes the tests hold the chart to (Chart.yaml asks >= 1.26)


def crd_validator(crd_file: Path, version: str = "v1") -> jsonschema.Draft7Validator:
    crd = yaml.load(crd_file.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return jsonschema.Draft7Validator(_as_json_schema(served["schema"]["openAPIV3Schema"]))


def _as_json_schema(node: Any) -> Any:
    if isinstance(node, list):
        return [_as_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _as_json_schema(value) for key, value in node.items()}
    if node.pop("nullable", False) and "type" in node:
        node["type"] = [node["type"], "null"]
    if "properties" in node:
        defaults = {name for name, prop in node["properties"].items() if "default" in prop}
        if "required" in node:
            node["required"] = [name for name in node["required"] if name not in defaults]
        if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
    return node


def without_nulls(obj: Any) -> Any:
    """What the API server stores: keys whose value is null are dropped."""
    if isinstance(obj, dict):
        return {key: without_nulls(value) for key, value in obj.items() if value is not None}
    if isinstance(obj, list):
        return [without_nulls(item) for item in obj]
    return obj


def crd_errors(validator: jsonschema.Draft7Validator, obj: dict) -> list[str]:
    """Every violation, as 'path: message' (empty when the object is valid)."""
    return [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in validator.iter_errors(without_nulls(obj))]


def core_errors(obj: dict) -> list[str]:
    """Violations of the core kind's schema (strict: unknown fields fail too)."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"]
    return []
