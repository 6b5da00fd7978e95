"""The `Decode` Ray Serve deployment (also the colocated `Unified` pool, with no prefill pool)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from pdserve.config import ServeConfig
from pdserve.decode.server import DecodeServer
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.kvtransfer import BACKENDS, layout_of
from pdserve.messages import GenerateRequest, PrefillResult
from pdserve.rank_workers import RankWorkers
from pdserve.replica import EngineReplica
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
                                   cfg.remote_prefill_min_tokens, self.ranks and self.ranks.init_method,
                                   self.ranks and self.ranks.pull, self.metrics.pull)
        self.kv_events = start_kv_events(cfg, self.server.engine)
        self._start_reporting(cfg)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        async for out in self.server.generate(req):
            yield out

    def __del__(self):
        self._shutdown()
