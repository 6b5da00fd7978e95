"""One disaggregated and one colocated pdserve app on a shared Ray Serve instance, reached over
HTTP on 127.0.0.1 with the official `openai` client.

disagg (/disagg): Prefill + Decode, every prompt prefilled remotely (its latency target is one the
prefill pool always meets). colo (/colo): one Unified replica, behind two tenants' API keys.

netns_lab: the network-namespace lab with Ray and Redis on it (tests/harness/lab_app.py), which the
test_netns_* modules deploy their apps on in turn.
"""

from __future__ import annotations

import time

import openai
import requests
import pytest

from pdserve.config import ServeConfig

from tests.harness import netns
from tests.harness.fixed_costs import REMOTE_PREFILL_SLO
from tests.harness.lab_app import LabCluster
from ..conftest import free_port

ENGINE = {"num_threads": 1, "num_kv_blocks": 192, "block_size": 8, "max_model_len": 384, "max_num_seqs": 32,
          "max_num_batched_tokens": 512}
POOL = {"ray_actor_options": {"num_cpus": 1}, "max_queued_requests": 300}
API_KEY = "sk-pdserve-test"
OTHER_KEY = "sk-pdserve-other-tenant"  # a second tenant of the colo app (prefix-cache isolation)


def wait_until_serving(base: str, timeout_s: float, what: str, poll_s: float = 0.5) -> None:
    """Poll a small completion at `base` until it succeeds (after a replica was killed, Serve starts
    a replacement); fail with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if requests.post(f"{base}/v1/completions", json={"prompt": "again", "max_tokens": 2},
                             timeout=30).status_code == 200:
                return
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, what
        time.sleep(poll_s)


class App:
    def __init__(self, name: str, base: str, model: str, api_key: str, pools: list[str]):
        self.name, self.base, self.model, self.api_key, self.pools = name, base, model, api_key, pools
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, timeout=120)
        self.aclient = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, timeout=120)

    def stats(self, pool: str) -> dict:
        from ray import serve

        return serve.get_deployment_handle(pool, self.name).stats.remote().result(timeout_s=30)

    def wait_for_idle(self, timeout_s: float = 40.0) -> dict[str, dict]:
        """Every pool back to all KV blocks free and no leases (returns the last stats)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = {p: self.stats(p) for p in self.pools}
            if all(s["num_free_kv_blocks"] == s["num_kv_blocks"] and not s.get("num_kv_leases")
                   and s["num_unfinished_requests"] == 0 for s in stats.values()):
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.2)

    def post(self, path: str, **kwargs) -> requests.Response:
        headers = {"Authorization": f"Bearer {self.api_key}", **kwargs.pop("headers", {})}
        return requests.post(f"{self.base}{path}", headers=headers, timeout=60, **kwargs)


@pytest.fixture(scope="session")
def serve_apps(ray_session, tiny_llama):
    from ray import serve

    from pdserve.app import build, grpc_options

    port, grpc_port = free_port(), free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, grpc_options=grpc_options(grpc_port))
    disagg = ServeConfig(name="disagg", model=tiny_llama, engine=ENGINE, prefill=POOL, decode=POOL,
                         slo=REMOTE_PREFILL_SLO,
                         transfer={"host": "127.0.0.1", "lease_s": 20})
    colo = ServeConfig(name="colo", model=tiny_llama, engine=ENGINE, mode="colocated", decode=POOL,
                       gateway={"api_keys": [API_KEY, OTHER_KEY], "max_body_bytes": 65536})
    serve.run_many([serve.RunTarget(build(disagg), name="disagg", route_prefix="/disagg"),
                    serve.RunTarget(build(colo), name="colo", route_prefix="/colo")])
    base = f"http://127.0.0.1:{port}"
    apps = {"disagg": App("disagg", f"{base}/disagg", "tiny-llama", "unused", ["Prefill", "Decode"]),
            "colo": App("colo", f"{base}/colo", "tiny-llama", API_KEY, ["Unified"]), "grpc_port": grpc_port,
            "base": base}
    yield apps
    serve.delete("disagg")
    serve.delete("colo")


@pytest.fixture(params=["disagg", "colo"])
def app(request, serve_apps) -> App:
    return serve_apps[request.param]


@pytest.fixture(scope="session")
def netns_lab():
    """One lab, Ray cluster and Redis for every module that deploys an app on them (a module's app
    goes with its module: `LabCluster.app`): building them takes 12 s on an idle 2-core machine."""
    if (why := netns.unavailable()) is not None:
        pytest.skip(f"netns lab: {why}")
    lab = LabCluster()
    yield lab
    lab.close()


@pytest.hookimpl(trylast=True)  # after the module's own fixtures: its app is gone
def pytest_runtest_teardown(item, nextitem):
    """Close the netns lab after the last test that uses it, not at the session's end: its idle
    cluster (three nodes and Serve) takes 0.15 of a core from the rest of the session's tests."""
    lab = (item.funcargs or {}).get("netns_lab")
    items = item.session.items
    if lab is not None and not any("netns_lab" in later.fixturenames for later in items[items.index(item) + 1:]):
        lab.close()
