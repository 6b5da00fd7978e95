"""The chart renders and lints for the default values and every example config, and what it renders
is what KubeRay, Kubernetes and Ray Serve accept: the RayService against KubeRay's CRD, core
objects against Kubernetes' schemas, serveConfigV2 as a Ray Serve config whose pdserve config
validates and is the one `pdserve serve-config` would print."""

from __future__ import annotations

import pytest
import yaml

from pdserve.config import ServeConfig
from tests.helm.conftest import CHART, CONFIGS, EXAMPLES, NAMESPACE, RELEASE, example_values
from tests.helm.kube_schemas import KUBE_VERSION, core_errors, crd_errors

CASES = {"defaults": {}, **{name: example_values(name) for name in EXAMPLES}}
CORE_KINDS = {"Service", "Deployment", "Secret", "Ingress", "NetworkPolicy"}
# Everything optional switched on, so every template is rendered and checked at least once.
EVERYTHING = {
    "apiKeys": {"keys": ["sk-one", "sk-two"]},
    "ingress": {"enabled": True, "className": "nginx", "tls": [{"secretName": "tls", "hosts": ["pdserve.local"]}]},
    "monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
    "extraWorkerGroups": [{"name": "decode-l40s", "pool": "decode", "acceleratorType": "L40S", "gpus": 1,
                           "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]}],
    "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
    "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    "env": [{"name": "HF_HOME", "value": "/models/hf"}],
    "sharedMemorySize": "16Gi",
    "imagePullSecrets": [{"name": "regcred"}],
    "services": {"dashboard": {"enabled": True}},
    "ray": {"auth": {"existingSecret": "ray-token"}},
    "pools": {"decode": {"rdma": True}},
    "networkPolicy": {"apiFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
                      "egress": {"restrict": True, "kubernetesApiCidrs": ["10.96.0.1/32"],
                                 "extra": [{"to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}], "ports": [{"port": 4318}]}]}},
}


@pytest.mark.parametrize("case", CASES)
def test_renders_and_lints(helm, render, case):
    report = helm.lint(CHART, CASES[case], strict=True, kube_version=f"v{KUBE_VERSION}.0")
    assert report["errors"] == [], report
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]
    rendered = render(CASES[case])
    assert {kind for kind, _ in rendered.objects} >= {"RayService", "Deployment", "Service"}
    assert "port-forward svc/pds-pdserve-serve-svc 8000:8000" in rendered.notes


@pytest.mark.parametrize("case", [*CASES, "everything"])
def test_rayservice_matches_the_kuberay_crd(render, rayservice_validator, case):
    values = EVERYTHING if case == "everything" else CASES[case]
    assert crd_errors(rayservice_validator, render(values).rayservice) == []


def test_the_crd_check_catches_mistakes(render, rayservice_validator):
    """The strict CRD check is not vacuous: a misspelt field and a wrong type both fail."""
    rayservice = render().rayservice
    rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplica"] = 1
    rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["resources"]["CPU"] = 1
    errors = crd_errors(rayservice_validator, rayservice)
    assert any("minReplica" in e for e in errors) and any("is not of type 'string'" in e for e in errors), errors


@pytest.mark.parametrize("case", ["defaults", "everything"])
def test_core_objects_are_valid_kubernetes_objects(render, case):
    rendered = render(EVERYTHING if case == "everything" else {})
    for (kind, name), obj in rendered.objects.items():
        if kind in CORE_KINDS:
            assert core_errors(obj) == [], f"{kind}/{name}"
            labels = obj["metadata"]["labels"]
            assert labels["app.kubernetes.io/instance"] == RELEASE and labels["app.kubernetes.io/name"] == "pdserve"
            assert len(name) <= 63
    # The API Service is KubeRay's, built from spec.serveService: it must be a valid Service too.
    serve_service = rendered.rayservice["spec"]["serveService"]
    service = {"apiVersion": "v1", "kind": "Service", **serve_service,
               "metadata": {**serve_service["metadata"], "name": "pds-pdserve-serve-svc"}}
    assert core_errors(service) == []
    assert [(p["name"], p["port"]) for p in serve_service["spec"]["ports"]] == [("serve", 8000), ("serve-grpc", 9000)]


def test_monitors_and_ingress_point_at_what_exists(render):
    rendered = render(EVERYTHING)
    metrics = rendered.objects[("Service", "pds-pdserve-metrics")]
    assert metrics["spec"]["clusterIP"] == "None" and metrics["spec"]["ports"][0]["targetPort"] == "metrics"
    monitor = rendered.one("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "interval": "15s"}]
    pod_monitor = rendered.one("PodMonitor")
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    [rule] = rendered.one("Ingress")["spec"]["rules"]
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "pds-pdserve-serve-svc", "port": {"name": "serve"}}


def _pool_tags(pool: dict) -> dict:
    return pool["ray_actor_options"]["resources"]


def _user_configs() -> dict[str, dict]:
    configs = {"defaults": {}, **{name: yaml.safe_load((CONFIGS / name).read_text()) for name in EXAMPLES}}
    if "pool_ratio" in ServeConfig.model_fields:  # an application-level autoscaling policy in the Serve config
        # (without the slo: with it and both pools autoscaling, the joint policy sizes them instead)
        llama = configs["llama3-8b-h100-a100.yaml"]
        configs["pool-ratio"] = {**{k: v for k, v in llama.items() if k != "slo"},
                                 "pool_ratio": {"max_prefill_per_decode": 2}}
        configs["joint-budget"] = {**llama, "slo": {"ttft_ms": 750}, "max_total_replicas": 6,
                                   "decode": {**llama["decode"], "engine": {"max_num_seqs": 96}}}
    return configs


USER_CONFIGS = _user_configs()


@pytest.mark.parametrize("case", USER_CONFIGS)
def test_serve_config_is_what_pdserve_serve_config_prints(render, case):
    """serveConfigV2 parses as a Ray Serve config; its args validate as a ServeConfig; and
    app.serve_config of that ServeConfig is the same Serve config (plus the gRPC proxy)."""
    from ray.serve.schema import ServeDeploySchema

    from pdserve.app import grpc_options, serve_config

    rendered = render({"config": USER_CONFIGS[case]} if USER_CONFIGS[case] else {}).serve_config
    ServeDeploySchema.model_validate(rendered)
    [app] = rendered["applications"]
    config = ServeConfig.model_validate(app["args"])
    expected = serve_config(config)
    [expected_app] = expected.pop("applications")
    assert rendered.pop("grpc_options") == grpc_options(9000)
    rendered.pop("applications")
    assert rendered == expected
    assert {k: v for k, v in app.items() if k != "args"} == {k: v for k, v in expected_app.items() if k != "args"}
    assert ServeConfig.model_validate(expected_app["args"]) == config

    # ... and that config is the user's with only the Kubernetes settings injected.
    user = ServeConfig.model_validate(USER_CONFIGS[case])
    pools = ["decode"] if config.mode == "colocated" else ["prefill", "decode"]
    injected = {"gateway": user.gateway.model_copy(update={"host": "0.0.0.0", "port": 8000}),
                "router": user.router.model_copy(update={"redis_url": f"redis://pds-pdserve-redis.{NAMESPACE}.svc:6379/0"})}
    for name in pools:
        pool = getattr(user, name)
        options = {**pool.ray_actor_options,
                   "resources": {**pool.ray_actor_options.get("resources", {}), f"pdserve_{name}": 0.001}}
        injected[name] = pool.model_copy(update={"ray_actor_options": options})
    assert config == user.model_copy(update=injected)


def test_a_config_map_and_its_text_render_the_same(render):
    name = "llama3-8b-h100-a100.yaml"
    as_map = {"config": yaml.safe_load((CONFIGS / name).read_text())}
    assert render(as_map).stable_objects == render(example_values(name)).stable_objects
