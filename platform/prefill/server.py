"""The prefill role without Ray: an engine that stops each request at its first token and
exports the prompt's KV blocks under a lease for a decode replica to pull.

`PrefillServer.prefill(GenerateRequest) -> PrefillResult`. A request whose first token already
ends it (EOS, a stop, max_tokens 1) returns no handle and holds nothing. Cancelling the call
aborts the request and frees its blocks; once exported, the blocks belong to the lease (released
by the decode side's ack, or on expiry). A request the engine ends on its own raises its
`RequestError` and holds nothing: `RequestFailedError` (a step failed for it alone) or
`DeadlineExceededError` (its `deadline_s` passed while it was queued or prefilling).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Awaitable, Callable

from pdserve.config import EngineConfig, TransferConfig
from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.engine.engine import LLMEngine
from pdserve.kvtransfer.backends import BACKENDS, exporter_options, layout_of
from pdserve.kvtransfer.protocol import KVHandle
from pdserve.protocol import GenerateRequest, PrefillResult
from pdserve.telemetry.averages import Average, Window
from pdserve.telemetry.tracing import span

log = logging.getLogger(__name__)
RATE_WINDOW_S = 10.0

ExportRanks = Callable[[str, list[int], int], Awaitable[tuple[KVHandle, ...]]]


class PrefillServer:
    def __init__(self, engine_config: EngineConfig, transfer: TransferConfig, exporter_id: str,
                 host: str = "127.0.0.1", init_method: str | None = None, export_ranks: ExportRanks | None = None,
                 backend: str | None = None):
        # init_method: where a tensor-parallel engine's rank workers meet (see LLMEngine);
        # export_ranks: lease the same blocks on ranks 1..N-1 (each serves its own KV heads);
        # backend: the KV backend by name, transfer.backend's unless given ("local": tests, one process).
        self.engine = AsyncLLMEngine(LLMEngine(engine_config, init_method))
        self.export_ranks = export_ranks
        # Its prompt tokens a second, told to decode replicas with each result (their placement).
        self.prefill_rate = Average(0.0)
        self.engine.engine.on_step = self._measure_step
        # Prompt tokens computed and prompts served, read at each stats(): their rates are the
        # pool's load (the joint autoscaling policy's), in tokens against what one replica can take
        # a second, and in prompts (the mean prompt's compute: how long one waits behind another).
        self.computed, self.prompts, self.num_prompts = Window(RATE_WINDOW_S), Window(RATE_WINDOW_S), 0
        kv = self.engine.engine.kv_cache.kv
        self.layout = layout_of(kv, Path(engine_config.model).name, engine_config.tensor_parallel_size)
        pool = self.engine.engine.block_pool
        backend = backend or transfer.backend
        exporter_cls, _ = BACKENDS[backend]()
        options = exporter_options(backend, host, transfer.shared_memory)
        # The lease table pins (on this replica's event loop, at export) and unpins (on the
        # exporter's threads, at an ack or expiry) between engine steps, never waiting for one:
        # made mid-step, they run right after it. Waiting out a step, the event loop stopped taking
        # and returning every other request for as long as a long prompt's prefill step lasted.
        # A pin that waits is safe: the blocks are the engine's until its `release_kv`, which
        # `_prefill` queues after the export.
        self.exporter = exporter_cls(exporter_id, kv, self.layout,
                                     lambda ids: self.engine.call_soon(pool.incref, ids),
                                     lambda ids: self.engine.call_soon(pool.free, ids),
                                     lease_s=transfer.lease_s, **options)

    async def prefill(self, req: GenerateRequest) -> PrefillResult:
        with span("pdserve.prefill", req.trace_context, request_id=req.request_id,
                  prompt_tokens=len(req.prompt_token_ids)) as s:
            result = await self._prefill(req)
            s.set_attribute("cached_tokens", result.first.num_cached_tokens)
            s.set_attribute("exported_blocks", len(result.kv.block_ids) if result.kv is not None else 0)
            return result

    async def _prefill(self, req: GenerateRequest) -> PrefillResult:
        # A resumed request (output_token_ids): its outputs are prefilled with the prompt, and the
        # KV exported covers both.
        stream = await self.engine.generate(req.request_id, req.prompt_token_ids, req.params, prefill_only=True,
                                            deadline_s=req.deadline_s, output_token_ids=req.output_token_ids)
        async for out in stream:
            first = out
        self.num_prompts += 1
        rate = self._prefill_tokens_per_s()
        if not first.needs_decode:
            return PrefillResult(first, prefill_tokens_per_s=rate)
        try:
            # Worker ranks lease first (they pin nothing): cancelled here, the engine's hold of the
            # blocks is still released below and their leases just expire.
            kv_tokens = first.num_prompt_tokens + len(req.output_token_ids)
            rank_kv = (await self.export_ranks(req.request_id, first.kv_block_ids, kv_tokens)
                       if self.export_ranks is not None else ())
            # Not as an engine call: the lease table's lock is taken before the engine's (its pins and
            # the exporter's acks), never the other way round.
            handle = self.exporter.export(req.request_id, first.kv_block_ids, kv_tokens)
        finally:  # after the pin: the lease holds the blocks now
            self.engine.call_soon(self.engine.engine.release_kv, req.request_id)
        # To the client this is the first chunk of a stream that decode continues (a seeded one
        # draws by position there: no sampler state travels).
        first.finished, first.kv_block_ids = False, None
        return PrefillResult(first, handle, rank_kv, rate)

    def _measure_step(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        if num_prefill_tokens and seconds > 0:  # (on the engine's thread)
            self.prefill_rate.add(num_prefill_tokens / seconds)

    def stats(self) -> dict:
        leases = self.exporter.leases
        return {**self.engine.stats(), "num_kv_leases": len(leases), "num_open_kv_reads": leases.num_open_reads,
                "num_expired_kv_leases": leases.num_expired, "prefill_tokens_per_s": self._prefill_tokens_per_s(),
                **self._load()}

    def _prefill_tokens_per_s(self) -> float | None:
        return self.prefill_rate.value if self.prefill_rate.num_samples else None  # None: not measured yet

    def _load(self) -> dict[str, float | None]:
        now = time.monotonic()
        self.computed.add(now, self.engine.engine.scheduler.num_computed_prompt_tokens)
        self.prompts.add(now, self.num_prompts)
        return {"prompt_tokens_per_s": self.computed.rate(now), "prompts_per_s": self.prompts.rate(now)}

    def shutdown(self, drain_s: float = 0.0) -> None:
        """Stop; with `drain_s`, first give decode replicas that long to pull what is leased (a
        replica removed by scale-down must not strand KV its requests still need)."""
        deadline = time.monotonic() + drain_s
        while len(self.exporter.leases) and time.monotonic() < deadline:
            time.sleep(0.05)
        if len(self.exporter.leases):
            log.warning("shutting down with %d KV leases unreleased", len(self.exporter.leases))
        self.exporter.close()
        self.engine.shutdown()
