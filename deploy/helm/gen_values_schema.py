"""Writes deploy/helm/pdserve/values.schema.json: the chart's values, with `config` checked as a
pdserve config.

The `config` part is generated from the pydantic models in platform/config.py (field names, types,
ranges and descriptions), so `helm install` rejects what ServeConfig would reject at deploy time,
minus the checks JSON Schema cannot express (those run in the chart's templates and in
`pdserve config validate`). The chart-only keys are written out below. tests/helm fails when the
file is stale:

    python deploy/helm/gen_values_schema.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.config import ServeConfig

SCHEMA_PATH = Path(__file__).parent / "pdserve" / "values.schema.json"
# Degrees a replica may span: GPUs per node come in powers of two, and so do KV-head counts. Over
# these, "a multiple of the prefill degree" is "at least the prefill degree".
TP_SIZES = [1, 2, 4, 8, 16]
DNS_LABEL = "^[a-z]([-a-z0-9]*[a-z0-9])?$"

Schema = dict[str, Any]


def _tidy(node: Any) -> Any:
    """Pydantic's schema, shaped for readable errors: no titles, `X | None` as one type list
    (anyOf errors list every branch), refs into draft-07 `definitions`."""
    if isinstance(node, list):
        return [_tidy(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {k: _tidy(v) for k, v in node.items() if k != "title"}
    if "$ref" in node:
        node["$ref"] = node["$ref"].replace("#/$defs/", "#/definitions/")
    branches = node.get("anyOf")
    if branches and len(branches) == 2 and {"type": "null"} in branches:
        other = next(b for b in branches if b != {"type": "null"})
        if "type" in other:
            del node["anyOf"]
            node.update({**other, "type": [other["type"], "null"]})
    return node


def _nested(path: tuple[str, ...], leaf: Schema) -> Schema:
    """`leaf` applied at path (each key required on the way down)."""
    for key in reversed(path):
        leaf = {"required": [key], "properties": {key: leaf}}
    return leaf


def _tp_is(path: tuple[str, ...], sizes: list[int]) -> Schema:
    return _nested(path, {"required": ["tensor_parallel_size"], "properties": {"tensor_parallel_size": {"enum": sizes}}})


def _tp_unset(path: tuple[str, ...]) -> Schema:
    return {"not": _nested(path, {"required": ["tensor_parallel_size"]})}


def _tp_rules() -> tuple[list[Schema], Schema]:
    """The decode degree must be a multiple of the prefill degree (ServeConfig._check_engines); a
    pool's engine overrides the top-level one. One if/then per case, so a failure names the one
    field to change. Returns the rules and the named conditions they share."""
    named = {"disaggregated": {"properties": {"mode": {"not": {"const": "colocated"}}}},
             "prefillInherits": _tp_unset(("prefill", "engine")),
             "decodeInherits": _tp_unset(("decode", "engine")),
             "engineInherits": _tp_unset(("engine",)),
             "decodeSets": {"not": _tp_unset(("decode", "engine"))},
             "engineSets": {"not": _tp_unset(("engine",))}}
    ref = {name: {"$ref": f"#/definitions/tp/{name}"} for name in named}
    rules = []
    for p in TP_SIZES[1:]:
        allowed = [q for q in TP_SIZES if q >= p]
        prefill_sets = _tp_is(("prefill", "engine"), [p])
        prefill_inherits = {"allOf": [ref["prefillInherits"], _tp_is(("engine",), [p])]}
        for prefill in (prefill_sets, prefill_inherits):
            rules.append({"if": {"allOf": [ref["disaggregated"], prefill, ref["decodeSets"]]},
                          "then": _tp_is(("decode", "engine"), allowed)})
        # decode inherits the top-level degree (or 1 when there is none) while prefill sets its own
        rules.append({"if": {"allOf": [ref["disaggregated"], prefill_sets, ref["decodeInherits"], ref["engineSets"]]},
                      "then": _tp_is(("engine",), allowed)})
        rules.append({"if": {"allOf": [ref["disaggregated"], prefill_sets, ref["decodeInherits"], ref["engineInherits"]]},
                      "then": _tp_is(("decode", "engine"), allowed)})
    return rules, named


def config_definitions() -> Schema:
    """ServeConfig and its parts; `engine` maps are EngineOverrides (EngineConfig's fields, each optional)."""
    serve = _tidy(ServeConfig.model_json_schema())
    definitions = serve.pop("definitions", None) or serve.pop("$defs")
    definitions["EngineOverrides"]["properties"]["tensor_parallel_size"] = {
        "enum": TP_SIZES, "description": "Ranks (GPUs) one replica spans: 1, 2, 4, 8 or 16."}
    # The chart reads these to size the pods: their types matter before Ray ever sees them.
    options = definitions["PoolConfig"]["properties"]["ray_actor_options"]
    options["properties"] = {"num_cpus": {"type": "number", "minimum": 0},
                             "num_gpus": {"type": "number", "minimum": 0},
                             "accelerator_type": {"type": "string"},
                             "resources": {"type": "object", "additionalProperties": {"type": "number", "minimum": 0}}}
    rules, named = _tp_rules()
    serve["allOf"] = rules
    return {"ServeConfig": serve, **definitions, "tp": named}


def _string_map() -> Schema:
    return {"type": "object", "additionalProperties": {"type": "string"}}


def _group_properties() -> Schema:
    """Keys of a worker group (pools.<pool> and extraWorkerGroups items); values.yaml describes them."""
    count = {"type": ["integer", "null"], "minimum": 0}
    return {
        "replicas": count, "minReplicas": count, "maxReplicas": count, "gpus": count,
        "gpuVendor": {"enum": ["", "nvidia", "amd"]},
        "cpu": {"type": ["string", "number", "null"]},
        "memory": {"type": "string"},
        "nodeSelector": _string_map(), "tolerations": {"type": "array"}, "affinity": {"type": "object"},
        # Strings, not numbers: KubeRay passes them to `ray start` as they are. (The templates reject
        # the resource flags, with a message naming the values to use instead.)
        "rayStartParams": _string_map(),
        "customResources": _string_map(), "labels": _string_map(), "annotations": _string_map(),
        "rdma": {"type": "boolean"},
    }


def _closed(properties: Schema, **extra: Any) -> Schema:
    return {"type": "object", "additionalProperties": False, "properties": properties, **extra}


def values_schema() -> Schema:
    port = {"type": "integer", "minimum": 1, "maximum": 65535}
    service_type = {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}
    boolean, string = {"type": "boolean"}, {"type": "string"}
    image = _closed({"repository": {"type": "string", "minLength": 1}, "tag": string,
                     "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}})
    monitor = _closed({"enabled": boolean, "interval": string, "labels": _string_map()})
    pods_in = _closed({"namespace": string, "podLabels": _string_map()})
    named_items = lambda *required: {"type": "array", "items": {"type": "object", "required": list(required)}}
    definitions = {
        **config_definitions(),
        "poolGroup": _closed(_group_properties()),
        "extraGroup": _closed({**_group_properties(), "name": {"type": "string", "pattern": DNS_LABEL, "maxLength": 40},
                               "pool": {"enum": ["prefill", "decode"]}, "acceleratorType": string},
                              required=["name", "pool"]),
    }
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$comment": "Generated by deploy/helm/gen_values_schema.py from platform/config.py: edit that, then run it.",
        "title": "pdserve chart values",
        "description": "Values of deploy/helm/pdserve (each key is described in values.yaml).",
        "type": "object",
        "additionalProperties": False,
        "definitions": definitions,
        "properties": {
            "global": {"type": "object"},
            "config": {"type": ["object", "string", "null"],
                       "description": "The pdserve config: a map (checked here), its YAML text (checked when rendered), "
                                      "or null for the embedded default.",
                       "if": {"type": "object"}, "then": {"$ref": "#/definitions/ServeConfig"}},
            "image": image,
            "imagePullSecrets": named_items("name"),
            "nameOverride": string,
            "fullnameOverride": {"type": "string", "maxLength": 47},
            "rayVersion": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+"},
            "upgradeStrategy": _closed({"type": {"enum": ["NewCluster", "NewClusterWithIncrementalUpgrade", "None"]},
                                        "clusterUpgradeOptions": {"type": "object"}}),
            "initializingTimeout": {"type": "string", "pattern": "^([0-9]+|([0-9]+(\\.[0-9]+)?(ms|s|m|h))+)$"},
            "excludeHeadPodFromServeSvc": boolean,
            "ports": _closed({"http": port, "grpc": port, "dashboard": port, "dashboardAgent": port, "metrics": port}),
            "grpc": _closed({"enabled": boolean}),
            "autoscaler": _closed({"enabled": boolean, "upscalingMode": {"enum": ["Conservative", "Default", "Aggressive"]},
                                   "idleTimeoutSeconds": {"type": "integer", "minimum": 0},
                                   "resources": {"type": "object"}}),
            "head": _closed({"cpu": {"type": ["string", "number"]}, "memory": string,
                             "rayStartParams": _string_map(), "nodeSelector": _string_map(),
                             "tolerations": {"type": "array"}, "affinity": {"type": "object"},
                             "labels": _string_map(), "annotations": _string_map()}),
            "accelerators": {"type": "object", "additionalProperties": _closed(
                {"vendor": {"enum": ["nvidia", "amd"]}, "nodeSelector": _string_map()})},
            "pools": _closed({"prefill": {"$ref": "#/definitions/poolGroup"},
                              "decode": {"$ref": "#/definitions/poolGroup"}},
                             description="Worker groups of the pools prefill and decode (no other names)."),
            "memoryPerGpuGi": {"type": "integer", "minimum": 1},
            "extraWorkerGroups": {"type": "array", "items": {"$ref": "#/definitions/extraGroup"}},
            "env": named_items("name"),
            "rayWorkerNiceness": {"type": ["integer", "null"], "minimum": 0, "maximum": 19},
            "volumes": named_items("name"),
            "volumeMounts": named_items("name", "mountPath"),
            "sharedMemorySize": string,
            "podSecurityContext": {"type": "object"},
            "securityContext": {"type": "object"},
            "serviceAccountName": string,
            "ray": _closed({"auth": _closed({"mode": {"enum": ["token", "disabled"]}, "existingSecret": string})}),
            "apiKeys": _closed({"keys": {"type": "array", "items": {"type": "string", "pattern": "^[^,\\s]+$"}},
                                "existingSecret": string, "secretKey": {"type": "string", "minLength": 1}}),
            "redis": _closed({"enabled": boolean,
                              # No credentials in the URL: the password goes in auth.existingSecret.
                              "externalUrl": {"type": "string", "pattern": "^(rediss?://[^@]+)?$"},
                              "auth": _closed({"enabled": boolean, "existingSecret": string,
                                               "secretKey": {"type": "string", "minLength": 1}}),
                              "image": image, "args": {"type": "array", "items": string},
                              "resources": {"type": "object"}, "nodeSelector": _string_map(),
                              "tolerations": {"type": "array"}, "affinity": {"type": "object"},
                              "podSecurityContext": {"type": "object"}, "securityContext": {"type": "object"}}),
            "serveService": _closed({"type": service_type, "annotations": _string_map()}),
            "services": _closed({
                "dashboard": _closed({"enabled": boolean, "annotations": _string_map()}),
                "metrics": _closed({"enabled": boolean, "annotations": _string_map()})}),
            "ingress": _closed({
                "enabled": boolean, "className": string, "annotations": _string_map(),
                "hosts": {"type": "array", "items": {"type": "object", "required": ["host", "paths"], "properties": {
                    "host": string,
                    "paths": {"type": "array", "items": {"type": "object", "required": ["path", "pathType"], "properties": {
                        "path": string, "pathType": {"enum": ["Prefix", "Exact", "ImplementationSpecific"]}}}}}}},
                "tls": {"type": "array"}}),
            "monitoring": _closed({"serviceMonitor": monitor, "podMonitor": monitor}),
            "networkPolicy": _closed({
                "enabled": boolean, "apiFrom": {"type": "array", "items": {"type": "object"}},
                "ingressController": pods_in, "kuberayOperator": pods_in, "monitoring": pods_in,
                "egress": _closed({"restrict": boolean,
                                   "kubernetesApiCidrs": {"type": "array", "items": {"type": "string", "pattern": "/"}},
                                   "kubernetesApiPorts": {"type": "array", "items": port},
                                   "dns": pods_in, "extra": {"type": "array", "items": {"type": "object"}}})}),
        },
    }


def render(schema: Schema, width: int = 118) -> str:
    """JSON with short objects on one line, so the file reads top to bottom."""
    def fmt(node: Any, indent: int) -> str:
        flat = json.dumps(node, ensure_ascii=False)
        if not isinstance(node, (dict, list)) or not node or len(flat) + indent <= width:
            return flat
        pad = " " * (indent + 2)
        if isinstance(node, dict):
            body = ",\n".join(f"{pad}{json.dumps(k)}: {fmt(v, indent + 2)}" for k, v in node.items())
            return "{\n" + body + "\n" + " " * indent + "}"
        return "[\n" + ",\n".join(pad + fmt(v, indent + 2) for v in node) + "\n" + " " * indent + "]"
    return fmt(schema, 0) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(render(values_schema()))
    print(f"wrote {SCHEMA_PATH}")
