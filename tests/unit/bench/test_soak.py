"""The soak's mix and ledger (pdserve.bench.soak): the plan is seeded and bounded, every answer a
server can give is classified, and what a replica still holds is found."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections import Counter

import torch
from aiohttp import web

from pdserve.bench import soak
from pdserve.engine.shared_memory import shared_zeros
from tests.fakes.hostile_requests import hostile_requests


def test_the_plan_is_seeded_mixed_and_fits_a_small_context():
    corpus = hostile_requests("m")
    plan = list(soak.plan_requests(2000, "m", corpus, seed=3))
    assert [r.body for r in plan[:50]] == [r.body for r in soak.plan_requests(50, "m", corpus, seed=3)]
    kinds = Counter(r.kind for r in plan)
    assert set(kinds) == set(soak.DEFAULT_MIX) and kinds["hostile"] > 40
    for r in plan:
        if r.kind == "hostile":
            assert isinstance(r.body, bytes) and 400 <= r.expected_status < 500 and r.name
            continue
        prompt = r.body.get("prompt") or r.body["messages"][0]["content"]
        assert len(prompt.split()) <= 90 and r.body["max_tokens"] <= 200
        assert (r.cancel_after_chunks > 0) == (r.kind == "cancel")
        assert r.body["stream"] or r.kind not in ("cancel", "stream", "shared_stream")
        assert (r.timeout_s is not None) == (r.kind == "timeout")
    shared = [r.body.get("prompt") or r.body["messages"][0]["content"] for r in plan if r.kind.startswith("shared")]
    assert len({" ".join(p.split()[:30]) for p in shared}) == 8  # eight prefixes, each shared many times
    assert "hostile" not in {r.kind for r in soak.plan_requests(200, "m")}  # no corpus, no hostile requests


def test_statuses_and_stream_errors_are_classified():
    assert soak.classify_status(200, False) == soak.COMPLETED
    assert [soak.classify_status(s, False) for s in (429, 503, 504)] == [soak.RETRYABLE] * 3
    assert soak.classify_status(500, False) == soak.UNACCOUNTED
    assert soak.classify_status(400, False) == soak.UNACCOUNTED  # a valid request refused
    assert soak.classify_status(413, True, 413) == soak.REJECTED
    assert soak.classify_status(400, True, 413) == soak.UNACCOUNTED
    assert soak.classify_status(200, True, 400) == soak.UNACCOUNTED  # a hostile body served
    assert soak.classify_error_body({"type": "service_unavailable"}) == soak.RETRYABLE
    assert soak.classify_error_body({"type": "timeout"}) == soak.RETRYABLE
    assert soak.classify_error_body({"type": "internal_error"}) == soak.UNACCOUNTED


def test_held_names_what_is_left_and_allows_one_connection_per_peer():
    accounting = {"Prefill": [{"pid": 1, "num_used_kv_blocks": 0, "num_kv_leases": 2, "num_open_kv_reads": 0}],
                  "Decode": [{"pid": 2, "num_used_kv_blocks": 3, "num_output_connections": 1,
                              "num_mapped_kv_caches": 2}],
                  "Gateway": [{"pid": 3, "num_pending_sequences": 0, "num_output_connections": 2}]}
    assert soak.held(accounting) == ["Prefill pid 1: num_kv_leases = 2", "Decode pid 2: num_used_kv_blocks = 3",
                                     "Decode pid 2: num_mapped_kv_caches = 2",  # one prefill replica lives
                                     "Gateway pid 3: num_output_connections = 2"]
    accounting["Prefill"][0]["num_kv_leases"] = accounting["Decode"][0]["num_used_kv_blocks"] = 0
    accounting["Gateway"][0]["num_output_connections"] = accounting["Decode"][0]["num_mapped_kv_caches"] = 1
    assert soak.held(accounting) == []


class _Server:
    """Answers each completion by its prompt: "ok", "stream", "busy" (503), "boom" (500), "dies"
    (a stream ending in a service_unavailable error), "slow" (a stream of 100 chunks, 20 ms apart)."""

    def __enter__(self):
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            app = web.Application()
            app.router.add_post("/v1/completions", self.complete)
            self.runner = web.AppRunner(app)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        ready.wait(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def complete(self, request):
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": {"message": "bad", "type": "invalid_request_error"}}, status=400)
        prompt = body["prompt"]
        if prompt in ("busy", "boom"):
            return web.json_response({"error": {"message": prompt, "type": "x"}}, status=503 if prompt == "busy" else 500)
        choice = {"index": 0, "text": "t", "finish_reason": "length", "logprobs": None}
        if not body.get("stream"):
            return web.json_response({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                                      "choices": [choice]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        num_chunks = 100 if prompt == "slow" else 2
        for i in range(num_chunks):
            if prompt == "slow":
                await asyncio.sleep(0.02)
            last = i == num_chunks - 1 and prompt != "dies"
            event = {"id": "c", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{**choice, "finish_reason": "length" if last else None}]}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        if prompt == "dies":
            await resp.write(b'data: {"error": {"message": "gone", "type": "service_unavailable"}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp


def test_drive_classifies_each_answer():
    def req(i, prompt, stream=False, **fields):
        return soak.SoakRequest(i, "whole", "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2,
                                                                "stream": stream}, **fields)

    plan = [req(0, "ok"), req(1, "stream", True), req(2, "busy"), req(3, "boom"), req(4, "dies", True),
            req(5, "slow", True, cancel_after_chunks=3), req(6, "slow", True, timeout_s=0.2),
            soak.SoakRequest(7, "hostile", "/v1/completions", b"{", expected_status=400, name="malformed"),
            req(8, "slow", True)]
    seen = []
    with _Server() as server:
        result = asyncio.run(soak.drive(f"http://127.0.0.1:{server.port}", plan, concurrency=3,
                                        on_done=lambda r, outcome: seen.append((r.index, outcome)),
                                        max_request_s=1.0))
    assert dict(sorted(seen)) == {0: soak.COMPLETED, 1: soak.COMPLETED, 2: soak.RETRYABLE, 3: soak.UNACCOUNTED,
                                  4: soak.RETRYABLE, 5: soak.CANCELLED, 6: soak.CLIENT_TIMEOUT, 7: soak.REJECTED,
                                  8: soak.UNACCOUNTED}  # 100 chunks 20 ms apart outlive max_request_s
    assert result.num_requests == 9 and result.counts[soak.UNACCOUNTED] == 2
    assert any("#3" in u and "500" in u for u in result.unaccounted)
    assert any("#8" in u and "no answer within" in u for u in result.unaccounted)


def test_a_processs_resident_set_splits_into_private_and_shared_memory():
    before = soak.rss_parts(os.getpid())
    cache = shared_zeros((8, 2**20), torch.uint8)  # 8 MiB, every page taken at once
    after = soak.rss_parts(os.getpid())
    assert after["rss"] == after["anon"] + after["file"] + after["shmem"]
    assert after["shmem"] - before["shmem"] >= 8 * 2**20 - 2**16
    assert soak.rss_bytes(os.getpid()) >= after["shmem"] and soak.rss_parts(2**22 + 1) is None
    del cache
