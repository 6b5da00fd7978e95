"""What every engine replica (Prefill, Decode, Unified) answers Ray Serve, whatever its role: its
figures for operators, routers and the autoscaler, its metrics and status line, and its health.
The deployment classes set `server` (a PrefillServer or DecodeServer), `ranks` (RankWorkers or
None) and `kv_events`, between `_start_telemetry` and `_start_reporting`."""

from __future__ import annotations

import os

import ray
from ray import serve

from pdserve.autoscale import autoscaling_stats
from pdserve.config import ServeConfig
from pdserve.router.request_router import routing_stats
from pdserve.telemetry.metrics import ReplicaMetrics
from pdserve.telemetry.status import ReplicaReporter
from pdserve.telemetry.tracing import flush_traces, setup_tracing


class EngineReplica:
    server = ranks = kv_events = metrics = reporter = None

    def _start_telemetry(self, cfg: ServeConfig) -> None:
        ctx = serve.get_replica_context()
        setup_tracing(cfg.telemetry, ctx.deployment.lower())
        self.metrics = ReplicaMetrics(ctx.deployment.lower(), ctx.replica_id.unique_id, cfg.served_model_name)

    def _start_reporting(self, cfg: ServeConfig) -> None:
        """Metrics and the `pdserve status` line, every `telemetry.metrics_period_s` (server running)."""
        ctx = serve.get_replica_context()
        self.reporter = ReplicaReporter(ctx.app_name, ctx.deployment, ctx.replica_id.unique_id, self.server.stats,
                                        self.metrics, cfg.telemetry.metrics_period_s)

    def stats(self) -> dict:
        ranks = self.ranks.check() if self.ranks is not None else []
        return {**self.server.stats(), "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "worker_ranks": ranks}

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
        if self.reporter is not None:
            self.reporter.close()
        flush_traces()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.server is not None:
            self.server.shutdown(**server_options)
        if self.ranks is not None:
            self.ranks.close()
