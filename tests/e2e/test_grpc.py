"""The `pdserve.v1.Generation` gRPC API through Ray Serve's gRPC proxy: unary and streamed
outputs equal the HTTP API's, bad input is INVALID_ARGUMENT, the API key holds, and a client
that leaves a stream frees its KV on both pools."""

from __future__ import annotations

import grpc
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway import pdserve_pb2 as pb
from pdserve.gateway.pdserve_pb2_grpc import GenerationStub
from tests.e2e.conftest import API_KEY
from tests.e2e.test_openai_api import LONG, SHORT

DISAGG = (("application", "disagg"),)
COLO = (("application", "colo"), ("authorization", f"Bearer {API_KEY}"))


@pytest.fixture(scope="module")
def stub(serve_apps) -> GenerationStub:
    port = serve_apps.get("grpc_port")
    if port is None:
        pytest.skip("serve_apps started Ray Serve without gRPC (no serve_apps['grpc_port'])")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=60)
        except grpc.FutureTimeoutError:
            pytest.fail(f"Ray Serve's gRPC proxy is not listening on port {port}")
        yield GenerationStub(channel)


def _greedy(prompt, max_tokens=8, **kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(**{"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                 **kwargs})


def _http_text(app, prompt: str, max_tokens: int = 8):
    r = app.client.completions.create(model=app.model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
    return r.choices[0].text, r.usage.prompt_tokens


def test_unary_generate_matches_http_completions(stub, serve_apps):
    for prompt in (SHORT, LONG):
        r = stub.Generate(_greedy(prompt, request_id="grpc-1"), metadata=DISAGG, timeout=120)
        text, prompt_tokens = _http_text(serve_apps["disagg"], prompt)
        assert r.text == text
        assert r.finish_reason == "length" and r.completion_tokens == len(r.token_ids) == 8
        assert r.prompt_tokens == prompt_tokens and r.request_id == "grpc-1"


def test_token_id_prompts_and_the_colocated_app(stub, serve_apps, tiny_llama):
    ids = Tokenizer(tiny_llama).encode(LONG)
    by_ids = stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), max_tokens=8, temperature=0,
                                              ignore_eos=True), metadata=DISAGG, timeout=120)
    colo = stub.Generate(_greedy(LONG), metadata=COLO, timeout=120)
    assert by_ids.text == colo.text == _http_text(serve_apps["disagg"], LONG)[0]
    assert by_ids.prompt_tokens == len(ids) and by_ids.request_id  # made up by the server when not sent


def test_stream_concatenates_to_the_unary_response(stub):
    # A reader that falls behind gets the tokens made meanwhile in one response (as vLLM's do),
    # so a stream a descheduled gateway could take in one gulp would prove nothing: 48 tokens.
    whole = stub.Generate(_greedy(LONG, 48), metadata=DISAGG, timeout=120)
    chunks = list(stub.GenerateStream(_greedy(LONG, 48), metadata=DISAGG, timeout=120))
    assert len(chunks) > 1
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == list(whole.token_ids)
    assert [c.finish_reason for c in chunks] == [""] * (len(chunks) - 1) + ["length"]
    assert chunks[-1].completion_tokens == 48 and chunks[-1].prompt_tokens == whole.prompt_tokens


@pytest.mark.parametrize("request_pb, param", [
    (_greedy(SHORT, temperature=5), "temperature"),
    (pb.GenerateRequest(max_tokens=4), "prompt"),
    (pb.GenerateRequest(prompt=SHORT, max_tokens=10**6), "max_tokens"),
    (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 10**8]), max_tokens=4), "vocabulary"),
    (_greedy(SHORT, stop=["x"] * 1_000_000), "stop sequences"),
    (_greedy(SHORT, stop=["x" * 513]), "stop sequence has 513"),
], ids=["temperature", "no prompt", "too long", "bad token id", "a million stops", "a long stop"])
def test_bad_requests_are_invalid_argument(stub, request_pb, param):
    for call in (stub.Generate, lambda *a, **k: list(stub.GenerateStream(*a, **k))):
        with pytest.raises(grpc.RpcError) as info:
            call(request_pb, metadata=DISAGG, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert param in info.value.details()


def test_api_key_is_required_where_the_gateway_has_one(stub):
    for metadata in ((("application", "colo"),), (("application", "colo"), ("authorization", "Bearer wrong"))):
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(_greedy(SHORT), metadata=metadata, timeout=60)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in info.value.details()


def test_leaving_a_stream_frees_kv_on_both_pools(stub, serve_apps):
    app = serve_apps["disagg"]
    stream = stub.GenerateStream(_greedy(LONG, 300), metadata=DISAGG, timeout=120)
    first = next(stream)
    assert first.token_ids and not first.finish_reason
    stream.cancel()
    stats = app.wait_for_idle()
    assert all(s["num_free_kv_blocks"] == s["num_kv_blocks"] and not s.get("num_kv_leases") for s in stats.values())
    assert stub.Generate(_greedy(SHORT), metadata=DISAGG, timeout=120).completion_tokens == 8  # still serving
