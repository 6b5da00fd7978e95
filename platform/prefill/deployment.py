"""The `Prefill` Ray Serve deployment: a thin shell around `PrefillServer`."""

from __future__ import annotations

import ray
from ray import serve

from pdserve.config import ServeConfig
from pdserve.messages import GenerateRequest, PrefillResult
from pdserve.prefill.server import PrefillServer
from pdserve.rank_workers import RankWorkers
from pdserve.autoscale import autoscaling_stats
from pdserve.router.request_router import routing_stats, start_kv_events


def advertised_host(config: ServeConfig) -> str:
    """The address KV listeners give out: the node's IP as Ray sees it, unless configured."""
    return ray.util.get_node_ip_address() if config.transfer.host == "auto" else config.transfer.host


@serve.deployment(name="Prefill")
class Prefill:
    def __init__(self, config: dict):
        cfg = ServeConfig.model_validate(config)
        replica = serve.get_replica_context().replica_id.unique_id
        engine_config = cfg.engine_config(cfg.prefill)
        host = advertised_host(cfg)
        self.ranks = RankWorkers(engine_config, cfg.transfer, host) if engine_config.tensor_parallel_size > 1 else None
        self.server = PrefillServer(engine_config, cfg.transfer, f"prefill-{replica}", host,
                                    self.ranks and self.ranks.init_method, self.ranks and self.ranks.export)
        self.kv_events = start_kv_events(cfg, self.server.engine)
        # Leases outstanding at shutdown get this long to be pulled (within Serve's graceful timeout).
        self.drain_s = min(cfg.transfer.lease_s, 15.0)

    async def prefill(self, req: GenerateRequest) -> PrefillResult:
        return await self.server.prefill(req)

    def stats(self) -> dict:
        ranks = self.ranks.check() if self.ranks is not None else []
        return {**self.server.stats(), "node_id": ray.get_runtime_context().get_node_id(), "worker_ranks": ranks}

    def record_routing_stats(self) -> dict:
        return routing_stats(self.server.stats())

    def record_autoscaling_stats(self) -> dict:
        return autoscaling_stats(self.server.stats())

    def health(self) -> bool:
        return self.server.engine.is_healthy

    def check_health(self) -> None:  # Ray Serve replaces a replica whose check raises
        if not self.server.engine.is_healthy:
            raise RuntimeError("the prefill engine loop died")
        if not self.server.exporter.is_healthy:
            raise RuntimeError("the KV transfer listener died")
        if self.ranks is not None:
            self.ranks.check()

    def __del__(self):
        if self.kv_events is not None:
            self.kv_events.close()
        self.server.shutdown(drain_s=self.drain_s)
        if self.ranks is not None:
            self.ranks.close()
