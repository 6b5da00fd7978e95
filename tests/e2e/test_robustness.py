"""Bad input gets OpenAI-shaped errors, clients that leave free their KV on both pools, and the
server keeps serving: the failure paths of the whole app over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
import openai
import pytest
import requests

from tests.e2e.test_openai_api import LONG
from tests.harness.waiting import wait_until

LONG_PROMPT_WORDS = " ".join(["lighthouse"] * 500)  # far over max_model_len 384


def _bad_requests(model: str):
    ok = {"model": model, "prompt": "hello", "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return [
        ("malformed JSON", "/v1/completions", b'{"model": "x", "prompt": ', 400, None),
        ("not an object", "/v1/completions", b"[1, 2]", 400, None),
        ("prompt of wrong type", "/v1/completions", {**ok, "prompt": 42}, 400, "prompt"),
        ("max_tokens a string", "/v1/completions", {**ok, "max_tokens": "four"}, 400, "max_tokens"),
        ("negative max_tokens", "/v1/completions", {**ok, "max_tokens": -3}, 400, "max_tokens"),
        ("huge max_tokens", "/v1/completions", {**ok, "max_tokens": 10**9}, 400, "max_tokens"),
        ("temperature out of range", "/v1/completions", {**ok, "temperature": 7.5}, 400, "temperature"),
        ("top_p zero", "/v1/completions", {**ok, "top_p": 0}, 400, "top_p"),
        ("unknown model", "/v1/completions", {**ok, "model": "gpt-17"}, 404, None),
        ("prompt over the context", "/v1/completions", {**ok, "prompt": LONG_PROMPT_WORDS}, 400, "prompt"),
        ("token id outside the vocabulary", "/v1/completions", {**ok, "prompt": [1, 2, 10**7]}, 400, "prompt"),
        ("empty prompt list", "/v1/completions", {**ok, "prompt": []}, 400, "prompt"),
        ("stream_options without stream", "/v1/completions", {**ok, "stream_options": {"include_usage": True}},
         400, "stream_options"),
        ("empty messages", "/v1/chat/completions", {**chat, "messages": []}, 400, "messages"),
        ("message without role", "/v1/chat/completions", {**chat, "messages": [{"content": "x"}]}, 400, None),
        ("n too large", "/v1/chat/completions", {**chat, "n": 1000}, 400, "n"),
        ("invalid UTF-8", "/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
         400, None),
        ("oversized body", "/v1/completions", json.dumps({**ok, "prompt": "a" * 200_000}).encode(), 413, None),
    ]


@pytest.mark.parametrize("case", range(len(_bad_requests("m"))), ids=[c[0] for c in _bad_requests("m")])
def test_bad_requests_get_openai_errors(serve_apps, case):
    app = serve_apps["colo"]
    name, path, body, status, param = _bad_requests(app.model)[case]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = app.post(path, data=data, headers={"Content-Type": "application/json", "x-request-id": f"bad-{case}"})
    assert r.status_code == status, (name, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], (name, err)
    if param is not None:
        assert err["param"] == param, (name, err)
    assert r.headers["x-request-id"] == f"bad-{case}"


def test_server_keeps_serving_after_bad_requests_and_auth_is_checked(serve_apps):
    app = serve_apps["colo"]
    for _, path, body, _, _ in _bad_requests(app.model):
        app.post(path, data=body if isinstance(body, bytes) else json.dumps(body))
    r = app.client.completions.create(model=app.model, prompt="hello", max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")
    wrong = openai.OpenAI(base_url=app.client.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.NotFoundError):
        app.client.completions.create(model="nope", prompt="x", max_tokens=2)


def test_models_health_and_tokenizer_routes(app):
    assert [m.id for m in app.client.models.list().data] == [app.model]
    health = requests.get(f"{app.base}/health", timeout=30)
    assert health.status_code == 200 and all(health.json()["pools"].values())
    tok = app.post("/tokenize", json={"model": app.model, "prompt": LONG}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 384
    chat_tok = app.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tok["count"] > 2
    assert app.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == LONG
    info = requests.get(f"{app.base}/tokenizer_info", headers={"Authorization": f"Bearer {app.api_key}"},
                        timeout=30).json()
    assert info["eos_token"] and info["model_max_length"] == 384
    assert app.post("/detokenize", json={"tokens": [-1]}).status_code == 400


def test_clients_that_time_out_do_not_wedge_the_server(app):
    body = {"model": app.model, "prompt": LONG, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {app.api_key}"}

    async def impatient(session, i):
        try:
            async with session.post(f"{app.base}/v1/completions", json={**body, "stream": i % 2 == 0},
                                    headers=headers, timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                await r.read()
        except (asyncio.TimeoutError, aiohttp.ClientError):
            pass

    async def main():
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(impatient(session, i) for i in range(200)))

    asyncio.run(main())
    r = app.client.completions.create(model=app.model, prompt="hello", max_tokens=4, timeout=60)
    assert r.usage.completion_tokens >= 1
    stats = app.wait_for_idle(60)
    assert all(s["num_free_kv_blocks"] == s["num_kv_blocks"] and s.get("num_kv_leases", 0) == 0
               and s["num_unfinished_requests"] == 0 for s in stats.values()), stats


def test_disconnect_mid_stream_aborts_on_both_pools(app):
    """A client that leaves mid-stream has its request aborted on the engine, and in the
    disaggregated app the prefill pool's blocks and lease come back too: every KV block and lease
    is free again and no request is left unfinished.

    The tiny model writes the rest of its context within a second, about what a loaded machine can
    take to pass the disconnect through the proxy and the gateway; the engine would then count the
    request finished, not aborted. So the engine's replica is frozen (SIGSTOP) from the stream's
    first event, hundreds of steps before the request's end, until the gateway has dropped the
    sequence, which it does as it cancels the call: when the replica resumes, the cancel is already
    on its way and lands within a few of the steps the request still needs."""
    from ray import serve

    tok = app.post("/tokenize", json={"model": app.model, "prompt": LONG}).json()
    body = {"model": app.model, "prompt": LONG, "max_tokens": tok["max_model_len"] - tok["count"],
            "temperature": 0, "ignore_eos": True, "stream": True}
    engine = app.pools[-1]  # the pool the request decodes on
    before = {p: app.stats(p) for p in app.pools}
    gateway = serve.get_deployment_handle("Gateway", app.name)

    def num_pending_sequences() -> int:
        return gateway.stats.remote().result(timeout_s=30)["num_pending_sequences"]

    num_pending_before, pid = num_pending_sequences(), before[engine]["pid"]
    try:
        with requests.post(f"{app.base}/v1/completions", json=body, stream=True, timeout=60,
                           headers={"Authorization": f"Bearer {app.api_key}"}) as r:
            lines = r.iter_lines(chunk_size=None)  # each line as it comes (kept: closing it drops the connection)
            first = next(line for line in lines if line)
            os.kill(pid, signal.SIGSTOP)
            assert first.startswith(b"data: {"), first
            assert num_pending_sequences() == num_pending_before + 1, "the request ended before its engine froze"
        wait_until(lambda: num_pending_sequences() == num_pending_before, 30,
                   "the gateway dropping the sequence of the client gone")
    finally:
        os.kill(pid, signal.SIGCONT)
    stats = app.wait_for_idle(30)
    assert all(s["num_free_kv_blocks"] == s["num_kv_blocks"] and s.get("num_kv_leases", 0) == 0
               and s["num_unfinished_requests"] == 0 for s in stats.values()), stats
    assert stats[engine]["num_aborted_requests"] == before[engine]["num_aborted_requests"] + 1, stats
