"""A pod as the chart makes it, on this machine: the root filesystem read-only with tmpfs only at
the chart's emptyDir mounts, the chart's environment, Ray's token auth as KubeRay sets it, and the
chart's serveConfigV2 deployed through the dashboard as the KubeRay operator deploys it. pdserve
serves a completion there and `pdserve status` works with the token; without it the dashboard
answers 401 and `pdserve status` says what to do (issue #41, items 1 and 4)."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from pdserve.engine.checkpoint import default_model

SANDBOX = Path(__file__).with_name("pod_sandbox.sh")
CHART = Path(__file__).parents[2] / "deploy" / "helm" / "pdserve"
IMAGE_HOME = "/home/ray"  # the Ray image's home, where the chart mounts the caches

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="needs root and unshare (mount, PID and network namespaces)")


def _sources() -> list[Path]:
    """Where this pdserve and its tests come from (a checkout may live under /tmp)."""
    import pdserve.config

    return [Path(pdserve.config.__file__).resolve().parent, Path(__file__).resolve().parents[2]]


def test_a_chart_pod_serves_on_a_read_only_root_with_ray_token_auth():
    helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the dev extra)")
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render({"redis": {"enabled": False}, "grpc": {"enabled": False}}, name="pds", namespace="ci")
    rayservice = next(o for o in yaml.safe_load_all(manifests["pdserve/templates/rayservice.yaml"]) if o)
    [head] = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert head["securityContext"]["readOnlyRootFilesystem"] is True
    home = os.path.expanduser("~")
    writable = [m["mountPath"].replace(IMAGE_HOME, home, 1) for m in head["volumeMounts"] if m["name"] != "dshm"]
    for path in writable:  # mount points exist in the image; here they are made before the root turns read-only
        os.makedirs(path, exist_ok=True)
    default_model()  # baked into the image (deploy/docker/Dockerfile); made here while the root is writable
    serve_config = Path("/var/tmp") / f"pdserve-sandbox-{uuid.uuid4().hex}.yaml"  # outside the tmpfs /tmp
    serve_config.write_text(rayservice["spec"]["serveConfigV2"])
    env = {**os.environ, **{e["name"]: e["value"] for e in head["env"] if "value" in e},
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex,  # what KubeRay's authOptions sets
           "WRITABLE": " ".join(writable), "SERVE_CONFIG": str(serve_config),
           "KEEP": " ".join(str(p) for p in _sources() if any(p.is_relative_to(w) for w in map(Path, writable)))}
    env.pop("RAY_ADDRESS", None)
    try:
        result = subprocess.run(["unshare", "--mount", "--pid", "--net", "--fork", "--mount-proc", str(SANDBOX)],
                                env=env, capture_output=True, text=True, timeout=420)
    finally:
        serve_config.unlink()
    out = result.stdout + result.stderr
    if "sandbox: ready" not in out:
        pytest.skip(f"this machine cannot make the sandbox: {out[-500:]}")
    assert "ray: started" in out, out[-3000:]
    assert '"finish_reason":"length"' in out and '"completion_tokens":4' in out, out[-3000:]
    assert "status with token: rc=0" in out and "application pdserve: RUNNING" in out, out[-3000:]
    assert "dashboard without token: 401" in out, out[-3000:]
    assert "status without token: rc=1" in out and "RAY_AUTH_TOKEN: run `pdserve status` inside the head pod" in out
