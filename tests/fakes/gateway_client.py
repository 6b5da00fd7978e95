"""A scripted stand-in for the pools behind the gateway, and a way to call the gateway's routes as
an ASGI server would, without a server: what `OpenAIService` tests drive it with."""

from __future__ import annotations

import asyncio
import json
import time

from starlette.requests import Request

from pdserve.engine.outputs import RequestOutput, TokenLogprob


class ScriptedClient:
    """Every sequence streams the same script of (token id, text) steps, the last one finished
    (with `finish_reason`). `requests` keeps every `GenerateRequest` it was given."""

    def __init__(self, steps, finish_reason: str = "length"):
        self.steps, self.finish_reason = steps, finish_reason
        self.requests = []

    async def generate(self, req):
        self.requests.append(req)
        k = req.params.logprobs
        for i, (tid, text) in enumerate(self.steps):
            last = i == len(self.steps) - 1
            lps = [TokenLogprob(tid, -0.5, 1, ((tid, -0.5), (tid + 1, -1.5)))] if k is not None else []
            yield RequestOutput(req.request_id, [tid], text, last, self.finish_reason if last else None, None, lps,
                                num_prompt_tokens=len(req.prompt_token_ids), num_output_tokens=i + 1)
            await asyncio.sleep(0)

    async def health(self):
        return {"unified": True}


def call(route, path: str, body: bytes | dict | None = None, headers: dict[str, str] | None = None,
         arrivals: list | None = None, method: str = "POST") -> tuple[int, bytes]:
    """`route(request)` (an `OpenAIService` method) on a request carrying `body` (a dict is sent as
    JSON), then the response sent: its status and whole body. Each body part's `perf_counter`
    time and bytes are appended to `arrivals` as it is sent."""
    raw = json.dumps(body).encode() if isinstance(body, dict) else (body or b"")
    hdrs = {"content-type": "application/json", "content-length": str(len(raw)), **(headers or {})}
    scope = {"type": "http", "method": method, "path": path, "asgi": {"spec_version": "2.4"},
             "headers": [(k.lower().encode(), v.encode("latin-1")) for k, v in hdrs.items()]}
    sent = []

    async def run():
        async def receive():
            return {"type": "http.request", "body": raw, "more_body": False}

        async def send(message):
            sent.append(message)
            if arrivals is not None and message["type"] == "http.response.body":
                arrivals.append((time.perf_counter(), message.get("body", b"")))

        response = route(Request(scope, receive))
        if asyncio.iscoroutine(response):
            response = await response
        await response(scope, receive, send)

    asyncio.run(run())
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
