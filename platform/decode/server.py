"""The decode role without Ray: continuous-batch decoding of requests prefilled elsewhere, and
local prefill of short or mostly cached prompts (conditional disaggregation).

`DecodeServer.generate(GenerateRequest)` streams the engine's `RequestOutput`s. Where each prompt
is prefilled is one decision of `pdserve.decode.placement` against the latency target (`slo`),
from this replica's state and the rates its `CostModel` measures: remote (a prefill replica) while
that meets the TTFT target, else here, in chunks that keep its streams inside the ITL target and
only in steps with nothing to decode while the TTFT target leaves slack. Remote: it calls
`remote_prefill`, reserves blocks for the part of the prompt it does not cache, pulls only those,
and joins the request to its batch; the prefill's first token goes out as it joins, or at once
when waiting for the join would miss the TTFT target. A prefill call
that fails with a `RequestError` (bad input, a failure pinned to the request, its deadline) is
raised, never retried: here it would end the same way. Any other failure of the call (a
`ReplicaError`, a dead prefill replica) is retried here as a local prefill, and a pull that fails
recomputes the prompt here: either way the client sees one uninterrupted stream. Cancelling the
stream aborts the request on both sides: the prefill call is cancelled, or its lease released.
A resumed request (`GenerateRequest.output_token_ids`: the gateway moved it here after its decode
replica failed mid-stream) is placed like any other, its prompt and outputs being what is
prefilled: a prefill replica computes their KV and samples the next output from the same state
(the outputs replayed through its stop checks and grammar; a seeded draw is by position), and
this replica pulls what its cache lacks of them.

A request's `deadline_s` bounds every phase here: the prefill call waits at most until then, a
pull never past it, and the engine aborts the request once it passes (queued or decoding). Past
it the request ends with `DeadlineExceededError` and frees what it holds (its blocks here, the
prefill replica's lease).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import asdict, replace
from functools import partial
from typing import AsyncIterator, Awaitable, Callable


from pdserve.config import EngineConfig, SLOConfig, TransferConfig
from pdserve.engine.async_engine import AsyncLLMEngine, Forward
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.errors import DeadlineExceededError, RequestError
from pdserve.decode.placement import CostModel, Load, Placement, Target, kv_read_share, place
from pdserve.kvtransfer.base import KVImporter
from pdserve.kvtransfer.protocol import KVHandle, KVTransferError
from pdserve.kvtransfer.protocol import source_rank
from pdserve.protocol import GenerateRequest, PrefillResult
from pdserve.telemetry.averages import Window
from pdserve.telemetry.tracing import end_span, span, start_span

log = logging.getLogger(__name__)

RemotePrefill = Callable[[GenerateRequest], Awaitable[PrefillResult]]
PullRank = Callable[[int, KVHandle, list[int], int, float], Awaitable[None]]
# Two of the autoscaler's default look-back windows: enough first tokens to count at a few requests a second.
ATTAINMENT_WINDOW_S = 10.0


class DecodeServer:
    def __init__(self, engine_config: EngineConfig, transfer: TransferConfig | None = None,
                 remote_prefill: RemotePrefill | None = None,
                 make_importer: Callable[[LLMEngine], KVImporter] | None = None, init_method: str | None = None,
                 pull_rank: PullRank | None = None, on_pull: Callable[[float], None] | None = None,
                 slo: SLOConfig | None = None, prefill_queue: Callable[[], float | None] | None = None):
        # init_method: where a tensor-parallel engine's rank workers meet (see LLMEngine);
        # pull_rank(rank, handle, dst, first_block, timeout_s): rank >= 1 pulls its own KV heads;
        # on_pull(seconds): told the duration of every successful pull (a metric);
        # slo: the latency target placement aims at (ServeConfig.slo; None: SLOConfig's defaults);
        # prefill_queue(): the prompt tokens a remote prefill sent now waits behind (the prefill pool's
        # router's view; None, or no callable: only this replica's own prompts in flight are known).
        self.engine = AsyncLLMEngine(LLMEngine(engine_config, init_method))
        kv = self.engine.engine.kv_cache.kv  # [layers, 2, blocks, ...] per rank; ranks hold equal shares
        self.block_bytes = kv[:, :, 0].nbytes * self.engine.engine.parallel.size
        self.kv_bytes_per_token = self.block_bytes // engine_config.block_size
        # What a decode step streams besides KV (every rank its share), for the joint policy's kv_read_share
        engine = self.engine.engine
        self.decode_weight_bytes = engine.model.num_decode_weight_bytes() * engine.parallel.size
        self.pull_rank, self.on_pull = pull_rank, on_pull
        self.remote_prefill, self.prefill_queue = remote_prefill, prefill_queue or (lambda: None)
        self.importer = make_importer(self.engine.engine) if remote_prefill is not None else None
        self.transfer = transfer or TransferConfig()
        slo = slo or SLOConfig()
        self.target = Target(slo.ttft_ms / 1000, slo.itl_ms / 1000)
        self.costs = CostModel(percentile=slo.percentile)
        # request id -> (path, mean predicted TTFT, when placed): the first token's error feeds the cost model
        self.placed: dict[str, tuple[str, float, float]] = {}
        # Attainment over the last ATTAINMENT_WINDOW_S (the joint autoscaling policy reads it):
        # first tokens within the TTFT target, and token gaps (steps, one per stream) within the ITL's.
        self.ttft, self.itl = Window(ATTAINMENT_WINDOW_S), Window(ATTAINMENT_WINDOW_S)
        # Requests taken (a counter, read at each stats()) and how long each was held (however it
        # ended): with the requests held now, they tell the joint policy how the occupancy will
        # move (Little's law).
        self.num_arrived = 0
        self.arrived, self.held = Window(ATTAINMENT_WINDOW_S), Window(ATTAINMENT_WINDOW_S)
        self.engine.engine.on_step = self._on_step  # (on the engine's thread, after each step)
        self.remote_queued_tokens = 0  # uncached prompt tokens of this replica's remote prefills in flight
        self.num_remote_prefills = self.num_local_prefills = self.num_pulled_blocks = self.num_failed_pulls = 0
        self.num_local_prefills_for_target = 0  # prefilled here because the prefill pool would miss the TTFT target
        self.num_early_first_tokens = 0  # sent before their KV was pulled, to meet the TTFT target
        self.num_resumed_requests = 0  # sequences taken over from a replica that failed mid-stream
        # What a fault must bring back to 0: calls in progress (waiting on prefill, pulling or
        # decoding) and pulls whose copies may still be landing in this cache.
        self.num_in_flight_requests = self.num_open_kv_pulls = 0

    async def generate(self, req: GenerateRequest, forward: Forward | None = None) -> AsyncIterator[RequestOutput]:
        """`forward`: see AsyncLLMEngine (outputs it takes are not yielded; the first never is)."""
        arrived = started = time.monotonic()
        self.num_arrived += 1
        try:
            async with aclosing(self._generate(req, forward, arrived)) as outs:
                async for out in outs:
                    if arrived and not req.output_token_ids:  # a resumed stream's first token came long ago
                        now = time.monotonic()
                        self.ttft.add(now, now - arrived <= self.target.ttft_s)
                        placed = self.placed.pop(req.request_id, None)
                        if placed is not None:
                            where, expected_s, at = placed
                            self.costs.first_token(where, expected_s, now - at)
                    arrived = 0.0
                    yield out
        finally:
            self.placed.pop(req.request_id, None)
            now = time.monotonic()
            self.held.add(now, now - started)

    async def _generate(self, req: GenerateRequest, forward: Forward | None,
                        arrived: float) -> AsyncIterator[RequestOutput]:
        self.num_in_flight_requests += 1
        self.num_resumed_requests += bool(req.output_token_ids)
        try:
            await self.engine.prepare(req.params)  # its grammar compiled off the step loop, before any work
            placement, num_uncached, ahead = await self._where_to_prefill(req)
            if placement is not None:
                self.placed[req.request_id] = (placement.where, placement.expected_ttft_s, time.monotonic())
            if placement is None or placement.where == "local":
                self.num_local_prefills_for_target += placement is not None
                async for out in self._prefill_here(req, "local", forward, placement):
                    yield out
                return
            self.remote_queued_tokens += num_uncached
            called = time.monotonic()
            try:
                result = await self._remote_prefill_in_time(req)
                self.costs.remote_prefill(ahead + num_uncached, time.monotonic() - called,
                                          result.prefill_tokens_per_s)
            except RequestError:  # the request's own fault or fate: prefilling it here would end the same way
                raise
            except Exception as e:  # noqa: BLE001 - a dead or failing prefill replica: prefill here instead
                result = e
            finally:
                self.remote_queued_tokens -= num_uncached
            if isinstance(result, Exception):
                self.placed.pop(req.request_id, None)  # (not the path predicted: no error to learn from)
                log.warning("remote prefill of %s failed (%r); prefilling on this decode replica", req.request_id,
                            result)
                async for out in self._prefill_here(req, "local after a failed remote prefill", forward):
                    yield out
                return
            self.num_remote_prefills += 1
            if result.kv is None:  # the first token ended it
                yield result.first
                return
            early = self._first_token_early(arrived, num_uncached)
            try:
                if early:
                    self.num_early_first_tokens += 1
                    self.placed.pop(req.request_id, None)  # (ahead of the join it was predicted for)
                    yield result.first
                with span("pdserve.kv_transfer", req.trace_context, request_id=req.request_id,
                          backend=type(self.importer).__name__) as s:
                    recompute = await self._import(req, result)
                    s.set_attribute("recompute", recompute)
            except BaseException:  # the client left, the import failed or the deadline passed: free both sides
                self.engine.call_soon(self.engine.engine.abort_request, req.request_id)
                await self._release(result)
                raise
            # Resumed between two steps: unless it went out early, the first token leaves as the step
            # that computes the second begins, so the stream runs at the batch's pace from token one.
            first = None if early else result.first
            async for out in self._decode(req, "recomputed" if recompute else "remote",
                                          self.engine.resume(req.request_id, recompute, first, forward)):
                yield out
        finally:
            self.num_in_flight_requests -= 1

    async def _remote_prefill_in_time(self, req: GenerateRequest) -> PrefillResult:
        """The prefill call, cancelled (so stopped on the prefill replica) when the deadline passes."""
        if req.deadline_s is None:
            return await self.remote_prefill(req)
        try:
            return await asyncio.wait_for(self.remote_prefill(req), req.deadline_s - time.time())
        except TimeoutError:
            if time.time() < req.deadline_s:  # a timeout of the call's own: the replica's failure
                raise
            raise DeadlineExceededError("the request's deadline passed during its remote prefill") from None

    def _prefill_here(self, req: GenerateRequest, why: str, forward: Forward | None,
                      placement: Placement | None = None) -> AsyncIterator[RequestOutput]:
        """Prefill and decode `req` on this replica, in the chunks and after the pause `placement`
        chose (none: as the engine's steps allow, at once)."""
        self.num_local_prefills += 1
        pause_s, chunk = (placement.pause_s, placement.chunk_tokens) if placement else (0.0, 0)
        return self._decode(req, why, self.engine.generate(req.request_id, req.prompt_token_ids, req.params,
                                                           forward=forward, prefill_pause_s=pause_s,
                                                           deadline_s=req.deadline_s,
                                                           output_token_ids=req.output_token_ids,
                                                           max_chunk_tokens=chunk))

    def _on_step(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        self.costs.step(num_decodes, num_prefill_tokens, seconds)
        if num_decodes:
            self.itl.add(time.monotonic(), seconds <= self.target.itl_s, num_decodes)

    def _first_token_early(self, arrived: float, num_uncached: int) -> bool:
        """Whether a remotely prefilled request's first token must go out before its KV is pulled:
        only when waiting for the pull and the join would take it past the TTFT target. Otherwise it
        leaves as the request joins the batch, so the stream runs at the batch's pace from token one
        (an early token puts the pull and the join between the first and second tokens)."""
        rates = self.costs.rates()
        join_s = num_uncached * self.kv_bytes_per_token / rates.link_bytes_per_s
        return time.monotonic() - arrived + join_s + rates.decode_step_s > self.target.ttft_s

    async def _decode(self, req: GenerateRequest, prefill: str, opening) -> AsyncIterator[RequestOutput]:
        """The engine's stream for `req` under a decode span (it outlives yields: ended by hand)."""
        s = start_span("pdserve.decode", req.trace_context, request_id=req.request_id, prefill=prefill)
        error = None
        try:
            async for out in await opening:
                yield out
        except BaseException as e:
            error = e
            raise
        finally:
            end_span(s, error)

    async def _import(self, req: GenerateRequest, result: PrefillResult) -> bool:
        """Reserve blocks for what this cache lacks and pull them. True: the pull failed, so the
        prompt must be recomputed here."""
        engine = self.engine.engine
        num_local, dst = await self.engine.call(engine.add_prefilled_request, req.request_id, req.prompt_token_ids,
                                                req.params, result.first, req.deadline_s, req.output_token_ids)
        recompute = dst is None  # no free blocks now: queue it here instead
        if not dst:  # every block is cached here already, or none is free
            await self._release(result)
        else:
            timeout_s = self.transfer.timeout_s
            if req.deadline_s is not None:  # a pull never waits past the deadline
                timeout_s = min(timeout_s, req.deadline_s - time.time())
                if timeout_s <= 0:
                    raise DeadlineExceededError("the request's deadline passed before its KV pull")
            pull = asyncio.ensure_future(self._pull(result, dst, num_local, timeout_s))
            self.num_open_kv_pulls += 1
            pull.add_done_callback(self._pull_ended)
            started = time.perf_counter()
            try:
                await asyncio.shield(pull)
                self.num_pulled_blocks += len(dst)
                seconds = time.perf_counter() - started
                self.costs.pull(len(dst) * self.block_bytes, seconds)
                if self.on_pull is not None:
                    self.on_pull(seconds)
            except KVTransferError as e:
                if req.deadline_s is not None and time.time() >= req.deadline_s:  # cut short by it: no recompute
                    raise DeadlineExceededError("the request's deadline passed during its KV pull") from None
                log.warning("KV pull of %s failed (%s); recomputing its prompt here", req.request_id, e)
                self.num_failed_pulls += 1
                await self._release(result)
                recompute = True
            except BaseException:
                # Cancelled: the pulls still write into our blocks; wait before freeing them.
                await asyncio.wait([pull])
                self.engine.call_soon(engine.abort_request, req.request_id)
                raise
        return recompute

    def _pull_ended(self, _pull: asyncio.Future) -> None:
        self.num_open_kv_pulls -= 1

    async def _pull(self, result: PrefillResult, dst: list[int], first_block: int, timeout: float) -> None:
        """Every rank of this replica pulls its KV heads from the prefill rank that holds them,
        each within `timeout` seconds. One rank on both sides: the pull acks its lease. Otherwise
        several ranks may read one lease, so the leases are released once every pull has finished
        (or failed)."""
        loop = asyncio.get_running_loop()
        ranks = self.engine.engine.parallel.size
        handles = result.kv_by_rank
        if ranks == 1 and len(handles) == 1:
            await loop.run_in_executor(None, partial(self.importer.pull, result.kv, dst, timeout, None, first_block))
            return
        layouts = [replace(self.importer.layout, tp_rank=r) for r in range(ranks)]
        sources = [handles[source_rank(len(handles), layout)] for layout in layouts]
        pulls = [loop.run_in_executor(None, partial(self.importer.pull, sources[0], dst, timeout, None,
                                                    first_block, False))]
        pulls += [self.pull_rank(r, sources[r], dst, first_block, timeout) for r in range(1, ranks)]
        outcomes = await asyncio.gather(*pulls, return_exceptions=True)  # all done: nothing writes any more
        errors = [e for e in outcomes if isinstance(e, BaseException)]
        if errors:
            raise errors[0] if isinstance(errors[0], KVTransferError) else KVTransferError(repr(errors[0]))
        await self._release(result)

    async def _release(self, result: PrefillResult) -> None:
        for handle in result.kv_by_rank:
            await asyncio.to_thread(self.importer.release, handle)

    async def _where_to_prefill(self, req: GenerateRequest) -> tuple[Placement | None, int, float]:
        """Where `req`'s prompt is prefilled (None: here, whatever the cost: nothing else can), the
        prompt tokens this cache lacks, and the prompt tokens a remote prefill would wait behind."""
        if self.remote_prefill is None or req.params.prompt_logprobs is not None:
            return None, 0, 0  # prompt logprobs need every prompt position's logits: prefill here
        engine = self.engine.engine
        # (the call waits for a running step to end: the prefix cache is the engine thread's)
        num_uncached = await self.engine.call(engine.num_uncached_prompt_tokens,
                                              req.prompt_token_ids + req.output_token_ids, req.params.cache_salt)
        ahead = self.prefill_queue()
        if ahead is None:
            ahead = self.remote_queued_tokens
        load = Load(num_uncached, int(ahead), engine.scheduler.num_queued_prefill_tokens(),
                    len(engine.scheduler.running), self.kv_bytes_per_token,
                    engine.config.max_num_batched_tokens)
        rates = self.costs.rates()
        placement = place(load, rates, self.target)
        log.debug("placement of %s: %s (%s); %s; %s", req.request_id, placement.where, placement.reason, load, rates)
        return placement, num_uncached, ahead

    def _kv_read_share(self) -> float:
        e = self.engine.engine
        held = (e.block_pool.num_blocks - e.num_free_kv_blocks) * self.block_bytes
        return kv_read_share(held, self.decode_weight_bytes)

    def stats(self) -> dict:
        now = time.monotonic()
        self.arrived.add(now, self.num_arrived)
        return {**self.engine.stats(), "num_remote_prefills": self.num_remote_prefills,
                "requests_per_s": self.arrived.rate(now), "residence_s": self.held.mean(now),
                "kv_read_share": self._kv_read_share(),
                "num_local_prefills": self.num_local_prefills,
                "num_local_prefills_for_target": self.num_local_prefills_for_target,
                "num_early_first_tokens": self.num_early_first_tokens,
                **{f"placement_{name}": value for name, value in asdict(self.costs.rates()).items()},
                "placement_prefill_queued_tokens": self.prefill_queue(),
                "ttft_attainment": self.ttft.share(time.monotonic()), "itl_attainment": self.itl.share(time.monotonic()),
                "num_resumed_requests": self.num_resumed_requests,
                "num_pulled_blocks": self.num_pulled_blocks,
                "num_pulled_bytes": self.num_pulled_blocks * self.block_bytes,
                "num_failed_pulls": self.num_failed_pulls, "num_open_kv_pulls": self.num_open_kv_pulls,
                "num_in_flight_requests": self.num_in_flight_requests,
                "num_shared_memory_pulls": self.importer.num_shared_memory_pulls if self.importer else 0,
                "num_board_reads": self.importer.num_board_reads if self.importer else 0,
                "num_mapped_kv_caches": self.importer.num_mapped_caches if self.importer else 0}

    def shutdown(self) -> None:
        if self.importer is not None:
            self.importer.close()
        self.engine.shutdown()
