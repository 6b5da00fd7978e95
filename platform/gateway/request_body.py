"""A request's body, from the socket to a JSON object, bounded at every step.

`read_body` takes at most `limit_bytes` (a declared or actual larger body is a 413) within
`timeout_s` (a slow sender gets a 408 and holds nothing after). `parse_json_object` turns the
bytes into a dict or raises `InvalidRequestError`: invalid UTF-8, invalid JSON, NaN or Infinity,
nesting past the interpreter's limit, integers of more digits than Python converts, strings with
lone surrogates (JSON's `\\ud800` escapes decode to characters no UTF-8 text can hold), and a
top level that is not an object. It runs on a worker thread, but holds the GIL for the whole
parse: bodies over `body_vetter.VET_BODY_BYTES` go through it first in a process of their own,
and one the bounds accept is then parsed by `parse_json_object_in_pieces`, a piece at a time.
"""

from __future__ import annotations

import asyncio
import json
import re

from starlette.requests import Request

from pdserve.errors import InvalidRequestError
from pdserve.gateway.errors import APIError

# A \u escape of a surrogate (D800-DFFF) in the raw text: only then can a parsed string hold one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _too_large(limit_bytes: int) -> APIError:
    return APIError(413, f"request body over {limit_bytes} bytes", "invalid_request_error", "body_too_large")


async def read_body(request: Request, limit_bytes: int, timeout_s: float) -> bytearray:
    """The body, read within `timeout_s` and `limit_bytes` (a 408, a 413). A bytearray, not copied
    into bytes: at 4 MiB that copy held the event loop ~3 ms (fresh pages to fault in)."""
    try:
        declared = int(request.headers.get("content-length") or 0)
    except ValueError:
        raise InvalidRequestError("the Content-Length header is not a number") from None
    if declared > limit_bytes:
        raise _too_large(limit_bytes)

    async def read() -> bytearray:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit_bytes:
                raise _too_large(limit_bytes)
        return raw

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", "invalid_request_error",
                       "request_timeout") from None


def _reject_constant(name: str):
    raise InvalidRequestError(f"the request body is not valid JSON: {name} is not a JSON number")


def parse_json_object(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequestError("the request body is nested too deeply") from None
    except InvalidRequestError:  # (NaN or Infinity: a ValueError too)
        raise
    except ValueError as e:  # an integer longer than sys.get_int_max_str_digits()
        raise InvalidRequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    _refuse_lone_surrogates(raw, data)
    return data


_WHITESPACE = re.compile(r"[ \t\n\r]*")


def parse_json_object_in_pieces(raw: bytes) -> dict:
    """What `parse_json_object` gives, decoding the top level's members one at a time and an array
    member's elements one at a time: no one call holds the GIL longer than an element takes (the
    bounds limit each: a prompt is at most the context), so the event loop runs between them
    (`json.loads` of 256 prompts of 8,000 token ids held it ~77 ms). For bodies the vetting
    process accepted; a body it cannot walk goes to `parse_json_object`, for its error."""
    try:
        text = raw.decode("utf-8")
        decode, skip = json.JSONDecoder(parse_constant=_reject_constant).raw_decode, _WHITESPACE.match
        i = skip(text, 0).end()
        if text[i] != "{":
            raise ValueError
        data, i = {}, skip(text, i + 1).end()
        while text[i] != "}":
            key, i = decode(text, i)
            i = skip(text, i).end()
            if not isinstance(key, str) or text[i] != ":":
                raise ValueError
            i = skip(text, i + 1).end()
            data[key], i = _array_in_pieces(decode, skip, text, i) if text[i] == "[" else decode(text, i)
            i = skip(text, i).end()
            if text[i] == ",":
                i = skip(text, i + 1).end()
                if text[i] != '"':
                    raise ValueError
            elif text[i] != "}":
                raise ValueError
        if skip(text, i + 1).end() != len(text):
            raise ValueError
    except (ValueError, IndexError, RecursionError):  # (a JSONDecodeError, a UnicodeDecodeError)
        return parse_json_object(raw)
    _refuse_lone_surrogates(raw, data)
    return data


def _array_in_pieces(decode, skip, text: str, i: int) -> tuple[list, int]:
    items, i = [], skip(text, i + 1).end()
    if text[i] == "]":
        return items, i + 1
    while True:
        item, i = decode(text, i)
        items.append(item)
        i = skip(text, i).end()
        if text[i] == "]":
            return items, i + 1
        if text[i] != ",":
            raise ValueError
        i = skip(text, i + 1).end()


def _refuse_lone_surrogates(raw: bytes, data) -> None:
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(data):
        raise InvalidRequestError("the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff) in a string")


def _has_lone_surrogate(data) -> bool:
    """Whether any string (key or value) in `data` cannot be encoded as UTF-8. An explicit stack:
    the nesting the parser accepted may be deeper than Python's recursion limit here."""
    stack = [data]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            if not x.isascii():
                try:
                    x.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False
