"""What every engine replica (Prefill, Decode, Unified) answers Ray Serve, whatever its role: its
figures for operators, routers and the autoscaler, and its health. The deployment classes set
`server` (a PrefillServer or DecodeServer), `ranks` (RankWorkers or None) and `kv_events`."""

from __future__ import annotations

import ray

from pdserve.autoscale import autoscaling_stats
from pdserve.router.request_router import routing_stats


class EngineReplica:
    server = ranks = kv_events = None

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
            raise RuntimeError("the engine loop died")
        if self.ranks is not None:
            self.ranks.check()

    def _shutdown(self, **server_options) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        if self.server is not None:
            self.server.shutdown(**server_options)
        if self.ranks is not None:
            self.ranks.close()
