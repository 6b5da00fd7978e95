"""Send one OpenAI-compatible request and record when each streamed chunk arrived.

In: a `Connections` pool, the URL, the payload. Out: a `RequestRecord`. Every failure becomes an
error kind on the record, never an exception: `connection_error`, `timeout`, `connection_reset`,
`http_<status>`, `malformed_sse`, `invalid_response`, `server_error_midstream`, `truncated_stream`.
Output tokens are counted from the server's `usage` when it sends one, else by the local
tokenizer, else as one per content chunk; the record says which.

The HTTP/1.1 client is an asyncio protocol over httptools' parser (uvicorn's), with keep-alive
connections per host: each network read is parsed in the protocol's callback and its SSE lines
stamped with when that read arrived, with no stream reader, task wake-up or iterator per chunk.
The client shares the machine with the server it measures; per streamed chunk this costs about
a third less CPU than aiohttp's streaming reader did (benchmarks/RESULTS.md, #5).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from typing import Callable
from urllib.parse import urlsplit

import httptools

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
    """One response's SSE lines into its record: each token's chunk stamped with when it arrived,
    the text, the server's usage figure, errors in the stream."""

    def __init__(self, rec: RequestRecord, chat: bool):
        self.rec, self.chat = rec, chat
        self.text_parts: list[str] = []
        self.usage_tokens: int | None = None
        self.is_done, self.done_s = False, 0.0

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
            self.is_done, self.done_s = True, now
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
            if not isinstance(choice, dict):
                rec.error, rec.error_detail = "invalid_response", data[:200].decode("utf-8", "replace")
                return False
            delta = choice.get("delta") or {}
            if self.chat and "role" in delta:
                continue  # the stream's opening chunk, not a token
            # A chunk is a token's arrival even with no text (a special token, text held back), as
            # vLLM's bench counts it: skipping it would time the next token's gap over two steps.
            rec.chunk_times_s.append(now)
            piece = delta.get("content") if self.chat else choice.get("text")
            if piece:
                self.text_parts.append(piece)
        return True


END_GRACE_S = 1.0  # how long after [DONE] a response may take to end before its connection is dropped


class _Response(asyncio.Protocol):
    """One connection; `begin(stream)` before each request, whose body lines go to `stream` as
    reads arrive. `ended` resolves at the stream's end ([DONE] or an error in it) or the
    response's, and fails when the connection breaks first. The parser follows the response to
    its end either way, so the connection can serve the next request."""

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.is_open = True
        self.parser = self.stream = self.ended = None
        self.is_complete = self.can_reuse = False

    def begin(self, stream: "_Stream") -> None:
        self.stream, self.parser = stream, httptools.HttpResponseParser(self)
        self.status, self.is_complete, self.can_reuse = 0, False, False
        self.error_body, self._tail, self._now = b"", b"", 0.0
        self._grace: asyncio.TimerHandle | None = None
        self.ended = asyncio.get_running_loop().create_future()

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.parser is None or self.is_complete:
            return  # no request of ours is waiting: ignore the stray bytes
        self._now = time.perf_counter()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.can_reuse = False
            self._end(ConnectionResetError(f"unparsable HTTP response: {e}"))

    def connection_lost(self, exc) -> None:
        self.is_open = False
        if self.ended is None or self.ended.done():
            return
        if (self.status and self.status != 200) or self.stream.is_done or self.stream.rec.error:
            self._end(None)  # what the request needed arrived before the close
        else:
            self._end(ConnectionResetError(f"connection closed mid-response ({exc!r})"))

    # -- httptools callbacks -------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.can_reuse = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            self.error_body = (self.error_body + body)[:300]
            return
        if self.ended.done() or self.stream.is_done:
            return  # the stream has ended ([DONE] or an error): the rest only completes the response
        *lines, self._tail = (self._tail + body).split(b"\n")
        for line in lines:
            if not self.stream.take(line, self._now):
                if self.stream.rec.error:
                    self._end(None)  # an error in the stream: nothing more to read
                else:  # [DONE]: the response's end follows at once; wait for it, to reuse the connection
                    self._grace = asyncio.get_running_loop().call_later(END_GRACE_S, self._end, None)
                return

    def on_message_complete(self) -> None:
        self.is_complete = True
        if self.status == 200 and self._tail and not (self.ended.done() or self.stream.is_done):
            self.stream.take(self._tail, self._now)  # a last line without its newline
        self._end(None)

    def _end(self, error: BaseException | None) -> None:
        if self._grace is not None:
            self._grace.cancel()
        if not self.ended.done():
            if error is None:
                self.ended.set_result(None)
            else:
                self.ended.set_exception(error)


class Connections:
    """Keep-alive HTTP/1.1 connections per (scheme, host, port); `close()` ends the idle ones."""

    def __init__(self):
        self._idle: dict[tuple, list[_Response]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def open(self, scheme: str, host: str, port: int) -> _Response:
        idle = self._idle.get((scheme, host, port))
        while idle:
            conn = idle.pop()
            if conn.is_open and conn.is_complete and conn.can_reuse and not conn.transport.is_closing():
                return conn
            conn.transport.abort()
        tls = None
        if scheme == "https":
            self._ssl = self._ssl or ssl.create_default_context()
            tls = self._ssl
        _, conn = await asyncio.get_running_loop().create_connection(_Response, host, port, ssl=tls)
        return conn

    def release(self, key: tuple, conn: _Response) -> None:
        """After a request that went well: kept for the next one if the server keeps it open (its
        response may still be completing: `open` checks)."""
        if conn.is_open and conn.can_reuse:
            self._idle.setdefault(key, []).append(conn)
        else:
            conn.transport.abort()

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.transport.close()
        self._idle.clear()


def _request_bytes(host: str, port: int, path: str, body: bytes, headers: dict | None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", "Accept: text/event-stream", "User-Agent: pdserve-bench"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def send_request(connections: Connections, url: str, payload: dict, prompt_tokens: int,
                       timeout_s: float, count_tokens: Callable[[str], int] | None = None,
                       headers: dict | None = None) -> RequestRecord:
    rec = RequestRecord(send_s=time.perf_counter(), prompt_tokens=prompt_tokens)
    stream = _Stream(rec, "messages" in payload)
    parts = urlsplit(url)
    scheme, host = parts.scheme, parts.hostname or "localhost"
    port = parts.port or (443 if scheme == "https" else 80)
    key = (scheme, host, port)
    conn = None
    try:
        async with asyncio.timeout(timeout_s):
            try:
                conn = await connections.open(scheme, host, port)
            except OSError as e:
                rec.error, rec.error_detail = "connection_error", str(e)[:200]
                return rec
            conn.begin(stream)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.transport.write(_request_bytes(host, port, path, json.dumps(payload).encode(), headers))
            await conn.ended
    except TimeoutError:
        rec.error = "timeout"
    except ConnectionResetError as e:
        rec.error, rec.error_detail = "connection_reset", str(e)[:200]
    finally:
        if conn is not None:
            if rec.error or not conn.ended.done():
                conn.transport.abort()  # timed out, broken, cancelled, or a stream with an error in it
            else:
                connections.release(key, conn)
    if rec.error:
        return rec
    if conn.status != 200:
        rec.error = f"http_{conn.status}"
        rec.error_detail = conn.error_body.decode("utf-8", "replace")
        return rec
    if not stream.is_done:
        rec.error = "truncated_stream"
        return rec
    rec.end_s = stream.done_s
    usage_tokens, text_parts = stream.usage_tokens, stream.text_parts
    if usage_tokens is not None:
        rec.output_tokens, rec.output_tokens_source = usage_tokens, "usage"
    elif count_tokens is not None:
        rec.output_tokens, rec.output_tokens_source = count_tokens("".join(text_parts)), "tokenizer"
    else:
        rec.output_tokens = len(rec.chunk_times_s)
    return rec
