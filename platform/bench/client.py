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


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict, prompt_tokens: int,
                       timeout_s: float, count_tokens: Callable[[str], int] | None = None,
                       headers: dict | None = None) -> RequestRecord:
    rec = RequestRecord(send_s=time.perf_counter(), prompt_tokens=prompt_tokens)
    chat = "messages" in payload
    text_parts: list[str] = []
    usage_tokens = None
    try:
        async with session.post(url, json=payload, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                rec.error = f"http_{resp.status}"
                rec.error_detail = (await resp.text())[:300]
                return rec
            done = False
            async for raw in resp.content:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line or line.startswith(":"):
                    continue
                if not line.startswith("data:"):
                    rec.error, rec.error_detail = "malformed_sse", line[:200]
                    return rec
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    rec.error, rec.error_detail = "malformed_sse", data[:200]
                    return rec
                if not isinstance(obj, dict):
                    rec.error, rec.error_detail = "invalid_response", data[:200]
                    return rec
                if "error" in obj:
                    rec.error, rec.error_detail = "server_error_midstream", json.dumps(obj["error"])[:300]
                    return rec
                choices = obj.get("choices")
                if not isinstance(choices, list):
                    rec.error, rec.error_detail = "invalid_response", data[:200]
                    return rec
                if isinstance(obj.get("usage"), dict) and obj["usage"].get("completion_tokens") is not None:
                    usage_tokens = int(obj["usage"]["completion_tokens"])
                for choice in choices:
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        rec.chunk_times_s.append(time.perf_counter())
                        text_parts.append(piece)
            if not done:
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
    if usage_tokens is not None:
        rec.output_tokens, rec.output_tokens_source = usage_tokens, "usage"
    elif count_tokens is not None:
        rec.output_tokens, rec.output_tokens_source = count_tokens("".join(text_parts)), "tokenizer"
    else:
        rec.output_tokens = len(rec.chunk_times_s)
    return rec
