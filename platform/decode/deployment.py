"""The `Decode` Ray Serve deployment (also the colocated `Unified` pool, with no prefill pool).

`generate(req, reply_to)` is called once per sequence through the pool's request router and stays
open until the sequence ends; its outputs go over the gateway's output connection when it has
one to this replica (pdserve.output), else on the call itself.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from pathlib import Path
from typing import AsyncIterator

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from pdserve.config import ServeConfig
from pdserve.decode.server import DecodeServer
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.kvtransfer.backends import BACKENDS, layout_of
from pdserve.protocol import GenerateRequest, PrefillResult
from pdserve.output.frames import ChannelDone, ChannelOffer
from pdserve.output.sender import OutputChannelServer
from pdserve.replica.engine_replica import EngineReplica
from pdserve.replica.rank_workers import RankWorkers
from pdserve.router import pool_views
from pdserve.router.request_router import start_kv_events


@serve.deployment(name="Decode")
class Decode(EngineReplica):
    def __init__(self, config: dict, prefill: DeploymentHandle | None = None):
        cfg = ServeConfig.model_validate(config)
        self._start_telemetry(cfg)
        remote_prefill = None
        if prefill is not None:
            async def remote_prefill(req: GenerateRequest) -> PrefillResult:
                response = prefill.prefill.remote(req)
                try:
                    return await response
                except asyncio.CancelledError:
                    response.cancel()  # the client left: stop the prefill too
                    raise

        def make_importer(engine: LLMEngine):
            _, importer_cls = BACKENDS[cfg.transfer.backend]()
            kv = engine.kv_cache.kv
            return importer_cls(kv, layout_of(kv, Path(engine.config.model).name, engine.parallel.size))

        engine_config = cfg.engine_config(cfg.decode)
        self.ranks = None
        if engine_config.tensor_parallel_size > 1:  # ranks pull their own KV heads when there is a prefill pool
            self.ranks = RankWorkers(engine_config, cfg.transfer if prefill is not None else None)
        self.server = DecodeServer(engine_config, cfg.transfer, remote_prefill, make_importer,
                                   self.ranks and self.ranks.init_method, self.ranks and self.ranks.pull,
                                   self.metrics.pull, cfg.slo,
                                   pool_views.least_queued_tokens if prefill is not None else None)
        self.kv_events = start_kv_events(cfg, self.server.engine)
        self.outputs = OutputChannelServer(ray.util.get_node_ip_address(), self._abort)
        self._start_reporting(cfg)

    async def generate(self, req: GenerateRequest,
                       reply_to: str | None = None) -> AsyncIterator[RequestOutput | ChannelOffer | ChannelDone]:
        """The sequence's outputs; `reply_to` (a gateway id): over that gateway's output connection
        when it has one here, then one `ChannelDone`; otherwise here, after a `ChannelOffer`."""
        sink = self.outputs.sink(reply_to)
        if sink is None:
            if reply_to is not None:
                yield await self.outputs.offer()
            async with aclosing(self.server.generate(req)) as outs:
                async for out in outs:
                    yield out
            return
        num_outputs = 0

        def send(out: RequestOutput) -> None:  # from the engine's delivery, or below
            nonlocal num_outputs
            sink.send(req.request_id, out)
            num_outputs += 1

        sink.request_ids.add(req.request_id)
        try:
            async with aclosing(self.server.generate(req, send)) as outs:
                async for out in outs:  # what the engine did not forward: the first and last outputs
                    send(out)
        finally:
            sink.request_ids.discard(req.request_id)
        yield ChannelDone(sink.conn_id, num_outputs)

    def stats(self) -> dict:
        return {**super().stats(), "num_output_connections": self.outputs.num_connections}

    def _abort(self, request_ids) -> None:
        """Requests whose gateway connection closed: end them (frees their KV)."""
        for request_id in request_ids:
            self.server.engine.abort(request_id)

    def __del__(self):
        self._shutdown()
