"""Failures a client sees over HTTP: a full queue answers 503 with Retry-After (and the server
keeps serving); a decode replica killed mid-stream, with migration off, ends that stream with an
in-stream error and [DONE] (no hang), whether its outputs came on the call or over the replica's
output connection, after which Ray Serve's replacement serves again; with migration on (the
default) and a second replica, the stream goes on there and ends as an uninterrupted run, a
JSON-schema-constrained one too (the grammar's state is rebuilt there from the tokens sent)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from pdserve.config import ServeConfig

from .conftest import ENGINE, wait_until_serving

LONG = {"max_tokens": 370, "ignore_eos": True}  # short prompts and nearly the whole context (384): long requests


def deploy(name: str, tiny_llama: str, pool: dict, gateway: dict | None = None, metrics_period_s: float = 0.5,
           engine: dict | None = None):
    from ray import serve

    from pdserve.app import build

    cfg = ServeConfig(name=name, model=tiny_llama, engine={**ENGINE, **(engine or {})}, mode="colocated",
                      decode={"ray_actor_options": {"num_cpus": 0.2}, "health_check_period_s": 1.0, **pool},
                      gateway=gateway or {}, telemetry={"metrics_period_s": metrics_period_s})
    serve.run(build(cfg), name=name, route_prefix=f"/{name}")


def test_a_full_queue_answers_503_with_retry_after(serve_apps, tiny_llama):
    from ray import serve

    name = "tight"
    deploy(name, tiny_llama, {"max_ongoing_requests": 1, "max_queued_requests": 1})
    url = f"{serve_apps['base']}/{name}/v1/completions"
    try:
        def post(i):
            return requests.post(url, json={"prompt": f"queue {i}", **LONG}, timeout=120)

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(post, range(8)))
        codes = sorted(r.status_code for r in answers)
        unexpected = [r.text[-300:] for r in answers if r.status_code not in (200, 503)]
        assert 200 in codes and 503 in codes and not unexpected, (codes, unexpected[:2])
        rejected = next(r for r in answers if r.status_code == 503)
        assert rejected.headers["Retry-After"] == "1"
        assert rejected.json()["error"]["type"] == "service_unavailable"
        assert requests.post(url, json={"prompt": "after", "max_tokens": 2}, timeout=60).status_code == 200
    finally:
        serve.delete(name)


@pytest.mark.parametrize("connected", [False, True], ids=["outputs-on-the-call", "outputs-over-the-connection"])
def test_a_replica_killed_mid_stream_ends_the_stream_with_an_error(serve_apps, tiny_llama, connected):
    import ray
    from ray import serve

    from pdserve.telemetry.status import read_replica_lines

    name = "fragile-connected" if connected else "fragile"
    deploy(name, tiny_llama, {}, {"migration_limit": 0})
    base = f"{serve_apps['base']}/{name}"
    try:
        deadline = time.monotonic() + 30
        while not read_replica_lines(name):  # the replica's first status line names it
            assert time.monotonic() < deadline
            time.sleep(0.2)
        [line] = read_replica_lines(name)
        victim = ray.get_actor(f"SERVE_REPLICA::{name}#Unified#{line['replica']}", namespace="serve")
        if connected:  # a first request makes the gateway connect to the replica for outputs
            assert requests.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                 timeout=60).status_code == 200
            handle = serve.get_deployment_handle("Unified", name)
            while handle.stats.remote().result(timeout_s=30)["num_output_connections"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        events = []
        with requests.post(f"{base}/v1/completions", json={"prompt": "doomed", "stream": True, **LONG},
                           stream=True, timeout=120) as r:
            assert r.status_code == 200
            for raw in r.iter_lines():
                if not raw:
                    continue
                data = raw.decode()[len("data: "):]
                events.append(data)
                if len(events) == 3:
                    ray.kill(victim)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable", error
        tokens = sum(1 for e in events[:-2] if "choices" in json.loads(e))
        assert 3 <= tokens < LONG["max_tokens"]
        if connected:
            return  # the replacement is checked once, below
        # Serve starts a replacement; then requests succeed again.
        wait_until_serving(base, 90, "no replica served after the kill", poll_s=1)
    finally:
        serve.delete(name)


def _stream(url: str, body: dict, on_event=None) -> list[dict]:
    """The SSE stream's events (JSON), [DONE] checked; `on_event(i)` after the i-th event."""
    events = []
    with requests.post(url, json={**body, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        for raw in r.iter_lines():
            if not raw:
                continue
            data = raw.decode()[len("data: "):]
            if data == "[DONE]":
                return events
            events.append(json.loads(data))
            if on_event is not None:
                on_event(len(events))
    raise AssertionError("the stream ended without [DONE]")


def _killer(name: str, killed: list[dict], at_event: int = 3):
    """An `on_event` for `_stream`: at its `at_event`-th event, kill (SIGKILL, through Ray) the
    replica of app `name` whose status line shows a running sequence; its line goes to `killed`."""
    import ray

    from pdserve.telemetry.status import read_replica_lines

    def kill_the_serving_replica(num_events: int) -> None:
        if num_events != at_event:
            return
        until = time.monotonic() + 10
        while not killed and time.monotonic() < until:  # status lines come every 0.1 s
            serving = [line for line in read_replica_lines(name) if line["num_running"]]
            if serving:
                killed.append(serving[0])
                ray.kill(ray.get_actor(f"SERVE_REPLICA::{name}#Unified#{serving[0]['replica']}", namespace="serve"))
            time.sleep(0.02)

    return kill_the_serving_replica


def _wait_for_replicas(name: str, num_replicas: int, timeout_s: float = 90) -> None:
    """Until `num_replicas` live replicas of app `name` publish status lines (after a kill: its
    replacement too)."""
    from pdserve.telemetry.status import read_replica_lines

    deadline = time.monotonic() + timeout_s
    while len(read_replica_lines(name)) < num_replicas:
        assert time.monotonic() < deadline, f"{num_replicas} replicas of {name} did not start"
        time.sleep(0.2)


def test_a_replica_killed_mid_stream_hands_the_stream_to_the_other(serve_apps, tiny_llama):
    """Two replicas; the one serving a greedy stream is killed mid-way: the stream goes on on the
    other, resumed, and ends as the uninterrupted run does (same text, one finish, same usage)."""
    from ray import serve

    from pdserve.telemetry.status import read_replica_lines

    name = "migrating"
    # A longer context than the other apps': a stream of 1000 tokens lasts about a second here, so
    # the replica serving it shows in its status line (every 0.1 s) well before it ends.
    deploy(name, tiny_llama, {"num_replicas": 2}, metrics_period_s=0.1,
           engine={"max_model_len": 1024, "num_kv_blocks": 160})
    url = f"{serve_apps['base']}/{name}/v1/completions"
    body = {"prompt": "the quick brown fox", "temperature": 0, "max_tokens": 1000, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    try:
        _wait_for_replicas(name, 2)
        whole = _stream(url, body)
        killed = []
        moved = _stream(url, body, _killer(name, killed))
        assert killed, "no replica reported the stream running"

        def text(events):
            return "".join(c["text"] for e in events for c in e.get("choices", []))

        finishes = [c["finish_reason"] for e in moved for c in e.get("choices", []) if c["finish_reason"]]
        assert not any("error" in e for e in moved), moved[-1]
        assert text(moved) == text(whole) and finishes == ["length"]
        assert moved[-1]["usage"]["completion_tokens"] == whole[-1]["usage"]["completion_tokens"] == 1000
        # One migration: the surviving replica took one resumed sequence over.
        deadline = time.monotonic() + 10
        while True:
            survivors = [line for line in read_replica_lines(name) if line["replica"] != killed[0]["replica"]]
            if sum(line.get("num_resumed_requests") or 0 for line in survivors) == 1:
                break
            assert time.monotonic() < deadline, survivors
            time.sleep(0.2)
    finally:
        serve.delete(name)


# 72 strings of 8-12 characters: about 800 tokens of the tiny model, greedy or sampled, so the
# stream lasts long enough to be killed mid-way, and ends with stop well within max_tokens.
NOTES = {"type": "object", "properties": {"notes": {"type": "array", "minItems": 72, "maxItems": 72,
                                                    "items": {"type": "string", "minLength": 8, "maxLength": 12}}},
         "required": ["notes"], "additionalProperties": False}


def test_a_constrained_stream_killed_mid_way_goes_on_valid_and_unchanged(serve_apps, tiny_llama):
    """Issue #45: a JSON-schema-constrained chat stream, greedy and then seeded at temperature 1,
    whose replica is killed mid-way: the other replica rebuilds the grammar's state from the
    tokens streamed so far, so the client sees one stream with one finish, its JSON validates,
    and it is the uninterrupted run's token for token; the gateway counts the migration."""
    import jsonschema
    from ray import serve

    from .test_telemetry import scrape, total

    name, model = "guided-migrating", "guided-migrating-llama"
    deploy(name, tiny_llama, {"num_replicas": 2}, {"served_model_name": model}, metrics_period_s=0.1,
           engine={"max_model_len": 1100, "num_kv_blocks": 160})  # the chat prompt and max_tokens
    url = f"{serve_apps['base']}/{name}/v1/chat/completions"
    request = {"messages": [{"role": "user", "content": "Reply with JSON only."}], "max_tokens": 1000,
               "response_format": {"type": "json_schema", "json_schema": {"name": "notes", "schema": NOTES,
                                                                          "strict": True}},
               "logprobs": True, "stream_options": {"include_usage": True}}

    def text(events):
        return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])

    def tokens(events):
        return [t["token"] for e in events for c in e["choices"] if c.get("logprobs")
                for t in c["logprobs"]["content"]]

    try:
        for num_migrations, sampling in enumerate(({"temperature": 0}, {"temperature": 1.0, "seed": 7}), 1):
            body = {**request, **sampling}
            _wait_for_replicas(name, 2)  # after the first kill: its replacement too
            whole = _stream(url, body)
            killed = []
            moved = _stream(url, body, _killer(name, killed))
            assert killed, "no replica reported the stream running"
            assert not any("error" in e for e in moved), moved[-1]
            finishes = [c["finish_reason"] for e in moved for c in e["choices"] if c["finish_reason"]]
            assert finishes == ["stop"], (sampling, finishes)
            jsonschema.validate(json.loads(text(moved)), NOTES)
            assert text(moved) == text(whole)
            assert tokens(moved) == tokens(whole) and len(tokens(whole)) == whole[-1]["usage"]["completion_tokens"]
            for key in ("prompt_tokens", "completion_tokens"):  # cached_tokens: the second run may hit the cache
                assert moved[-1]["usage"][key] == whole[-1]["usage"][key]
            deadline = time.monotonic() + 20  # Ray exports the gateway's counter every half second
            while total(scrape(), "ray_pdserve_stream_migrations_total", model=model) < num_migrations:
                assert time.monotonic() < deadline, f"the gateway counted no migration for {sampling}"
                time.sleep(0.5)
    finally:
        serve.delete(name)
