"""Streamed chunks: the pre-serialized token chunks are byte for byte what json.dumps gives for the
whole chunk, and the service's SSE streams (completions and chat, n=2, usage, logprobs) come out
as OpenAI's shapes in json.dumps' bytes, one finish_reason per choice, ending in [DONE]."""

import json
import time

import pytest

from pdserve.config import GatewayConfig
from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.openai_service import OpenAIService
from pdserve.gateway.sse import DONE, TextChunks, chat_choice, completion_choice, sse_event
from tests.fakes.gateway_client import ScriptedClient, call

TEXTS = ["hello", " world", "", 'quote " back \\ slash', "tab\tnew\nline\r\x00\x1f\x7f", "é ü ß 中文 😀",
         "\u2028\u2029", "</script>", "\x00pdserve-text\x00"]


@pytest.mark.parametrize("choice", [completion_choice, chat_choice])
def test_token_chunks_are_json_dumps_bytes(choice):
    base = {"id": "cmpl-x\"y", "object": "text_completion", "created": 1700000000, "model": "m/ü"}
    chunks = TextChunks(base, choice)
    for index in (0, 1, 12):
        for text in TEXTS:
            want = f"data: {json.dumps({**base, 'choices': [choice(index, text)]}, ensure_ascii=False)}\n\n"
            assert chunks.event(index, text) == want.encode()
    assert sse_event({"a": None, "b": [1.5, "é"]}) == b'data: {"a": null, "b": [1.5, "\xc3\xa9"]}\n\n'


def _stream(service, path: str, body: dict, arrivals: list | None = None) -> bytes:
    route = service.completions if path == "/v1/completions" else service.chat_completions
    status, raw = call(route, path, body, arrivals=arrivals)
    assert status == 200, raw
    return raw


def _events(stream: bytes) -> list[dict]:
    assert stream.endswith(DONE)
    parts = stream[:-len(DONE)].split(b"\n\n")
    assert parts[-1] == b""
    events = []
    for part in parts[:-1]:
        assert part.startswith(b"data: ")
        obj = json.loads(part[6:])
        assert part[6:] == json.dumps(obj, ensure_ascii=False).encode()  # json.dumps' own bytes
        events.append(obj)
    return events


@pytest.fixture(scope="module")
def service(tiny_llama):
    steps = [(5, "Hé"), (6, ' "lo"'), (7, ""), (8, "\n!")]
    return OpenAIService(ScriptedClient(steps), Tokenizer(tiny_llama), "tiny", 256, GatewayConfig())


def test_completion_stream(service):
    events = _events(_stream(service, "/v1/completions", {
        "prompt": [1, 2, 3], "max_tokens": 4, "n": 2, "stream": True, "stream_options": {"include_usage": True}}))
    *chunks, usage = events
    for c in chunks:
        assert c["id"].startswith("cmpl-") and c["object"] == "text_completion" and c["model"] == "tiny"
        [choice] = c["choices"]
        assert list(choice) == ["index", "text", "logprobs", "finish_reason", "stop_reason"]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(ch["text"] for ch in mine) == 'Hé "lo"\n!'
        assert [ch["text"] for ch in mine] == ["Hé", ' "lo"', "", "\n!"]  # a token without text sends a chunk too
        assert [ch["finish_reason"] for ch in mine] == [None, None, None, "length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8


def test_completion_stream_with_logprobs(service):
    chunks = _events(_stream(service, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True,
                                                         "logprobs": 1}))
    assert len(chunks) == 4  # with logprobs every token sends a chunk, text or not
    assert all(len(c["choices"][0]["logprobs"]["tokens"]) == 1 for c in chunks)


class FirstTokenTimingClient(ScriptedClient):
    """Notes when its first token is produced."""
    first_token_at = None

    async def generate(self, req):
        async for out in super().generate(req):
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            yield out


def test_the_chat_streams_opening_chunk_comes_with_its_first_token(tiny_llama):
    """As vLLM's: a client that times the first chunk (vllm bench serve counts the role chunk as the
    first token) times the first token, not the request's arrival."""
    client = FirstTokenTimingClient([(5, "a"), (6, "b")])
    service = OpenAIService(client, Tokenizer(tiny_llama), "tiny", 256, GatewayConfig())
    arrivals = []
    _stream(service, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                              "stream": True}, arrivals)
    opening = next(t for t, body in arrivals if b'"role"' in body)
    assert opening >= client.first_token_at


def test_chat_stream(service):
    events = _events(_stream(service, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}))
    first, *chunks = events
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == 'Hé "lo"\n!'
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert chunks[2]["choices"][0]["delta"] == {"content": ""}
    assert chunks[0]["choices"][0] == {"index": 0, "delta": {"content": "Hé"}, "logprobs": None,
                                       "finish_reason": None, "stop_reason": None}
