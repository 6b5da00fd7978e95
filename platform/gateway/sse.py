"""Server-sent events of the OpenAI streaming routes, as the bytes that go on the wire.

In: a chunk (a dict, serialized with `json.dumps(..., ensure_ascii=False)`), or, for the chunk
every token sends, just its choice index and text. Out: `data: <json>\\n\\n` as bytes.

A token's chunk differs from the stream's previous one only in its choice index and text, so
`TextChunks` serializes the rest once per choice and splices each token's text, JSON-escaped by
the json module's own string encoder, between the two halves: the same bytes `json.dumps` gives
for the whole chunk, without building and walking a dict per token. What this module does not
know: what goes into a chunk (the service decides), or HTTP.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring  # what json.dumps(..., ensure_ascii=False) uses for str
from typing import Callable

DONE = b"data: [DONE]\n\n"
_MARK = "\x00pdserve-text\x00"  # no token text is this; escaped, it is found exactly once in a chunk


def sse_event(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"


class TextChunks:
    """One stream's token chunks: `base` holds its fixed fields (id, object, created, model);
    `choice(index, text)` gives the choice object of a chunk that carries only `text`."""

    def __init__(self, base: dict, choice: Callable[[int, str], dict]):
        self._base, self._choice = base, choice
        self._halves: dict[int, tuple[bytes, bytes]] = {}

    def event(self, index: int, text: str) -> bytes:
        """`sse_event({**base, "choices": [choice(index, text)]})`."""
        halves = self._halves.get(index)
        if halves is None:
            whole = sse_event({**self._base, "choices": [self._choice(index, _MARK)]})
            mark = encode_basestring(_MARK).encode()
            before, found, after = whole.partition(mark)
            assert found and mark not in after, "the text must appear once in a chunk"
            halves = self._halves[index] = (before, after)
        return halves[0] + encode_basestring(text).encode() + halves[1]


def completion_choice(index: int, text: str) -> dict:
    """A /v1/completions stream chunk's choice while the sequence runs, without logprobs."""
    return {"index": index, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}


def chat_choice(index: int, text: str) -> dict:
    """A /v1/chat/completions stream chunk's choice while the sequence runs, without logprobs."""
    return {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None,
            "stop_reason": None}
