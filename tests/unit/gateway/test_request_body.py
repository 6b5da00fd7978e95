"""A large body the vetting process accepted is parsed and validated a piece at a time: the same
result or error as in one call, and the gateway's event loop runs meanwhile."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
from pydantic import ValidationError

from pdserve.errors import InvalidRequestError
from pdserve.gateway.protocol import CompletionRequest
from pdserve.gateway.request_body import parse_json_object, parse_json_object_in_pieces
from tests.fakes.ticker import ticking

BODIES = [
    b'{"prompt": [[1,2],[3,4]], "max_tokens": 3}', b' {\n "prompt" : [ [1 , 2] ,\t[3] ] , "n":2 } ', b"{}",
    b'{"a": []}', b'{"a": [ ]}', b'{"a": [{"b": [1, [2]]}, "x", null, true, 1.5]}', b'{"a": 1, "a": 2}',
    b'{"a": "\\u00e9\\"]"}', b'{"a": [1,]}', b'{"a":1,}', b'{"a":1} x', b"[1]", b'"a"', b"", b"{", b'{"a"',
    b'{"a" 1}', b'{"a": [1 2]}', b'{1: 2}', b'{"a": NaN}', b'{"a": [Infinity]}', b'{"a": "\\ud800"}',
    b'{"a": ["\\udfff"]}', b'{"a": 1' + b"0" * 5000 + b"}", b'{"a": "\xff"}', b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
]


def outcome(parse, body: bytes):
    try:
        return parse(body)
    except InvalidRequestError as e:
        return type(e).__name__, e.message, e.param


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_in_pieces_gives_what_one_parse_gives(body):
    assert outcome(parse_json_object_in_pieces, body) == outcome(parse_json_object, body)


def test_nan_is_named_once():
    assert outcome(parse_json_object, b'{"a": NaN}')[1] == "the request body is not valid JSON: NaN is not a JSON number"


@pytest.mark.parametrize("prompt, expected", [
    ([[1, 2], [3]], [[1, 2], [3]]), (["a", "b"], ["a", "b"]), ([1, 2], [1, 2]), ([[1], []], [[1], []]),
    # A later list's error names the prompt and its position (one call named the union's branch too).
    ([[1, 2], [3, True]], [(("prompt", 1, 1), "int_type")]), ([[1], [2, 3.0]], [(("prompt", 1, 1), "int_type")]),
    ([[1, 2], "x"], [(("prompt", 1), "list_type")]),
])
def test_token_id_prompts_are_validated_one_list_at_a_time(prompt, expected):
    try:
        got = CompletionRequest.model_validate({"prompt": prompt}).prompt
    except ValidationError as e:
        got = [(err["loc"], err["type"]) for err in e.errors()]
    assert got == expected


def test_the_first_list_is_validated_as_in_one_call():
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": [[True], [1]]})
    assert {err["loc"][0] for err in e.value.errors()} == {"prompt"}


def test_the_event_loop_runs_while_a_large_accepted_body_is_parsed_and_validated():
    """256 prompts of 8,000 token ids (near the most the default bounds accept): in one parse and
    one validation each call held the GIL for its whole length (~77 ms and ~30 ms here), and no
    tick ran meanwhile; a piece at a time, the ticks run between pieces."""
    body = b'{"prompt": [' + b",".join([b"[" + b",".join([b"5"] * 8000) + b"]"] * 256) + b"]}"

    def parse_and_validate():
        return CompletionRequest.model_validate(parse_json_object_in_pieces(body))

    async def run():
        async with ticking() as ticks:
            await asyncio.sleep(0.01)
            ticks.count = 0
            with ThreadPoolExecutor(1) as pool:
                request = await asyncio.get_running_loop().run_in_executor(pool, parse_and_validate)
            return request, ticks.count

    request, during = asyncio.run(run())
    assert len(request.prompt) == 256 and request.prompt[255] == [5] * 8000
    assert during >= 10
