"""Mid-stream migration at the gateway: a sequence whose decode replica dies after it streamed
tokens goes on, resumed, on another one. Over real engines (a prefill server and two decode
servers in this process, no Ray): the client sees one stream with one finish whose text and usage
are the uninterrupted run's, for a stream, and for each choice of n = 2 where one fails. Over a
scripted attempt: the limit, and what is never migrated."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from pdserve.config import EngineConfig, GatewayConfig, TransferConfig
from pdserve.decode.server import DecodeServer
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import DeadlineExceededError
from pdserve.gateway.errors import UnavailableError
from pdserve.gateway.migration import migrating
from pdserve.gateway.openai_service import OpenAIService
from pdserve.kvtransfer.backends import layout_of
from pdserve.kvtransfer.local_backend import LocalImporter
from pdserve.prefill.server import PrefillServer
from pdserve.protocol import GenerateRequest
from tests.fakes.dying_replicas import DyingReplicas, MigratingClient
from tests.fakes.gateway_client import call

PROMPT = "serving systems route requests to replicas that hold cached prefixes"


@pytest.fixture(scope="module")
def servers(tiny_llama):
    """Two decode servers behind one prefill server (local KV transfer): the first placement of a
    prompt this long is prefilled remotely; a resumed one on its new decode replica."""
    config = EngineConfig(model=tiny_llama, num_kv_blocks=96, block_size=8)
    prefill = PrefillServer(config, TransferConfig(lease_s=5), "prefill-0", backend="local")
    importer = lambda e: LocalImporter(e.kv_cache.kv, layout_of(e.kv_cache.kv, Path(tiny_llama).name),  # noqa: E731
                                       {"prefill-0": prefill.exporter})
    decodes = [DecodeServer(config, TransferConfig(), prefill.prefill, importer)
               for _ in range(2)]
    yield decodes
    for d in decodes:
        d.shutdown()
    prefill.shutdown()


def _complete(servers, tiny_llama, body, die_after, migration_limit=3):
    client = MigratingClient(DyingReplicas(servers, die_after), migration_limit)
    service = OpenAIService(client, Tokenizer(tiny_llama), "tiny", 256, GatewayConfig(migration_limit=migration_limit))
    status, raw = call(service.completions, "/v1/completions", {"model": "tiny", "prompt": PROMPT, **body})
    assert status == 200, raw
    return client, raw


def _events(raw: bytes) -> list:
    chunks = [part[len(b"data: "):] for part in raw.split(b"\n\n") if part.startswith(b"data: ")]
    assert chunks[-1] == b"[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


def _stream_text(events) -> tuple[dict[int, str], dict[int, list]]:
    text, finishes = {}, {}
    for e in events:
        for c in e.get("choices", []):
            text[c["index"]] = text.get(c["index"], "") + c["text"]
            if c["finish_reason"] is not None:
                finishes.setdefault(c["index"], []).append(c["finish_reason"])
    return text, finishes


@pytest.mark.parametrize("die_after", [1, 6, 13])
def test_a_stream_whose_replica_dies_goes_on_on_another_as_one_stream(servers, tiny_llama, die_after):
    body = {"max_tokens": 24, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    _, whole = _complete(servers, tiny_llama, body, [None, None])
    client, moved = _complete(servers, tiny_llama, body, [die_after, None])
    expected, got = _events(whole), _events(moved)
    assert _stream_text(got) == _stream_text(expected)
    assert _stream_text(got)[1] == {0: ["length"]}  # one finish
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (cached tokens: the runs share caches)
    assert [got[-1]["usage"][k] for k in counts] == [expected[-1]["usage"][k] for k in counts]
    assert got[-1]["usage"]["completion_tokens"] == 24
    assert len({e["id"] for e in got}) == 1
    assert client.num_migrations == 1
    (first, req), (second, resumed) = client.replicas.placements
    assert (first, second) == (0, 1) and resumed.prompt_token_ids == req.prompt_token_ids
    assert len(resumed.output_token_ids) == client.replicas.delivered[0]
    assert 1 <= client.replicas.delivered[0] <= die_after and resumed.params.max_tokens == 24
    assert resumed.request_id == f"{req.request_id}-m1"
    for server in servers:  # the dead replica's request was aborted; nothing is held anywhere
        assert server.engine.engine.num_unfinished_requests == 0


def test_each_choice_migrates_on_its_own(servers, tiny_llama):
    """n = 2, seeded, with penalties and a stop string, not streamed: choice 0's replica dies;
    choice 1, on the other replica, streams on untouched."""
    body = {"max_tokens": 20, "temperature": 0.9, "seed": 11, "presence_penalty": 0.5, "n": 2,
            "ignore_eos": True}
    _, whole = _complete(servers, tiny_llama, body, [None, None])
    expected = json.loads(whole)
    client, moved = _complete(servers, tiny_llama, body, [7, None])
    got = json.loads(moved)
    assert got["choices"] == expected["choices"]
    assert got["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"] == 40
    assert client.num_migrations == 1
    placed = [(i, r.request_id, len(r.output_token_ids)) for i, r in client.replicas.placements]
    (_, choice0, _), (_, choice1, _) = placed[:2]
    assert choice0.endswith("-0") and choice1.endswith("-1")
    assert placed == [(0, choice0, 0), (1, choice1, 0), (1, f"{choice0}-m1", client.replicas.delivered[0])]
    assert 1 <= client.replicas.delivered[0] <= 7
    # And with a stop string that ends choice 0 late, held back across the move.
    text = expected["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    _, whole = _complete(servers, tiny_llama, {**body, "stop": [stop]}, [None, None])
    _, moved = _complete(servers, tiny_llama, {**body, "stop": [stop]}, [7, None])
    assert json.loads(moved)["choices"] == json.loads(whole)["choices"]


def test_past_the_limit_the_stream_ends_with_an_in_stream_error(servers, tiny_llama):
    body = {"max_tokens": 24, "temperature": 0, "stream": True, "ignore_eos": True}
    client, raw = _complete(servers, tiny_llama, body, [3, 3], migration_limit=1)
    events = _events(raw)
    assert client.num_migrations == 1 and len(client.replicas.placements) == 2
    assert "error" in events[-1] and events[-1]["error"]["code"] == 503
    assert _stream_text(events)[1] == {}  # no finish
    client, raw = _complete(servers, tiny_llama, body, [3, None], migration_limit=0)
    assert client.num_migrations == 0 and "error" in _events(raw)[-1]


# ---- the loop alone, over a scripted attempt

def _out(token_id: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [token_id], f"<{token_id}>", finished, "length" if finished else None,
                         num_cached_tokens=4)


def _run_script(script, limit):
    """`script`: one (outputs, error) per attempt. Returns (outputs, error, requests attempted)."""
    attempts = []

    async def attempt(req):
        attempts.append(req)
        outputs, error = script[len(attempts) - 1]
        for out in outputs:
            yield out
        if error is not None:
            raise error

    async def go():
        got = []
        req = GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=8, prompt_logprobs=1))
        try:
            async for out in migrating(attempt, req, limit):
                got.append(out)
        except Exception as e:  # noqa: BLE001
            return got, e, attempts
        return got, None, attempts

    return asyncio.run(go())


def test_migrations_accumulate_the_received_tokens_up_to_the_limit():
    dead = UnavailableError("replica died")
    script = [([_out(1), _out(2)], dead), ([_out(3)], dead), ([_out(4), _out(5, True)], None)]
    got, error, attempts = _run_script(script, limit=2)
    assert error is None and [o.new_token_ids[0] for o in got] == [1, 2, 3, 4, 5]
    assert [a.output_token_ids for a in attempts] == [[], [1, 2], [1, 2, 3]]
    assert [a.request_id for a in attempts] == ["r", "r-m1", "r-m2"]
    assert attempts[0].params.prompt_logprobs == 1 and attempts[1].params.prompt_logprobs is None
    assert all(o.request_id == "r" and o.num_cached_tokens == 4 for o in got)
    got, error, attempts = _run_script(script, limit=1)
    assert error is dead and len(attempts) == 2 and len(got) == 3


def test_request_errors_and_failures_before_any_token_are_not_migrated():
    got, error, attempts = _run_script([([], UnavailableError("down"))], limit=3)
    assert isinstance(error, UnavailableError) and len(attempts) == 1
    late = DeadlineExceededError()
    got, error, attempts = _run_script([([_out(1)], late)], limit=3)
    assert error is late and len(attempts) == 1 and len(got) == 1
