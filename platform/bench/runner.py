"""Run one benchmark: send a workload's requests on schedule, collect records, compute metrics.

Arrivals are Poisson or constant at `rate`, a replay trace's own offsets, or a fixed number of
requests in flight (`concurrency`). A `duration_s` stops launching new requests after that long.
A progress bar counts finished requests. Out: the metrics dict plus the run's settings.
"""

from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import asdict, dataclass

import aiohttp
from tqdm import tqdm

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.client import Connections, build_payload, send_request
from pdserve.bench.metrics import RequestRecord, compute_metrics
from pdserve.bench.workloads import BenchRequest, PromptBuilder


@dataclass
class RunSettings:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"  # or "chat"
    model: str | None = None  # None: the first model /v1/models lists
    rate: float = float("inf")
    arrival: str = "poisson"
    concurrency: int | None = None
    duration_s: float | None = None
    timeout_s: float = 600.0
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str | None = None
    slo: dict | None = None
    percentiles: tuple = (50, 90, 99)


async def _resolve_model(session: aiohttp.ClientSession, s: RunSettings, headers: dict) -> str:
    if s.model:
        return s.model
    try:
        async with session.get(f"{s.base_url}/v1/models", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=30)) as resp:
            body = await resp.json(content_type=None)
            return body["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, TypeError, ValueError):
        return "unknown"  # the requests themselves will report what is wrong


async def run_requests(requests: list[BenchRequest], s: RunSettings, builder: PromptBuilder | None = None,
                       progress: bool = True) -> tuple[list[RequestRecord], float, str]:
    headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
    url = f"{s.base_url}/v1/{'chat/completions' if s.endpoint == 'chat' else 'completions'}"
    count = builder.count if builder is not None and builder.is_exact else None
    if any(r.offset_s is not None for r in requests):
        offsets = [r.offset_s or 0.0 for r in requests]
    elif s.concurrency:
        offsets = [0.0] * len(requests)
    else:
        offsets = arrival_offsets(len(requests), s.rate, s.arrival, s.seed)
    limit = asyncio.Semaphore(s.concurrency or len(requests) or 1)
    records: list[RequestRecord] = []
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
    async with aiohttp.ClientSession() as session:
        model = await _resolve_model(session, s, headers)
    connections = Connections()

    async def one(req: BenchRequest):
        async with limit:
            if s.duration_s is not None and time.perf_counter() - start >= s.duration_s:
                return  # past the run's duration: a queued request is not sent
            payload = build_payload(s.endpoint, model, req, s.ignore_eos, s.temperature)
            rec = await send_request(connections, url, payload, req.prompt_tokens, s.timeout_s, count, headers)
        records.append(rec)
        bar.update(1)

    # What the client process holds stays out of full collections for the run: with Ray, torch
    # and a tokenizer loaded (~230,000 objects) one takes 115-130 ms, and one of 216 ms mid-run
    # stalled every stream it timed. vLLM's bench does the same; Ray Serve freezes its replicas'.
    was_frozen = gc.get_freeze_count() > 0
    gc.collect()
    gc.freeze()
    start = time.perf_counter()
    tasks = []
    try:
        for req, offset in zip(requests, offsets):
            if s.duration_s is not None and offset >= s.duration_s:
                break
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        await asyncio.gather(*tasks)
    finally:
        connections.close()
        if not was_frozen:  # a caller that froze its own heap keeps it frozen
            gc.unfreeze()
    duration = time.perf_counter() - start
    bar.close()
    return records, duration, model


def run_on_client_loop(coroutine):
    """Run `coroutine` on uvloop's event loop where it is installed (Ray Serve's uvicorn brings it),
    else asyncio's: the client shares the machine with what it measures, and uvloop reads and
    parses the streams for about a third less CPU per token."""
    try:
        import uvloop
    except ImportError:
        factory = None
    else:
        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coroutine)


def run_benchmark(requests: list[BenchRequest], s: RunSettings, builder: PromptBuilder | None = None,
                  workload: str = "", progress: bool = True) -> dict:
    records, duration, model = run_on_client_loop(run_requests(requests, s, builder, progress))
    result = compute_metrics(records, duration, s.slo, s.percentiles)
    settings = asdict(s)
    settings.pop("api_key")
    settings["rate"] = "inf" if s.rate == float("inf") else s.rate
    result.update(settings)
    # vLLM's names for the same settings, so result files line up with its published ones.
    result.update(request_rate=settings["rate"], max_concurrency=s.concurrency, num_prompts=len(requests))
    result.update(model_id=model, workload=workload, exact_token_counts=bool(builder and builder.is_exact),
                  date=time.strftime("%Y-%m-%d %H:%M:%S"))
    done = [r for r in records if r.ok]
    result["ttfts_ms"] = [r.ttft_s * 1000 for r in done]  # per request, as vLLM's detailed results
    result["e2els_ms"] = [r.e2el_s * 1000 for r in done]
    result["error_examples"] = {}
    for r in records:
        if r.error and r.error not in result["error_examples"]:
            result["error_examples"][r.error] = r.error_detail
    return result
