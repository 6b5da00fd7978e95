"""Operating a running app: its metrics in Ray's Prometheus export, one trace per request across
processes (collected by a test OTLP/HTTP collector), `pdserve status`, and /health with a replica
whose engine loop died (reported, then replaced by Ray Serve)."""

from __future__ import annotations

import gzip
import http.server
import subprocess
import threading
import time
import urllib.request
import uuid
import zlib
from collections import defaultdict

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from pdserve.config import ServeConfig

from tests.harness.fixed_costs import REMOTE_PREFILL_SLO
from .conftest import ENGINE, free_port

APP = "telem"
MODEL = "telem-llama"  # this app's `model` label: other apps in the session serve tiny-llama
NO_EOS = {"ignore_eos": True}  # every request decodes past its first token, so each has a KV pull
POOL = {"ray_actor_options": {"num_cpus": 0.2}, "max_queued_requests": 300}


class OTLPCollector:
    """An OTLP/HTTP traces endpoint on loopback that keeps every span it is sent."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans: list[dict] = []
        lock, spans = threading.Lock(), self.spans

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the stdlib's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                encoding = self.headers.get("Content-Encoding")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                export = ExportTraceServiceRequest.FromString(body)
                with lock:
                    for rs in export.resource_spans:
                        resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                spans.append({"name": s.name, "trace_id": s.trace_id.hex(),
                                              "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                              "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                                              "component": resource.get("pdserve.component"),
                                              "attributes": {a.key: a.value for a in s.attributes}})
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> list[dict]:
        return sorted((s for s in list(self.spans) if s["trace_id"] == trace_id), key=lambda s: s["start"])

    def close(self):
        self.server.shutdown()


@pytest.fixture(scope="module")
def telem(serve_apps, tiny_llama):
    """A disaggregated app where every prompt is prefilled remotely, tracing to a test collector."""
    from ray import serve

    from pdserve.app import build

    collector = OTLPCollector()
    cfg = ServeConfig(name=APP, model=tiny_llama, engine=ENGINE, prefill=POOL, decode=POOL,
                      slo=REMOTE_PREFILL_SLO, transfer={"host": "127.0.0.1"},
                      gateway={"served_model_name": MODEL},
                      telemetry={"traces": "otlp", "otlp_endpoint": collector.url, "export_delay_ms": 100,
                                 "metrics_period_s": 0.5})
    serve.run(build(cfg), name=APP, route_prefix=f"/{APP}")
    base = f"{serve_apps['base']}/{APP}"
    try:
        yield base, collector
    finally:
        serve.delete(APP)
        collector.close()


def scrape() -> dict[str, list]:
    """Ray's Prometheus export: sample name -> [(labels, value)] of pdserve's series in app `telem`."""
    import ray

    port = ray.nodes()[0]["MetricsExportPort"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_pdserve_"):
                samples[s.name].append((s.labels, s.value))
    return samples


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def replica_stats(pool: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(pool, APP).stats.remote().result(timeout_s=30)


def test_metrics_count_the_traffic_sent(telem):
    base, _ = telem
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    prompt_tokens = completion_tokens = 0
    for i in range(3):
        r = client.completions.create(model=MODEL, prompt=f"metrics {i} " * 6, max_tokens=6, temperature=0,
                                      extra_body=NO_EOS)
        prompt_tokens += r.usage.prompt_tokens
        completion_tokens += r.usage.completion_tokens
    for i in range(2):
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"stream {i}"}], max_tokens=5, stream=True,
            stream_options={"include_usage": True}, extra_body=NO_EOS))
        prompt_tokens += chunks[-1].usage.prompt_tokens
        completion_tokens += chunks[-1].usage.completion_tokens
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="too long", max_tokens=10_000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)

    decode, prefill = replica_stats("Decode"), replica_stats("Prefill")
    assert decode["num_remote_prefills"] == 5 and decode["num_pulled_bytes"] > 0
    # One host: every pull copied the blocks out of the prefill replica's cache in shared memory,
    # its lease checked on the prefill replica's lease board (the tcp backend's local read).
    assert decode["num_shared_memory_pulls"] == decode["num_board_reads"] == 5
    # Placement read the prefill pool's queue from the decode replica's router for that pool: empty now.
    assert decode["placement_prefill_queued_tokens"] == 0
    model = {"model": MODEL}
    expected = {  # series -> (labels, value), exact
        "ray_pdserve_requests_total": [({"outcome": "ok"}, 5), ({"outcome": "invalid"}, 2)],
        "ray_pdserve_prompt_tokens_total": [({}, prompt_tokens)],
        "ray_pdserve_generation_tokens_total": [({}, completion_tokens)],
        "ray_pdserve_time_to_first_token_seconds_count": [({}, 5)],
        "ray_pdserve_e2e_request_latency_seconds_count": [({}, 5)],
        "ray_pdserve_inter_token_latency_seconds_count": [({}, completion_tokens - 5)],
        "ray_pdserve_prefix_cache_query_tokens_total": [({"pool": "prefill"}, prefill["num_prefix_query_tokens"])],
        "ray_pdserve_kv_transfer_bytes_total": [({"pool": "decode"}, decode["num_pulled_bytes"])],
        "ray_pdserve_kv_transfer_seconds_count": [({"pool": "decode"}, 5)],
        "ray_pdserve_router_decisions_total": [({"pool": "decode", "decision": "headroom"}, 5),
                                               ({"pool": "prefill"}, 5)],
    }
    gauges = ["ray_pdserve_waiting_requests", "ray_pdserve_waiting_prompt_tokens", "ray_pdserve_running_sequences",
              "ray_pdserve_kv_cache_usage", "ray_pdserve_kv_leases", "ray_pdserve_placement_prefill_queued_tokens"]
    deadline = time.monotonic() + 60
    while True:  # replicas publish every 0.5 s and Ray exports every 0.5 s
        samples = scrape()
        got = {name: [total(samples, name, **model, **labels) for labels, _ in want]
               for name, want in expected.items()}
        want = {name: [v for _, v in w] for name, w in expected.items()}
        if got == want and all(g in samples for g in gauges):
            break
        assert time.monotonic() < deadline, f"metrics never matched the traffic:\n{got}\n{want}\n{sorted(samples)}"
        time.sleep(0.5)
    prefill_hits = total(samples, "ray_pdserve_prefix_cache_hit_tokens_total", pool="prefill", **model)
    assert prefill_hits == prefill["num_prefix_hit_tokens"]
    # Gauges are labelled by pool and replica; idle now, so nothing waits.
    assert {lab["pool"] for lab, _ in samples["ray_pdserve_kv_cache_usage"] if lab["model"] == MODEL} >= {
        "prefill", "decode"}
    assert total(samples, "ray_pdserve_waiting_requests", **model) == 0


def test_one_trace_per_request_across_processes(telem):
    base, collector = telem
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    r = requests.post(f"{base}/v1/completions", timeout=60,
                      headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
                      json={"model": MODEL, "prompt": "trace me " * 5, "max_tokens": 4, **NO_EOS})
    assert r.status_code == 200, r.text
    wanted = ["pdserve.gateway", "pdserve.prefill", "pdserve.kv_transfer", "pdserve.decode"]
    deadline = time.monotonic() + 30
    while not set(wanted) <= {s["name"] for s in collector.trace(trace_id)}:
        assert time.monotonic() < deadline, f"spans missing: {[s['name'] for s in collector.trace(trace_id)]}"
        time.sleep(0.2)
    # pdserve's spans (Ray Serve's FastAPI instrumentation adds its own under the client's span too).
    spans = [s for s in collector.trace(trace_id) if s["name"].startswith("pdserve.")]
    names = [s["name"] for s in spans if s["name"] in wanted]
    assert names == wanted  # by start time
    by_name = {s["name"]: s for s in spans}
    gateway = by_name["pdserve.gateway"]
    assert gateway["parent"] == parent_id  # the client's traceparent is honoured
    assert {s["component"] for s in spans} >= {"gateway", "prefill", "decode"}  # three processes
    routes = [s for s in spans if s["name"] == "pdserve.route"]
    assert {s["attributes"]["pool"].string_value for s in routes} == {"decode", "prefill"}
    for s in spans:
        assert s["end"] >= s["start"]
        if s is not gateway:
            assert s["parent"] == gateway["span_id"]


def test_pdserve_status_shows_every_replica(telem):
    from pdserve.telemetry.status import collect_status, format_status

    status = collect_status(APP)
    deployments = status["applications"][APP]["deployments"]
    assert set(deployments) == {"Gateway", "Prefill", "Decode"}
    for pool in ("Prefill", "Decode"):
        [replica] = deployments[pool]["replicas"]
        assert replica["healthy"] and replica["node_ip"] and 0 <= replica["kv_usage"] <= 1
    table = format_status(status)
    assert f"application {APP}: RUNNING" in table and "Prefill: HEALTHY (1 running)" in table
    # The command itself, as a second driver on this cluster.
    import ray

    out = subprocess.run(["pdserve", "status", "--app", APP, "--address", ray.get_runtime_context().gcs_address],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Decode: HEALTHY (1 running)" in out.stdout and "kv used" in out.stdout


def brittle_app(cfg: ServeConfig):
    """The colocated app, its Unified replicas able to break their own engine loop on request
    (a local class: Ray pickles it by value into the replica)."""
    from ray import serve

    from pdserve.app import PREFIX_AWARE_ROUTER, _pool_options, resolve_model
    from pdserve.decode.deployment import Decode
    from pdserve.gateway.deployment import Gateway

    class BrittleUnified(Decode.func_or_class):
        def break_engine_loop(self):
            def fail():
                raise RuntimeError("simulated engine failure")

            self.server.engine.engine.step = fail

    cfg = resolve_model(cfg)
    args = cfg.model_dump(mode="json")
    unified = serve.deployment(BrittleUnified).options(**_pool_options(cfg, cfg.decode, "Unified",
                                                                       PREFIX_AWARE_ROUTER)).bind(args)
    return Gateway.bind(args, unified, None)


def test_dead_engine_loop_is_reported_and_the_replica_replaced(serve_apps, tiny_llama):
    """Break one replica's engine loop: /health turns 503 naming the pool, Serve's health check
    fails, and a new replica serves again."""
    from ray import serve

    name = "brittle"
    cfg = ServeConfig(name=name, model=tiny_llama, engine=ENGINE, mode="colocated",
                      decode={**POOL, "health_check_period_s": 1.0})
    serve.run(brittle_app(cfg), name=name, route_prefix=f"/{name}")
    base = f"{serve_apps['base']}/{name}"
    try:
        handle = serve.get_deployment_handle("Unified", name)
        before = handle.stats.remote().result(timeout_s=30)["pid"]
        assert requests.get(f"{base}/health", timeout=30).status_code == 200
        handle.break_engine_loop.remote().result(timeout_s=30)
        body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 2}
        assert requests.post(f"{base}/v1/completions", json=body, timeout=60).status_code >= 500
        health = requests.get(f"{base}/health", timeout=30)
        replaced = False
        if health.status_code == 503:  # reported before Serve swapped it out
            assert health.json()["pools"] == {"unified": False}
        deadline = time.monotonic() + 90
        while not replaced:
            assert time.monotonic() < deadline, "the replica with a dead engine loop was not replaced"
            time.sleep(1)
            try:
                replaced = handle.stats.remote().result(timeout_s=10)["pid"] != before
            except Exception:  # noqa: BLE001 - the dying replica's error
                pass
        assert requests.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        assert requests.get(f"{base}/health", timeout=30).status_code == 200
    finally:
        serve.delete(name)
