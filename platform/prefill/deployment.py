"""The `Prefill` Ray Serve deployment: a thin shell around `PrefillServer`."""

from __future__ import annotations

import ray
from ray import serve

from pdserve.config import ServeConfig
from pdserve.protocol import GenerateRequest, PrefillResult
from pdserve.prefill.server import PrefillServer
from pdserve.replica.engine_replica import EngineReplica
from pdserve.replica.rank_workers import RankWorkers
from pdserve.router.request_router import start_kv_events


def advertised_host(config: ServeConfig) -> str:
    """The address KV listeners give out: the node's IP as Ray sees it, unless configured."""
    return ray.util.get_node_ip_address() if config.transfer.host == "auto" else config.transfer.host


@serve.deployment(name="Prefill")
class Prefill(EngineReplica):
    drain_s = 0.0

    def __init__(self, config: dict):
        cfg = ServeConfig.model_validate(config)
        self._start_telemetry(cfg)
        replica = serve.get_replica_context().replica_id.unique_id
        engine_config = cfg.engine_config(cfg.prefill)
        host = advertised_host(cfg)
        self.ranks = RankWorkers(engine_config, cfg.transfer, host) if engine_config.tensor_parallel_size > 1 else None
        self.server = PrefillServer(engine_config, cfg.transfer, f"prefill-{replica}", host,
                                    self.ranks and self.ranks.init_method, self.ranks and self.ranks.export)
        self.kv_events = start_kv_events(cfg, self.server.engine)
        self._start_reporting(cfg)
        # Leases outstanding at shutdown get this long to be pulled (within Serve's graceful timeout).
        self.drain_s = min(cfg.transfer.lease_s, 15.0)

    async def prefill(self, req: GenerateRequest) -> PrefillResult:
        return await self.server.prefill(req)

    def check_health(self) -> None:
        super().check_health()
        if not self.server.exporter.is_healthy:
            raise RuntimeError("the KV transfer listener died")

    def __del__(self):
        self._shutdown(drain_s=self.drain_s)
