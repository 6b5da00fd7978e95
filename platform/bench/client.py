"""Send one OpenAI-compatible request and record when each streamed chunk arrived.

In: an aiohttp session, the endpoint (`completions` or `chat`), a `BenchRequest`. Out: a
`RequestRecord`. Every failure becomes an error kind on the record, never an exception:
`connection_error`, `timeout`, `connection_reset`, `http_<status>`, `malformed_sse`,
`invalid_response`, `server_error_midstream`, `truncated_stream`.
Output tokens are counted from the server's `usage` when it sends one, else by the local
tokenizer, else as one per content chunk; the record says which.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

import aiohttp

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workloads import BenchRequest


def build_payload(endpoint: str, model: str, req: BenchRequest, ignore_eos: bool, temperature: float) -> dict:
    payload = {"model": model, "max_tokens": req.max_tokens, "stream": True, "temperature": temperature,
               "stream_options": {"include_usage": True}}
    if ignore_eos:
        payload["ignore_eos"] = True  # a vLLM/pdserve extension; OpenAI ignores unknown fields
    if endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt
    return payload


class _Stream:
    """One response's SSE lines into its record: content pieces stamped with when they arrived,
    the server's usage figure, errors in the stream."""

    def __init__(self, rec: RequestRecord, chat: bool):
        self.rec, self.chat = rec, chat
        self.text_parts: list[str] = []
        self.usage_tokens: int | None = None
        self.is_done = False

    def take(self, line: bytes, now: float) -> bool:
        """Parse one line; False once the stream ended ([DONE]) or failed (rec.error set)."""
        rec = self.rec
        line = line.strip()
        if not line or line.startswith(b":"):
            return True
        if not line.startswith(b"data:"):
            rec.error, rec.error_detail = "malformed_sse", line[:200].decode("utf-8", "replace")
            return False
        data = line[5:].strip()
        if data == b"[DONE]":
            self.is_done = True
            return False
        try:
            obj = json.loads(data)
        except ValueError:  # not JSON, or not UTF-8
            rec.error, rec.error_detail = "malformed_sse", data[:200].decode("utf-8", "replace")
            return False
        if not isinstance(obj, dict):
            rec.error, rec.error_detail = "invalid_response", data[:200].decode("utf-8", "replace")
            return False
        if "error" in obj:
            rec.error, rec.error_detail = "server_error_midstream", json.dumps(obj["error"])[:300]
            return False
        choices = obj.get("choices")
        if not isinstance(choices, list):
            rec.error, rec.error_detail = "invalid_response", data[:200].decode("utf-8", "replace")
            return False
        usage = obj.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])
        for choice in choices:
            piece = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if piece:
                rec.chunk_times_s.append(now)
                self.text_parts.append(piece)
        return True


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict, prompt_tokens: int,
                       timeout_s: float, count_tokens: Callable[[str], int] | None = None,
                       headers: dict | None = None) -> RequestRecord:
    rec = RequestRecord(send_s=time.perf_counter(), prompt_tokens=prompt_tokens)
    stream = _Stream(rec, "messages" in payload)
    try:
        async with session.post(url, json=payload, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                rec.error = f"http_{resp.status}"
                rec.error_detail = (await resp.text())[:300]
                return rec
            # One await per network read, not one per line: the lines a read brings are parsed
            # at once, each piece stamped with the time that read returned.
            tail, is_open = b"", True
            async for received in resp.content.iter_any():
                now = time.perf_counter()
                *lines, tail = (tail + received).split(b"\n")
                for line in lines:
                    if not stream.take(line, now):
                        is_open = False
                        break
                if not is_open:
                    break
            if is_open and tail:  # a last line without its newline
                stream.take(tail, time.perf_counter())
            if rec.error:
                return rec
            if not stream.is_done:
                rec.error = "truncated_stream"
                return rec
            rec.end_s = time.perf_counter()
    except asyncio.TimeoutError:
        rec.error = "timeout"
        return rec
    except aiohttp.ClientConnectorError as e:
        rec.error, rec.error_detail = "connection_error", str(e)[:200]
        return rec
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionResetError) as e:
        rec.error, rec.error_detail = "connection_reset", str(e)[:200]
        return rec
    except aiohttp.ClientError as e:
        rec.error, rec.error_detail = "client_error", str(e)[:200]
        return rec
    usage_tokens, text_parts = stream.usage_tokens, stream.text_parts
    if usage_tokens is not None:
        rec.output_tokens, rec.output_tokens_source = usage_tokens, "usage"
    elif count_tokens is not None:
        rec.output_tokens, rec.output_tokens_source = count_tokens("".join(text_parts)), "tokenizer"
    else:
        rec.output_tokens = len(rec.chunk_times_s)
    return rec
