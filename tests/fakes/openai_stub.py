"""A scripted OpenAI-compatible server for the tests: known token timings and known failures.

Runs an aiohttp app on 127.0.0.1 (a free port) in a thread of its own. Each streamed completion
sends `max_tokens` chunks of one token: the first after `ttft_s`, the rest `itl_s` apart, then a
usage chunk and `data: [DONE]`. `mode` scripts a failure for every request: "http_500",
"malformed_sse", "midstream_error", "not_openai", "reset", "no_done".
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading

from aiohttp import web


class OpenAIStub:
    def __init__(self, ttft_s: float = 0.2, itl_s: float = 0.05, mode: str = "ok"):
        self.ttft_s, self.itl_s, self.mode = ttft_s, itl_s, mode
        self.requests: list[dict] = []
        self.client_ports: list[int] = []  # each completion request's client port: connections reused
        self.frozen_objects: list[int] = []  # gc.get_freeze_count() as each came (the client is this process)
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> "OpenAIStub":
        self._thread.start()
        self._started.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def _complete(self, request):
        body = await request.json()
        self.requests.append(body)
        self.client_ports.append(request.transport.get_extra_info("peername")[1])
        self.frozen_objects.append(gc.get_freeze_count())
        chat = "messages" in body
        if self.mode == "http_500":
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        if self.mode == "not_openai":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"hello": "world"}\n\n')
            return resp
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = int(body.get("max_tokens", 16))
        for i in range(n):
            await asyncio.sleep(self.ttft_s if i == 0 else self.itl_s)
            if self.mode == "malformed_sse" and i == 1:
                await resp.write(b"this is not sse\n\n")
                return resp
            if self.mode == "midstream_error" and i == 1:
                await resp.write(b'data: {"error": {"message": "engine died", "type": "server_error"}}\n\n')
                return resp
            if self.mode == "reset" and i == 1:
                request.transport.close()
                return resp
            choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        if self.mode != "no_done":
            await resp.write(b"data: [DONE]\n\n")
        return resp
