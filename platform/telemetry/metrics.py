"""pdserve's Prometheus series, through `ray.util.metrics` (DESIGN.md section 3).

Every series is named `pdserve_*` and labelled by pool (gateway, prefill, decode, unified),
replica and model. Ray's metrics agent exports them with its own `ray_` prefix (counters also get
`_total`), so `pdserve_requests` is scraped as `ray_pdserve_requests_total`, next to Ray Serve's
series in the Ray dashboard's metrics view and in `deploy/grafana/pdserve.json`.

Where each is measured: the gateway counts requests by outcome and mid-stream migrations, and
times TTFT, inter-token latency and end-to-end latency per sequence; each engine replica
publishes its scheduler and KV figures every `telemetry.metrics_period_s` (gauges, and counters
advanced by the change in its cumulative figures) and times each KV pull; routers count their
decisions; the autoscaling policies count theirs in the Serve controller. Outside a Ray worker
the series are inert.
"""

from __future__ import annotations

import asyncio
import functools
from types import SimpleNamespace

from ray.util.metrics import Counter, Gauge, Histogram

TAGS = ("pool", "replica", "model")
# Seconds: from sub-millisecond inter-token gaps on small models to minute-long requests.
LATENCY_BOUNDARIES = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                      120.0]
OUTCOMES = ("ok", "invalid", "rejected", "overloaded", "timeout", "error", "aborted")


@functools.cache
def series() -> SimpleNamespace:
    """Every pdserve series, created once per process (Ray keys a metric by name and process)."""
    def counter(name, doc, *extra):
        return Counter(f"pdserve_{name}", description=doc, tag_keys=TAGS + extra)

    def gauge(name, doc, *extra):
        return Gauge(f"pdserve_{name}", description=doc, tag_keys=TAGS + extra)

    def histogram(name, doc):
        return Histogram(f"pdserve_{name}", description=doc, boundaries=LATENCY_BOUNDARIES, tag_keys=TAGS)

    return SimpleNamespace(
        # gateway
        requests=counter("requests", "API requests by outcome: " + ", ".join(OUTCOMES), "outcome"),
        prompt_tokens=counter("prompt_tokens", "Prompt tokens of finished requests."),
        generation_tokens=counter("generation_tokens", "Tokens generated for finished requests."),
        ttft=histogram("time_to_first_token_seconds", "Request arrival to a sequence's first token."),
        itl=histogram("inter_token_latency_seconds", "Gap between a sequence's successive tokens."),
        e2e=histogram("e2e_request_latency_seconds", "Request arrival to its last token."),
        migrations=counter("stream_migrations", "Sequences continued on another decode replica after theirs "
                                                "failed mid-stream (gateway.migration_limit)."),
        # engine replicas
        waiting_requests=gauge("waiting_requests", "Requests queued in the engine, not yet running."),
        waiting_tokens=gauge("waiting_prompt_tokens", "Prompt tokens queued for prefill."),
        running=gauge("running_sequences", "Sequences in the running batch."),
        kv_usage=gauge("kv_cache_usage", "Share of KV-cache blocks held by requests (0..1)."),
        kv_leases=gauge("kv_leases", "KV leases a prefill replica holds for decode replicas to pull."),
        open_kv_reads=gauge("open_kv_reads", "Reads of a prefill replica's leased KV blocks in flight."),
        open_kv_pulls=gauge("open_kv_pulls", "A decode replica's KV pulls in flight."),
        # what placement has measured (pdserve.decode.placement; a prefill replica's own rate)
        decode_step=gauge("placement_decode_step_seconds", "A decode replica's step that only decodes (moving "
                                                           "average)."),
        prefill_token=gauge("placement_prefill_token_seconds", "What one more prompt token adds to a decode "
                                                              "replica's step (moving average)."),
        remote_rate=gauge("placement_remote_prefill_tokens_per_second", "Prompt tokens a second prefill replicas "
                                                                       "compute, as a decode replica last heard."),
        remote_wait=gauge("placement_remote_prefill_wait_seconds", "What a decode replica's remote prefill calls "
                                                                   "take beyond computing the prompt tokens "
                                                                   "queued ahead and their own (moving average): "
                                                                   "hops, reports' age."),
        link_rate=gauge("placement_link_bytes_per_second", "KV bytes a second a decode replica pulls."),
        prefill_queue=gauge("placement_prefill_queued_tokens", "The prompt tokens a decode replica's remote "
                                                               "prefill sent now would wait behind, as its router "
                                                               "for the prefill pool sees them."),
        remote_margin=gauge("placement_remote_margin_seconds", "How much later than predicted remotely prefilled "
                                                               "first tokens come, at the SLO's percentile."),
        local_margin=gauge("placement_local_margin_seconds", "How much later than predicted locally prefilled "
                                                             "first tokens come, at the SLO's percentile."),
        prefill_rate=gauge("prefill_tokens_per_second", "Prompt tokens a second a prefill replica computes "
                                                        "(moving average of its steps)."),
        early_first_tokens=counter("early_first_tokens", "First tokens sent before their KV was pulled, where "
                                                         "waiting for the pull would miss the TTFT target."),
        local_prefills_for_target=counter("local_prefills_for_target", "Prompts a decode replica prefilled "
                                                                       "itself: the prefill pool would have missed "
                                                                       "the TTFT target."),
        in_flight_requests=gauge("in_flight_requests", "Calls a decode replica is serving (waiting on prefill, "
                                                       "pulling or decoding)."),
        prefix_hits=counter("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache."),
        prefix_queries=counter("prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache."),
        preemptions=counter("preemptions", "Requests preempted (recomputed later) for lack of KV blocks."),
        transfer_bytes=counter("kv_transfer_bytes", "KV-cache bytes pulled from prefill replicas."),
        transfer_failures=counter("kv_transfer_failures", "KV pulls that failed (the prompt is recomputed)."),
        transfer_seconds=histogram("kv_transfer_seconds", "Duration of one request's KV pull, all ranks."),
        leases_expired=counter("kv_leases_expired", "KV leases released by expiry instead of a pull."),
        # routers and autoscaler
        router_decisions=counter("router_decisions", "Placements: matched (longest prefix), spread (a shorter "
                                 "match for load), cold (no match), headroom (decode); by router mode.",
                                 "decision", "mode"),
        kv_events_rejected=counter("kv_events_rejected", "Redis KV-event entries a router skipped: version (another "
                                   "format), oversized (dropped unread), malformed.", "reason"),
        autoscaling_decisions=counter("autoscaling_decisions", "Policy decisions: up, down, hold.", "app",
                                      "direction"),
        autoscaling_target=gauge("autoscaling_target_replicas", "Replicas a pool's policy asks for.", "app"),
    )


# A gateway records inter-token gaps in batches. One `observe` per token as it arrived cost the
# gateway's event loop ~12 us per streamed token under load on 2 cores (each call ran cache-cold
# between the engine's threads; in a tight loop one costs 2.4 us), batched ~3 (RESULTS.md, #5).
# Prometheus scrapes seconds apart, so a quarter-second delay does not show.
ITL_BATCH_S = 0.25
ITL_BATCH_MAX = 512  # values: bounds one batch's time on the event loop (about a millisecond)


class GatewayMetrics:
    def __init__(self, replica: str, model: str):
        self.tags = {"pool": "gateway", "replica": replica, "model": model}
        self._itl: list[float] = []  # gaps not yet recorded

    def request(self, outcome: str, prompt_tokens: int = 0, generation_tokens: int = 0) -> None:
        s = series()
        s.requests.inc(1, tags={**self.tags, "outcome": outcome})
        if prompt_tokens:
            s.prompt_tokens.inc(prompt_tokens, tags=self.tags)
        if generation_tokens:
            s.generation_tokens.inc(generation_tokens, tags=self.tags)

    def first_token(self, seconds: float) -> None:
        series().ttft.observe(seconds, tags=self.tags)

    def inter_token(self, seconds: float) -> None:
        """Kept, and recorded with the others of the next ITL_BATCH_S (at once outside an event loop)."""
        self._itl.append(seconds)
        if len(self._itl) == 1:
            try:
                asyncio.get_running_loop().call_later(ITL_BATCH_S, self.flush)
            except RuntimeError:  # no event loop to flush later
                self.flush()
        elif len(self._itl) >= ITL_BATCH_MAX:
            self.flush()

    def flush(self) -> None:
        gaps, self._itl = self._itl, []
        itl, tags = series().itl, self.tags
        for s in gaps:
            itl.observe(s, tags=tags)

    def finished(self, seconds: float) -> None:
        series().e2e.observe(seconds, tags=self.tags)

    def migration(self) -> None:
        """A sequence moved to another decode replica after its own failed mid-stream."""
        series().migrations.inc(1, tags=self.tags)


# An engine replica's cumulative figures (its stats()) -> the counter each advances.
_COUNTED = {"num_prefix_hit_tokens": "prefix_hits", "num_prefix_query_tokens": "prefix_queries",
            "num_preemptions": "preemptions", "num_pulled_bytes": "transfer_bytes",
            "num_failed_pulls": "transfer_failures", "num_expired_kv_leases": "leases_expired",
            "num_early_first_tokens": "early_first_tokens",
            "num_local_prefills_for_target": "local_prefills_for_target"}


# What a replica holds now, by stats key: each must come back to 0 once its requests end.
_GAUGED = {"num_kv_leases": "kv_leases", "num_open_kv_reads": "open_kv_reads", "num_open_kv_pulls": "open_kv_pulls",
           "num_in_flight_requests": "in_flight_requests"}


# Rates a replica has measured, by stats key.
_MEASURED = {"placement_decode_step_s": "decode_step", "placement_prefill_token_s": "prefill_token",
             "placement_remote_tokens_per_s": "remote_rate", "placement_remote_wait_s": "remote_wait",
             "placement_link_bytes_per_s": "link_rate", "placement_remote_margin_s": "remote_margin",
             "placement_local_margin_s": "local_margin", "prefill_tokens_per_s": "prefill_rate",
             "placement_prefill_queued_tokens": "prefill_queue"}


class ReplicaMetrics:
    """An engine replica's series, from its stats() (call `publish` periodically) and its pulls."""

    def __init__(self, pool: str, replica: str, model: str):
        self.tags = {"pool": pool, "replica": replica, "model": model}
        self._last: dict[str, float] = {}

    def publish(self, stats: dict) -> None:
        s, tags = series(), self.tags
        s.waiting_requests.set(stats["num_waiting"], tags=tags)
        s.waiting_tokens.set(stats["queued_prefill_tokens"], tags=tags)
        s.running.set(stats["num_running"], tags=tags)
        s.kv_usage.set(stats["kv_usage"], tags=tags)
        for key, name in (*_GAUGED.items(), *_MEASURED.items()):
            if stats.get(key) is not None:  # (a rate not measured yet is None)
                getattr(s, name).set(stats[key], tags=tags)
        for key, name in _COUNTED.items():
            if key in stats:
                delta = stats[key] - self._last.get(key, 0)
                if delta > 0:
                    getattr(s, name).inc(delta, tags=tags)
                self._last[key] = stats[key]

    def pull(self, seconds: float) -> None:
        series().transfer_seconds.observe(seconds, tags=self.tags)


def router_decision(pool: str, replica: str, model: str, decision: str, mode: str) -> None:
    series().router_decisions.inc(1, tags={"pool": pool, "replica": replica, "model": model,
                                           "decision": decision, "mode": mode})


def kv_event_rejected(pool: str, model: str, reason: str) -> None:
    series().kv_events_rejected.inc(1, tags={"pool": pool, "replica": "", "model": model, "reason": reason})


def autoscaling_decision(pool: str, app: str, current: int, target: int) -> None:
    tags = {"pool": pool, "replica": "", "model": "", "app": app}
    direction = "up" if target > current else "down" if target < current else "hold"
    series().autoscaling_decisions.inc(1, tags={**tags, "direction": direction})
    series().autoscaling_target.set(target, tags=tags)
