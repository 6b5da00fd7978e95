"""The decode role without Ray: continuous-batch decoding of requests prefilled elsewhere, and
local prefill of short or mostly cached prompts (conditional disaggregation).

`DecodeServer.generate(GenerateRequest)` streams the engine's `RequestOutput`s. For a prompt with
at least `remote_prefill_min_tokens` tokens not in this replica's prefix cache it calls
`remote_prefill` (a prefill replica), streams the first token at once, reserves blocks for the
part of the prompt it does not cache, pulls only those, and joins the request to its batch. A
prefill call that fails is retried here as a local prefill; a pull that fails recomputes the
prompt here. Either way the client sees one uninterrupted stream. Cancelling the stream aborts
the request on both sides: the prefill call is cancelled, or its lease released.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import AsyncIterator, Awaitable, Callable

import torch

from pdserve.config import EngineConfig, TransferConfig
from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.errors import InvalidRequestError
from pdserve.kvtransfer import KVImporter, KVTransferError
from pdserve.messages import GenerateRequest, PrefillResult
from pdserve.prefill.server import engine_stats

log = logging.getLogger(__name__)

RemotePrefill = Callable[[GenerateRequest], Awaitable[PrefillResult]]


class DecodeServer:
    def __init__(self, engine_config: EngineConfig, transfer: TransferConfig | None = None,
                 remote_prefill: RemotePrefill | None = None,
                 make_importer: Callable[[LLMEngine], KVImporter] | None = None,
                 remote_prefill_min_tokens: int = 256, init_method: str | None = None):
        # init_method: where a tensor-parallel engine's rank workers meet (see LLMEngine).
        self.engine = AsyncLLMEngine(LLMEngine(engine_config, init_method))
        self.remote_prefill = remote_prefill
        self.importer = make_importer(self.engine.engine) if remote_prefill is not None else None
        self.transfer = transfer or TransferConfig()
        self.remote_prefill_min_tokens = remote_prefill_min_tokens
        self.num_remote_prefills = self.num_local_prefills = self.num_pulled_blocks = 0

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if not self._wants_remote_prefill(req):
            self.num_local_prefills += 1
            async for out in await self.engine.generate(req.request_id, req.prompt_token_ids, req.params):
                yield out
            return
        try:
            result = await self.remote_prefill(req)
        except InvalidRequestError:
            raise
        except Exception as e:  # noqa: BLE001 - a dead or failing prefill replica: prefill here instead
            log.warning("remote prefill of %s failed (%r); prefilling on this decode replica", req.request_id, e)
            self.num_local_prefills += 1
            async for out in await self.engine.generate(req.request_id, req.prompt_token_ids, req.params):
                yield out
            return
        self.num_remote_prefills += 1
        if result.kv is None:  # the first token ended it
            yield result.first
            return
        try:
            yield result.first
            recompute = await self._import(req, result)
        except BaseException:  # the client left, or the import failed: free both sides
            self.engine.locked(self.engine.engine.abort_request, req.request_id)
            await asyncio.to_thread(self.importer.release, result.kv)
            raise
        async for out in await self.engine.resume(req.request_id, recompute):
            yield out

    async def _import(self, req: GenerateRequest, result: PrefillResult) -> bool:
        """Reserve blocks for what this cache lacks and pull them. True: the pull failed, so the
        prompt must be recomputed here."""
        state = (torch.frombuffer(bytearray(result.generator_state), dtype=torch.uint8)
                 if result.generator_state is not None else None)
        engine = self.engine.engine
        num_local, dst = self.engine.locked(engine.add_prefilled_request, req.request_id, req.prompt_token_ids,
                                            req.params, result.first, state)
        recompute = dst is None  # no free blocks now: queue it here instead
        if not dst:  # every block is cached here already, or none is free
            await asyncio.to_thread(self.importer.release, result.kv)
        else:
            pull = asyncio.get_running_loop().run_in_executor(
                None, partial(self.importer.pull, result.kv, dst, self.transfer.timeout_s, None, num_local))
            try:
                await asyncio.shield(pull)
                self.num_pulled_blocks += len(dst)
            except KVTransferError as e:
                log.warning("KV pull of %s failed (%s); recomputing its prompt here", req.request_id, e)
                await asyncio.to_thread(self.importer.release, result.kv)
                recompute = True
            except BaseException:
                # Cancelled: the pull thread still writes into our blocks; wait before freeing them.
                await asyncio.wait([pull])
                self.engine.locked(engine.abort_request, req.request_id)
                raise
        return recompute

    def _wants_remote_prefill(self, req: GenerateRequest) -> bool:
        if self.remote_prefill is None or req.params.prompt_logprobs is not None:
            return False  # prompt logprobs need every prompt position's logits: prefill here
        if len(req.prompt_token_ids) < self.remote_prefill_min_tokens:
            return False
        uncached = self.engine.locked(self.engine.engine.num_uncached_prompt_tokens, req.prompt_token_ids)
        return uncached >= self.remote_prefill_min_tokens

    def stats(self) -> dict:
        return {**engine_stats(self.engine), "num_remote_prefills": self.num_remote_prefills,
                "num_local_prefills": self.num_local_prefills, "num_pulled_blocks": self.num_pulled_blocks}

    def shutdown(self) -> None:
        if self.importer is not None:
            self.importer.close()
        self.engine.shutdown()
