"""Hostile and malformed requests against the OpenAI routes, with scripted pools behind them:
each is an OpenAI-shaped 4xx naming its `param` (or a 200 where the request is servable), decided
before any sequence reaches the pools, and nothing of the server's insides in the answer."""

import asyncio
import json

import pytest
from starlette.requests import Request

from pdserve.config import GatewayConfig
from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.openai_service import OpenAIService
from tests.fakes.gateway_client import ScriptedClient, call
from tests.fakes.hostile_requests import chat, completion, hostile_requests

CORPUS = hostile_requests("tiny")

KEY = "sk-test"


@pytest.fixture(scope="module")
def service(tiny_llama):
    service = OpenAIService(ScriptedClient([(5, "a"), (6, "b")]), Tokenizer(tiny_llama), "tiny", 256,
                            GatewayConfig(api_keys=[KEY]))
    yield service
    service.close()


def post(service, path, body, key=KEY, headers=None):
    route = {"/v1/completions": service.completions, "/v1/chat/completions": service.chat_completions,
             "/tokenize": service.tokenize, "/detokenize": service.detokenize}[path]
    auth = {"authorization": f"Bearer {key}"} if key else {}
    before = len(service.client.requests)
    status, raw = call(route, path, body, {**auth, **(headers or {})})
    sent = len(service.client.requests) - before
    return status, json.loads(raw) if raw.startswith(b"{") else raw, sent


@pytest.mark.parametrize("name, path, body, status, param", CORPUS, ids=[c[0] for c in CORPUS])
def test_bad_requests_are_4xx_before_any_work(service, name, path, body, status, param):
    got, answer, sent = post(service, path, body)
    assert got == status, answer
    assert sent == 0
    err = answer["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert "Traceback" not in err["message"] and "Error:" not in err["message"]


def test_the_largest_allowed_values_are_served(service):
    top = completion(top_k=2**31 - 1, seed=2**63 - 1, n=16, stop=["x" * 512] * 16, stop_token_ids=list(range(64)),
                     logit_bias={str(i): 100 for i in range(300)}, prompt=["hi"] * 16)
    got, answer, sent = post(service, "/v1/completions", top)
    assert got == 200, answer
    assert sent == 256 and len(answer["choices"]) == 256
    seeds = {r.params.seed for r in service.client.requests[-256:]}
    assert -2**63 in seeds and 2**63 - 1 in seeds  # choice i's seed wraps within 64 bits
    few = OpenAIService(service.client, service.tokenizer, "tiny", 256, GatewayConfig(max_chat_messages=4))
    got, _, sent = post(few, "/v1/chat/completions", chat(messages=[{"role": "user", "content": "hi"}] * 4), key=None)
    assert got == 200 and sent == 1
    got, _, _ = post(service, "/v1/completions", completion(prompt="x" * service.bounds.max_prompt_chars,
                                                            max_tokens=1))
    assert got == 400  # within the character bound, so tokenized, and then too long in tokens


def test_every_sequence_carries_the_deadline(service):
    got, _, _ = post(service, "/v1/completions", completion(n=2))
    reqs = service.client.requests[-2:]
    assert got == 200 and reqs[0].deadline_s == reqs[1].deadline_s
    assert reqs[0].deadline_s - service.config.request_timeout_s == pytest.approx(__import__("time").time(), abs=5)


def test_keys_guard_every_route_but_health(service):
    for path, body in (("/v1/completions", completion()), ("/tokenize", {"prompt": "x"})):
        for key in (None, "wrong", ""):
            got, answer, sent = post(service, path, body, key=key)
            assert got == 401 and sent == 0 and answer["error"]["code"] == "invalid_api_key"
    for route in (service.models, service.tokenizer_info):
        assert call(route, "/", method="GET")[0] == 401
        assert call(route, "/", method="GET", headers={"authorization": f"bearer {KEY}"})[0] == 200


def test_health_names_pools_not_errors(tiny_llama):
    class Broken(ScriptedClient):
        async def health(self):
            raise RuntimeError("secret internals at 10.0.0.7")

    service = OpenAIService(Broken([]), Tokenizer(tiny_llama), "tiny", 256, GatewayConfig())
    response = asyncio.run(service.health())
    assert response.status_code == 503 and b"secret" not in response.body


def test_a_hostile_request_id_is_not_kept(service):
    got, answer, _ = post(service, "/v1/completions", completion(), headers={"x-request-id": "a\nb" + "x" * 300})
    assert got == 200 and "\n" not in answer["id"] and len(answer["id"]) < 64


def test_a_body_that_never_arrives_times_out(tiny_llama):
    service = OpenAIService(ScriptedClient([]), Tokenizer(tiny_llama), "tiny", 256,
                            GatewayConfig(body_read_timeout_s=0.2))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "asgi": {"spec_version": "2.4"}}

    async def run():
        async def receive():  # a slow sender: one byte, then nothing
            if not hasattr(receive, "sent"):
                receive.sent = True
                return {"type": "http.request", "body": b"{", "more_body": True}
            await asyncio.sleep(3600)

        return await service.completions(Request(scope, receive))

    response = asyncio.run(run())
    assert response.status_code == 408 and json.loads(response.body)["error"]["code"] == "request_timeout"


def test_cache_salts_follow_the_key_under_per_key_isolation(tiny_llama):
    tok = Tokenizer(tiny_llama)
    keyed = OpenAIService(ScriptedClient([(5, "a")]), tok, "tiny", 256, GatewayConfig(api_keys=["k1", "k2"]))
    salts = {}
    for key, asked in (("k1", None), ("k2", None), ("k1", "mine"), ("k2", "mine")):
        extra = {} if asked is None else {"cache_salt": asked}
        got, _, sent = post(keyed, "/v1/completions", completion(**extra), key=key)
        assert got == 200 and sent == 1
        salts[key, asked] = keyed.client.requests[-1].params.cache_salt
    assert len(set(salts.values())) == 4  # per key; a salt a client names stays inside its key's
    assert all("k1" not in s and "k2" not in s for s in salts.values())  # a hash of the key, not the key
    shared = OpenAIService(ScriptedClient([(5, "a")]), tok, "tiny", 256,
                           GatewayConfig(api_keys=["k1"], cache_isolation="shared"))
    post(shared, "/v1/completions", completion(), key="k1")
    post(shared, "/v1/completions", completion(cache_salt="mine"), key="k1")
    assert [r.params.cache_salt for r in shared.client.requests] == [None, "mine"]
    got, answer, _ = post(shared, "/v1/completions", completion(cache_salt="s" * 257), key="k1")
    assert got == 400 and answer["error"]["param"] == "cache_salt"
