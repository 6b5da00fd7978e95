"""The chart is secure by default (issue #41): Ray's token auth on, the dashboard not exposed,
NetworkPolicies around every pod (the KubeRay operator's access included), the restricted Pod
Security Standard on every pod and container, Redis behind a password from a Secret, API keys only
from a Secret, and the transport limits `pdserve serve` sets. Each switch removes exactly its
objects. checkov, the common IaC scanner, finds nothing on the chart's plain objects."""

from __future__ import annotations

import base64
import copy
import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from pdserve.config import GatewayConfig, ServeConfig
from pdserve.launch import GRPC_MAX_MESSAGE_ENV, HA_PROXY_CLIENT_TIMEOUT_ENV, ray_env
from tests.conftest import free_port
from tests.helm.conftest import EXAMPLES, NAMESPACE, REPO, RELEASE, example_values
from tests.helm.kube_rules import Pod, admits, restricted_violations, selects

CASES = {"defaults": {}, **{name: example_values(name) for name in EXAMPLES}}
FULLNAME = f"{RELEASE}-pdserve"
RAY_COMPONENTS = ("ray-head", "ray-worker")


def _pods(rendered) -> dict[str, tuple[dict, dict]]:
    """Every pod the chart makes, as (labels as the cluster sees them, PodSpec): the head (with
    KubeRay's autoscaler sidecar, built from autoscalerOptions), each worker group, Redis."""
    cluster = rendered.rayservice["spec"]["rayClusterConfig"]
    kuberay_labels = {"ray.io/cluster": f"{FULLNAME}-x7k2p", "ray.io/is-ray-node": "yes"}
    head = cluster["headGroupSpec"]["template"]
    head_spec = copy.deepcopy(head["spec"])
    if cluster.get("enableInTreeAutoscaling"):
        options = cluster["autoscalerOptions"]
        head_spec["containers"].append({"name": "autoscaler", "securityContext": options.get("securityContext"),
                                        "volumeMounts": options.get("volumeMounts")})
    pods = {"head": ({**head["metadata"]["labels"], **kuberay_labels}, head_spec)}
    for group in cluster["workerGroupSpecs"]:
        template = group["template"]
        pods[group["groupName"]] = ({**template["metadata"]["labels"], **kuberay_labels}, template["spec"])
    for deployment in rendered.all("Deployment"):
        pods[deployment["metadata"]["name"]] = (deployment["spec"]["template"]["metadata"]["labels"],
                                                deployment["spec"]["template"]["spec"])
    return pods


def _ray_containers(rendered) -> list[dict]:
    return [c for labels, spec in _pods(rendered).values() if labels.get("app.kubernetes.io/component") in RAY_COMPONENTS
            for c in spec["containers"] if c["name"] != "autoscaler"]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env") or []}


# -- 1. Ray's token auth ------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_ray_token_auth_is_on_with_the_token_kuberay_generates(render, case):
    rendered = render(CASES[case])
    assert rendered.rayservice["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}
    # No chart-made token: nothing random in the RayService, so `helm upgrade` keeps the cluster.
    assert render(CASES[case]).rayservice == rendered.rayservice
    assert "get rayservice pds-pdserve -o jsonpath='{.status.activeServiceStatus.rayClusterName}'" in rendered.notes
    assert "get secret \"$CLUSTER\" -o jsonpath='{.data.auth_token}' | base64 -d" in rendered.notes


def test_an_existing_token_secret_is_handed_to_kuberay(render):
    rendered = render({"ray": {"auth": {"existingSecret": "ray-token"}}})
    assert rendered.rayservice["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    assert "get secret ray-token -o jsonpath='{.data.auth_token}' | base64 -d" in rendered.notes
    assert "Secret" not in {kind for kind, _ in rendered.objects if _ == "ray-token"}  # the user's, not ours
    disabled = render({"ray": {"auth": {"mode": "disabled"}}})
    assert disabled.rayservice["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "disabled"}
    assert "auth_token" not in disabled.notes


# -- 2. The dashboard ---------------------------------------------------------------------------


def test_the_dashboard_is_not_exposed_by_default(render):
    rendered = render()
    services = rendered.all("Service")
    assert not [s for s in services if s["metadata"]["name"].endswith("-dashboard")]
    ray_services = [s for s in services if s["metadata"]["name"] != f"{FULLNAME}-redis"]
    assert not {p["port"] for s in ray_services for p in s["spec"]["ports"]} & {6379, 8265, 10001, 52365}
    head = rendered.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert 10001 not in {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert head["serviceType"] == "ClusterIP"
    assert "port-forward svc/pds-pdserve-head-svc 8265:8265" in rendered.notes
    assert "exec -it" in rendered.notes and "-- pdserve status" in rendered.notes
    enabled = render({"services": {"dashboard": {"enabled": True}}})
    service = enabled.objects[("Service", f"{FULLNAME}-dashboard")]
    assert service["spec"]["type"] == "ClusterIP"


# -- 3. NetworkPolicies -------------------------------------------------------------------------


def _policies(rendered) -> list[dict]:
    return rendered.all("NetworkPolicy")


def _ray_pods(rendered) -> dict[str, Pod]:
    return {name: Pod(NAMESPACE, labels) for name, (labels, _) in _pods(rendered).items()}


OPERATOR = Pod("default", {"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/instance": "kuberay"})
NEIGHBOUR = Pod(NAMESPACE, {"app": "some-client"})
STRANGER = Pod("other-team", {"app": "some-client"})
PROMETHEUS = Pod("monitoring", {"app.kubernetes.io/name": "prometheus"})
INGRESS_CONTROLLER = Pod("ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"})


@pytest.mark.parametrize("case", CASES)
def test_every_pod_is_selected_by_a_policy(render, case):
    rendered = render(CASES[case])
    policies = _policies(rendered)
    for name, (labels, _) in _pods(rendered).items():
        selecting = [p["metadata"]["name"] for p in policies if selects(p["spec"]["podSelector"], labels)]
        assert selecting, f"no NetworkPolicy selects pod {name}"
    for policy in policies:  # KubeRay's cluster label changes during an upgrade: never key on it
        assert "ray.io/cluster" not in json.dumps(policy["spec"])


@pytest.mark.parametrize("case", CASES)
def test_the_policies_let_in_exactly_what_serving_needs(render, case):
    rendered = render(CASES[case])
    policies, pods = _policies(rendered), _ray_pods(rendered)
    head, redis = pods["head"], pods[f"{FULLNAME}-redis"]
    workers = [pod for name, pod in pods.items() if name not in ("head", f"{FULLNAME}-redis")]
    # The operator deploys and health-checks the Serve app on the head, and nothing else.
    assert admits(policies, OPERATOR, head, 8265) and admits(policies, OPERATOR, head, 52365)
    assert not admits(policies, OPERATOR, head, 6379)
    assert not any(admits(policies, OPERATOR, w, 52365) for w in workers)
    # Ray pods reach each other on every port, the new cluster's pods during an upgrade too.
    new_cluster = Pod(NAMESPACE, {**workers[0].labels, "ray.io/cluster": f"{FULLNAME}-n3w00"})
    for port in (6379, 8265, 10001, 52365, 41000, 8000):
        assert all(admits(policies, src, dst, port) for src in [head, new_cluster] for dst in [head, *workers])
    # The API from the namespace; nothing else from it, nothing from other namespaces.
    assert all(admits(policies, NEIGHBOUR, pod, port) for pod in [head, *workers] for port in (8000, 9000))
    assert not any(admits(policies, NEIGHBOUR, head, port) for port in (6379, 8265, 10001, 52365, 8080))
    assert not any(admits(policies, STRANGER, pod, 8000) for pod in [head, *workers])
    assert not admits(policies, INGRESS_CONTROLLER, head, 8000)  # no Ingress, no ingress controller
    # Prometheus on the metrics port only.
    assert all(admits(policies, PROMETHEUS, pod, 8080) for pod in [head, *workers])
    assert not admits(policies, PROMETHEUS, head, 8000)
    # UCX's listener and TCP interfaces take ephemeral ports, and any peer that reaches one can write
    # into the process (docs/security.md, "UCX's TCP transport"): Ray pods reach each other's, no one
    # else reaches any.
    ucx_ports, outsiders = (32768, 47167, 60999), (NEIGHBOUR, STRANGER, PROMETHEUS, OPERATOR, INGRESS_CONTROLLER)
    assert all(admits(policies, src, dst, port) for src in workers for dst in [head, *workers] for port in ucx_ports)
    assert not any(admits(policies, outsider, dst, port)
                   for outsider in outsiders for dst in [head, *workers] for port in ucx_ports)
    # Redis from the Ray pods only.
    assert admits(policies, workers[0], redis, 6379) and admits(policies, head, redis, 6379)
    assert not admits(policies, NEIGHBOUR, redis, 6379) and not admits(policies, OPERATOR, redis, 6379)


def test_the_policies_follow_the_values(render):
    rendered = render({"ingress": {"enabled": True},
                       "networkPolicy": {"apiFrom": [{"ipBlock": {"cidr": "203.0.113.0/24"}}],
                                         "kuberayOperator": {"namespace": "kuberay-system"},
                                         "monitoring": {"namespace": ""}}})
    policies, pods = _policies(rendered), _ray_pods(rendered)
    head = pods["head"]
    assert admits(policies, Pod(ip="203.0.113.9"), head, 8000) and not admits(policies, Pod(ip="198.51.100.1"), head, 8000)
    assert not admits(policies, NEIGHBOUR, head, 8000)  # apiFrom replaces the namespace default
    assert admits(policies, INGRESS_CONTROLLER, head, 8000)
    assert not admits(policies, OPERATOR, head, 8265)
    assert admits(policies, Pod("kuberay-system", OPERATOR.labels), head, 8265)
    assert not admits(policies, PROMETHEUS, head, 8080)


def test_restricted_egress_allows_dns_redis_and_the_api_server_for_the_autoscaler(render, helm):
    values = {"networkPolicy": {"egress": {"restrict": True, "kubernetesApiCidrs": ["10.96.0.1/32"]}}}
    rendered = render(values)
    policies, pods = _policies(rendered), _ray_pods(rendered)
    head, redis, decode = pods["head"], pods[f"{FULLNAME}-redis"], pods["decode"]
    dns = Pod("kube-system", {"k8s-app": "kube-dns"})
    api, internet = Pod(ip="10.96.0.1"), Pod(ip="93.184.216.34")
    assert admits(policies, head, api, 443) and not admits(policies, decode, api, 443)
    assert admits(policies, decode, dns, 53, "UDP") and admits(policies, decode, redis, 6379)
    assert admits(policies, decode, head, 6379) and not admits(policies, decode, internet, 443)
    assert not admits(policies, redis, dns, 53, "UDP") and not admits(policies, redis, head, 8000)
    with pytest.raises(helm.HelmError, match="kubernetesApiCidrs"):
        render({"networkPolicy": {"egress": {"restrict": True}}})
    assert render({"networkPolicy": {"egress": {"restrict": True}}, "autoscaler": {"enabled": False}}).all("NetworkPolicy")


# -- 4. The restricted Pod Security Standard ----------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_every_pod_meets_the_restricted_pod_security_standard(render, case):
    rendered = render(CASES[case])
    for name, (labels, spec) in _pods(rendered).items():
        assert restricted_violations(spec) == [], name
        ray = labels.get("app.kubernetes.io/component") in RAY_COMPONENTS
        context = spec["securityContext"]
        assert (context["runAsUser"], context["fsGroup"]) == ((1000, 100) if ray else (999, 1000)), name
        # Only the head calls the Kubernetes API (the autoscaler beside it).
        assert spec["automountServiceAccountToken"] is (name == "head"), name
        for container in spec["containers"]:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, (name, container["name"])
            mounts = {m["mountPath"] for m in container.get("volumeMounts") or []}
            expected = ({"/tmp", "/home/ray/.cache/pdserve/kernels", "/home/ray/.cache/huggingface", "/home/ray/.triton"}
                        if ray else {"/data", "/run/pdserve/redis-config"})
            assert expected <= mounts, (name, container["name"])


def test_the_checker_is_not_vacuous_and_rdma_is_the_one_documented_exception(render):
    rendered = render({"pools": {"decode": {"rdma": True}}})
    pods = _pods(rendered)
    assert restricted_violations(pods["prefill"][1]) == []
    assert restricted_violations(pods["decode"][1]) == ["ray-worker: capabilities.add ['IPC_LOCK']"]
    loose = render({"securityContext": {"allowPrivilegeEscalation": None, "runAsNonRoot": False, "seccompProfile": None},
                    "podSecurityContext": {"seccompProfile": None}, "autoscaler": {"enabled": False}})
    assert restricted_violations(_pods(loose)["head"][1]) == [
        "ray-head: allowPrivilegeEscalation is not false", "ray-head: runAsNonRoot is not true",
        "ray-head: seccompProfile None"]
    assert _pods(render({"autoscaler": {"enabled": False}}))["head"][1]["automountServiceAccountToken"] is False


# -- 5 and 6. Secrets: Redis' password and the API keys -----------------------------------------


def _non_secret_text(rendered) -> str:
    return "\n".join(yaml.safe_dump(obj) for (kind, _), obj in rendered.objects.items() if kind != "Secret") \
        + rendered.notes


def test_redis_has_a_password_that_only_its_secret_holds(render):
    rendered = render({"apiKeys": {"keys": ["sk-tenant-one-9f8e7d"]}})
    secret = rendered.objects[("Secret", f"{FULLNAME}-redis")]
    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    assert len(password) == 32 and password.isalnum()
    text = _non_secret_text(rendered)
    assert password not in text and "sk-tenant-one-9f8e7d" not in text
    assert "api_keys" not in rendered.rayservice["spec"]["serveConfigV2"]
    for container in _ray_containers(rendered):
        ref = _env(container)["PDSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": f"{FULLNAME}-redis", "key": "redis-password"}


def test_an_existing_or_external_redis_takes_its_password_the_same_way(render):
    existing = render({"redis": {"auth": {"existingSecret": "redis-creds", "secretKey": "pw"}}})
    assert ("Secret", f"{FULLNAME}-redis") not in existing.objects
    volume = next(v for v in _pods(existing)[f"{FULLNAME}-redis"][1]["volumes"] if v["name"] == "password")
    assert volume["secret"]["secretName"] == "redis-creds" and volume["secret"]["items"][0]["key"] == "pw"
    external = render({"redis": {"externalUrl": "redis://cache.example:6379/0", "auth": {"existingSecret": "redis-creds"}}})
    assert not external.all("Deployment") and not [k for k in external.objects if k[0] == "Secret"]
    assert all(_env(c)["PDSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "redis-creds"
               for c in _ray_containers(external))
    # A config that names another variable gets it there.
    renamed = render({"config": "router: {redis_password_env: KV_REDIS_PASSWORD}"})
    assert all("KV_REDIS_PASSWORD" in _env(c) for c in _ray_containers(renamed))
    open_redis = render({"redis": {"externalUrl": "redis://cache.example:6379/0"}})
    assert all("PDSERVE_REDIS_PASSWORD" not in _env(c) for c in _ray_containers(open_redis))


def test_credentials_in_the_redis_url_are_refused(helm, render):
    with pytest.raises(helm.HelmValuesError, match="externalUrl"):
        render({"redis": {"externalUrl": "redis://:hunter2@cache.example:6379/0"}})


def test_the_rendered_redis_start_runs_redis_with_the_password(render, tmp_path, monkeypatch):
    """The Deployment's own start script and probe, run against the real server (redis-server, or
    the Valkey pdserve finds, under the image's names) with a password that needs Redis' quoting;
    pdserve's routers then connect with it from the env."""
    from pdserve.router.kv_events import _redis
    from pdserve.router.redis_server import INSTALL_HINT, find_server

    server_binary = find_server()
    if server_binary is None:
        pytest.skip(INSTALL_HINT)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cli = Path(server_binary).with_name(Path(server_binary).name.replace("-server", "-cli"))
    (bin_dir / "redis-server").symlink_to(server_binary)
    (bin_dir / "redis-cli").symlink_to(cli)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")

    deployment = render().objects[("Deployment", f"{FULLNAME}-redis")]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    root = tmp_path / "run"
    (root / "redis-password").mkdir(parents=True)
    (root / "redis-config").mkdir()
    password = 'pa"ss\\word with spaces'
    (root / "redis-password" / "password").write_text(password + "\n")
    script = container["args"][0].replace("/run/pdserve", str(root))
    port = free_port()
    server = subprocess.Popen(["/bin/sh", "-c", script, *container["args"][1:], "--port", str(port),
                               "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL)
    try:
        ping = container["livenessProbe"]["exec"]["command"][2].replace("/run/pdserve", str(root))
        ping = ping.replace("redis-cli", f"redis-cli -p {port}")
        for _ in range(50):
            if subprocess.run(["/bin/sh", "-c", ping]).returncode == 0:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the liveness probe never passed")
        assert subprocess.run(["/bin/sh", "-c", f"redis-cli -p {port} ping | grep -q PONG"]).returncode != 0
        os.environ["PDSERVE_TEST_REDIS_PASSWORD"] = password
        try:
            client = _redis(f"redis://127.0.0.1:{port}/0", timeout_s=2, password_env="PDSERVE_TEST_REDIS_PASSWORD")
            assert client.ping() and client.config_get("maxmemory") == {"maxmemory": str(512 * 2**20)}
        finally:
            del os.environ["PDSERVE_TEST_REDIS_PASSWORD"]
        assert (root / "redis-config" / "redis.conf").stat().st_mode & 0o077 == 0
    finally:
        server.terminate()
        server.wait(10)


def test_api_keys_come_only_from_the_secret(helm, render):
    with pytest.raises(helm.HelmError, match=r"gateway.api_keys: API keys given in the config .*\n .* apiKeys.keys"):
        render({"config": "gateway: {api_keys: [sk-inline]}"})
    with_keys = render({"apiKeys": {"keys": ["sk-a"]}})
    assert all(_env(c)["PDSERVE_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == f"{FULLNAME}-api-keys"
               for c in _ray_containers(with_keys))


@pytest.mark.parametrize("values, warned", [
    ({}, False),
    ({"serveService": {"type": "LoadBalancer"}}, True),
    ({"ingress": {"enabled": True}}, True),
    ({"serveService": {"type": "LoadBalancer"}, "apiKeys": {"keys": ["sk-a"]}}, False),
])
def test_the_notes_warn_of_an_open_api_without_keys(render, values, warned):
    assert ("WARNING: no API keys are set" in render(values).notes) is warned


# -- 7. Transport limits ------------------------------------------------------------------------


@pytest.mark.parametrize("config", [None, "gateway: {max_body_bytes: 1048576, request_timeout_s: 90.5}"])
def test_the_pods_get_the_transport_limits_pdserve_serve_sets(render, config):
    rendered = render({"config": config} if config else {})
    gateway = ServeConfig.model_validate(yaml.safe_load(config or "{}") or {}).gateway
    expected = {GRPC_MAX_MESSAGE_ENV: str(gateway.max_body_bytes),
                HA_PROXY_CLIENT_TIMEOUT_ENV: str(math.ceil(gateway.request_timeout_s))}
    # The same values `pdserve serve` puts in its environment (HAProxy's only where it finds HAProxy).
    launched = ray_env(ServeConfig.model_validate(yaml.safe_load(config or "{}") or {}), None, cpus=2)
    assert {k: v for k, v in expected.items() if k in launched} == {k: launched[k] for k in expected if k in launched}
    assert GRPC_MAX_MESSAGE_ENV in launched
    for container in _ray_containers(rendered):
        env = _env(container)
        assert {k: env[k]["value"] for k in expected} == expected, container["name"]
    assert GatewayConfig().max_body_bytes == 4194304 and GatewayConfig().request_timeout_s == 600  # the chart's defaults


# -- Switches remove exactly their objects ------------------------------------------------------


@pytest.mark.parametrize("values, removed", [
    ({"networkPolicy": {"enabled": False}},
     {("NetworkPolicy", f"{FULLNAME}-ray"), ("NetworkPolicy", f"{FULLNAME}-ray-head"),
      ("NetworkPolicy", f"{FULLNAME}-redis")}),
    ({"redis": {"auth": {"enabled": False}}}, {("Secret", f"{FULLNAME}-redis")}),
    ({"redis": {"enabled": False}}, {("Deployment", f"{FULLNAME}-redis"), ("Service", f"{FULLNAME}-redis"),
                                     ("Secret", f"{FULLNAME}-redis"), ("NetworkPolicy", f"{FULLNAME}-redis")}),
    ({"ray": {"auth": {"mode": "disabled"}}}, set()),
])
def test_a_switch_removes_exactly_its_objects(render, values, removed):
    on, off = render(), render(values)
    assert set(on.objects) - set(off.objects) == removed and set(off.objects) <= set(on.objects)
    if values.get("networkPolicy"):  # nothing else changes
        assert {k: v for k, v in on.stable_objects.items() if k not in removed} == off.stable_objects


def test_disabling_redis_auth_leaves_no_password_anywhere(render):
    off = render({"redis": {"auth": {"enabled": False}}})
    [redis] = [spec for name, (_, spec) in _pods(off).items() if name.endswith("-redis")]
    assert "password" not in {v["name"] for v in redis["volumes"]}
    assert "requirepass" not in redis["containers"][0]["args"][0]
    assert all("PDSERVE_REDIS_PASSWORD" not in _env(c) for c in _ray_containers(off))


# -- checkov ------------------------------------------------------------------------------------

# Every check skipped on the chart's plain objects, with the reason. Nothing else is skipped.
CHECKOV_SKIPS = {
    "CKV_K8S_43": "Image digests: a digest is the registry mirror's, not the chart's; pin one with "
                  "redis.image.tag: '7.4-alpine@sha256:...' (image.tag likewise).",
    "CKV_K8S_15": "imagePullPolicy Always: the tag (or digest) is pinned, and Always makes every pod start "
                  "depend on the registry being up.",
    "CKV_K8S_40": "UID > 10000: the images' own users (Redis 999, Ray 1000) own the files the images ship; the "
                  "restricted profile asks for non-root, which they are.",
}
CHECKOV_VENV = REPO / ".venv-checkov" / "bin" / "checkov"


def _checkov() -> str | None:
    return str(CHECKOV_VENV) if CHECKOV_VENV.exists() else shutil.which("checkov")


@pytest.mark.skipif(_checkov() is None, reason="checkov not installed: .ci/run puts it in .venv-checkov (its pins "
                                               "conflict with Ray's, so it has its own virtual environment)")
def test_checkov_finds_nothing_on_the_plain_objects(render, tmp_path):
    everything = {"apiKeys": {"keys": ["sk-a"]}, "ingress": {"enabled": True},
                  "services": {"dashboard": {"enabled": True}},
                  "monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
                  "networkPolicy": {"egress": {"restrict": True, "kubernetesApiCidrs": ["10.96.0.1/32"]}}}
    for case, values in {"defaults": {}, "everything": everything}.items():
        rendered = render(values)
        plain = [obj for (kind, _), obj in rendered.objects.items() if kind != "RayService"]
        (tmp_path / f"{case}.yaml").write_text(yaml.safe_dump_all(plain))
    result = subprocess.run([_checkov(), "-d", str(tmp_path), "--framework", "kubernetes", "--output", "json",
                             "--skip-check", ",".join(CHECKOV_SKIPS), "--quiet", "--compact"],
                            capture_output=True, text=True, timeout=600)
    report = json.loads(result.stdout)
    failed = [(c["check_id"], c["resource"]) for c in report["results"]["failed_checks"]]
    assert failed == [], failed
    assert report["summary"]["passed"] > 50  # it read the objects
