"""The Ray Serve glue: pdserve's routers as `RequestRouter`s (DESIGN.md section 3).

They run inside every caller of a pool (no central actor on the request path): `PrefixAwareRouter`
on the Prefill (and colocated Unified) pool, `KVHeadroomRouter` on the Decode pool. The first
reads a `KVEventIndex` fed by the pool's KV-event stream; both read the figures each replica's
`record_routing_stats` reports, plus what this router itself has in flight to each replica
(reports are periodic; in-flight accounting covers the gap between them).

`request_router_kwargs` (JSON, see `pdserve.app`): redis_url, stream, block_size, queue_weight,
approx_ttl_s, ttft_s (the SLO's, on the pools the gateway calls: requests waiting for a replica
with room are taken late ones last, `policy.LateLast`), and pool and model (metric labels). Each
placement is counted (`pdserve_router_decisions`) and traced (a `pdserve.route` span in the
request's trace).
The replica side (publishing KV events, reporting routing stats) is here too: `start_kv_events`
and `routing_stats`, called by the pool deployments.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

from ray import serve
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pdserve.config import ServeConfig
from pdserve.protocol import GenerateRequest
from pdserve.engine.block_hash import block_hashes, root_hash
from pdserve.router import pool_views
from pdserve.router.kv_events import KVEventIndex, KVEventPublisher, stream_name
from pdserve.router.policy import DEFAULT_QUEUE_WEIGHT, DecodeLoad, InFlight, LateLast, rank_decode, rank_prefill
from pdserve.telemetry.metrics import kv_event_rejected, router_decision
from pdserve.telemetry.tracing import span

log = logging.getLogger(__name__)


def _request_of(pending: PendingRequest | None) -> GenerateRequest | None:
    if pending is None:
        return None
    for arg in pending.args:
        if isinstance(arg, GenerateRequest):
            return arg
    return None


class _PdserveRouter(RequestRouter):
    """Shared plumbing: replica ids, in-flight accounting, ranks out of an ordering."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._in_flight = InFlight()
        self._block_size = int(kwargs.get("block_size", 16))
        self._pool, self._model = kwargs.get("pool", ""), kwargs.get("model", "")
        ttft_s = kwargs.get("ttft_s")  # the pools clients wait on, under an SLO: late requests last
        self._late = LateLast(float(ttft_s), lambda pending: pending.created_at) if ttft_s else None

    def _get_next_pending_request_to_route(self) -> PendingRequest | None:
        # Ray Serve's routing tasks take the waiting requests one at a time, oldest first; with a
        # TTFT target, those past it go after the others (policy.LateLast).
        if self._late is None:
            return super()._get_next_pending_request_to_route()
        while queue := self._late.next_queue(self._pending_requests_to_route, time.time()):
            pending = queue.popleft()
            if not pending.future.done():
                return pending
        return None

    def _record(self, req: GenerateRequest, replica: str, decision: str, mode: str, **attributes: Any) -> None:
        router_decision(self._pool, replica, self._model, decision, mode)
        with span("pdserve.route", req.trace_context, pool=self._pool, replica=replica, decision=decision,
                  mode=mode, **attributes):
            pass

    def _ranks(self, order: list[str], by_id: dict[str, RunningReplica]) -> list[list[RunningReplica]]:
        # One replica per rank: Ray Serve tries them in our order, skipping full ones.
        return [[by_id[r]] for r in order]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._in_flight.finish(internal_request_id, replica_id.unique_id)

    # Ray Serve (2.60) indexes pending requests by `internal_request_id`, which every sub-call of
    # one HTTP request shares: two concurrent calls (n > 1 fans out) leave the second unroutable
    # and its routing task spinning. Routers without FIFOMixin hit it; index by the request itself.
    def _add_pending_request_to_indices(self, pending_request: PendingRequest) -> None:
        self._pending_requests_by_id[id(pending_request.metadata)] = pending_request

    def _remove_pending_request_from_indices(self, pending_request: PendingRequest) -> None:
        self._pending_requests_by_id.pop(id(pending_request.metadata), None)

    def _get_pending_request_matching_internal_request_id(self, request_metadata=None) -> PendingRequest | None:
        pr = self._pending_requests_by_id.get(id(request_metadata)) if request_metadata is not None else None
        return pr if pr is not None and not pr.future.done() else None

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._replicas_changed({r.replica_id.unique_id for r in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._replicas_changed({r.unique_id for r in self.curr_replicas})

    def _replicas_changed(self, ids: set[str]) -> None:
        self._in_flight.forget_replicas(ids)


UNREPORTED_MAX_BLOCKS = 1_000_000  # blocks indexed for a replica that has not reported its cache's size yet


class PrefixAwareRouter(_PdserveRouter):
    """Prefill placement: least `uncached prompt tokens + queue_weight x queued prefill tokens`."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self._queue_weight = float(kwargs.get("queue_weight", DEFAULT_QUEUE_WEIGHT))
        # A replica's blocks are indexed up to what its cache holds, as it reports in its routing
        # stats; until its first report, up to UNREPORTED_MAX_BLOCKS.
        self._capacity: dict[str, int] = {}
        self._index = KVEventIndex(kwargs.get("redis_url"), kwargs.get("stream", "pdserve:kv-events"),
                                   UNREPORTED_MAX_BLOCKS,
                                   approx_ttl_s=float(kwargs.get("approx_ttl_s", 120.0)),
                                   password_env=kwargs.get("redis_password_env"),
                                   on_reject=partial(kv_event_rejected, self._pool, self._model)).start()
        log.info("prefix-aware router for %s: %s mode", kwargs.get("stream"), self._index.mode)
        pool_views.routers[self._pool] = self

    def _queued(self, replica: RunningReplica) -> float:
        """The replica's queued prompt tokens: its last report corrected by what this router sent
        and saw finish since."""
        stats = replica.routing_stats
        return self._in_flight.estimate(replica.replica_id.unique_id, stats.get("queued_prefill_tokens"),
                                        stats.get("time"))

    def least_queued_tokens(self) -> float | None:
        """What a prompt routed now waits behind at best (None: no replica). Called from the
        decode replica's loop while this router runs on its own: it reads a copy of the replicas."""
        replicas = list(self.curr_replicas.values())
        return min(map(self._queued, replicas)) if replicas else None

    def _replicas_changed(self, ids: set[str]) -> None:
        super()._replicas_changed(ids)
        self._index.set_replicas(ids)
        self._capacity = {r: n for r, n in self._capacity.items() if r in ids}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        req = _request_of(pending_request)
        if req is None:  # not a generate call (health, stats): any replica
            return [candidate_replicas]
        hashes = block_hashes(req.prompt_token_ids, self._block_size, root_hash(req.params.cache_salt))
        ids = list(by_id)
        matched = self._index.match(hashes, ids)
        queued = {}
        for r in ids:
            stats = by_id[r].routing_stats
            queued[r] = self._queued(by_id[r])
            if "num_kv_blocks" in stats and self._capacity.get(r) != stats["num_kv_blocks"]:
                self._capacity[r] = int(stats["num_kv_blocks"])
                self._index.set_capacity(r, self._capacity[r])
        n = len(req.prompt_token_ids)
        order = rank_prefill(ids, n, matched, queued, self._block_size, self._queue_weight)
        best = order[0]
        self._in_flight.add(id(pending_request.metadata), pending_request.metadata.internal_request_id, best,
                            n - min(matched[best] * self._block_size, n - 1))
        self._index.record_placement(best, hashes)
        longest = max(matched.values(), default=0)
        decision = "cold" if longest == 0 else "matched" if matched[best] == longest else "spread"
        self._record(req, best, decision, self._index.mode, matched_blocks=matched[best], longest_match=longest)
        return self._ranks(order, by_id)


class KVHeadroomRouter(_PdserveRouter):
    """Decode placement: most KV headroom after the request, then fewest running sequences."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        req = _request_of(pending_request)
        if req is None:
            return [candidate_replicas]
        needed = -(-(len(req.prompt_token_ids) + req.params.max_tokens) // self._block_size)
        loads = {}
        for r, replica in by_id.items():
            stats = replica.routing_stats
            if "num_kv_blocks" in stats:
                # The replica's report may predate what this router sent since: take the larger.
                total = int(stats["num_kv_blocks"])
                used = max(total - int(stats["num_free_kv_blocks"]), int(self._in_flight.total(r)))
                loads[r] = DecodeLoad(total - used, total, int(stats.get("num_running", 0)))
        order = rank_decode(list(by_id), loads, needed)
        self._in_flight.add(id(pending_request.metadata), pending_request.metadata.internal_request_id, order[0],
                            needed)
        self._record(req, order[0], "headroom", "load", blocks_needed=needed)
        return self._ranks(order, by_id)


# ---- the replica side

def start_kv_events(cfg: ServeConfig, engine) -> KVEventPublisher | None:
    """Publish this replica's KV events for the routers, when a Redis is configured."""
    if not cfg.router.redis_url:
        return None
    ctx = serve.get_replica_context()
    return KVEventPublisher.for_engine(engine, cfg.router.redis_url, stream_name(cfg.name, ctx.deployment),
                                       ctx.replica_id.unique_id, cfg.router.redis_password_env)


def routing_stats(stats: dict) -> dict:
    """The figures pdserve's routers read (Ray Serve calls `record_routing_stats` periodically)."""
    keys = ("queued_prefill_tokens", "num_running", "num_kv_blocks", "num_free_kv_blocks")
    return {**{k: stats[k] for k in keys}, "time": time.time()}
