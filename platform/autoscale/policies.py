"""Custom Ray Serve autoscaling policies (`AutoscalingConfig.policy`), one per pool.

Each is a callable class (Ray Serve passes `policy_kwargs` to the constructor) called on every
control-loop tick with Ray Serve's `AutoscalingContext`, returning the replicas it wants and its
state. Ray Serve then applies min/max, the up/down delays (scale up fast, down slowly) and the
scaling factors. The figures come from each replica's `record_autoscaling_stats`, averaged over
the look-back window (`ctx.aggregated_metrics[name][replica]`), plus the requests waiting in
callers' handles (`ctx.total_num_requests`), which a replica cannot see. Every decision is
counted (`pdserve_autoscaling_decisions`); only that, in the Serve controller, touches Ray.
"""

from __future__ import annotations

import logging
import math
from typing import Any


def _decided(ctx, target: int) -> tuple[int, dict[str, Any]]:
    from pdserve.telemetry.metrics import autoscaling_decision  # here: the policy runs in Serve's controller

    autoscaling_decision(ctx.deployment_name.lower(), ctx.app_name or "", ctx.current_num_replicas, target)
    return target, {}


def _total(ctx, name: str) -> float | None:
    per_replica = (ctx.aggregated_metrics or {}).get(name)
    return None if not per_replica else float(sum(per_replica.values()))


class _Policy:
    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        return _decided(ctx, self.wanted(ctx))

    def wanted(self, ctx) -> int:
        raise NotImplementedError


class PrefillQueuePolicy(_Policy):
    """Prefill pool: enough replicas that each has at most `target_queued_tokens` prompt tokens
    waiting to be computed, and at most `target_ongoing_requests` requests."""

    def __init__(self, target_queued_tokens: float = 4096, target_ongoing_requests: float = 8):
        self.target_queued_tokens = target_queued_tokens
        self.target_ongoing_requests = target_ongoing_requests

    def wanted(self, ctx) -> int:
        tokens = _total(ctx, "queued_prefill_tokens")
        if tokens is None:  # no report yet: keep what there is
            return ctx.current_num_replicas
        by_tokens = tokens / self.target_queued_tokens
        by_requests = ctx.total_num_requests / self.target_ongoing_requests
        return math.ceil(max(by_tokens, by_requests))


class DecodeLoadPolicy(_Policy):
    """Decode pool: enough replicas that each runs at most `target_running_sequences` and keeps
    its KV cache at most `target_kv_usage` full."""

    def __init__(self, target_running_sequences: float = 32, target_kv_usage: float = 0.7):
        self.target_running_sequences = target_running_sequences
        self.target_kv_usage = target_kv_usage

    def wanted(self, ctx) -> int:
        running, kv_usage = _total(ctx, "num_running"), _total(ctx, "kv_usage")
        if running is None or kv_usage is None:
            return ctx.current_num_replicas
        # Requests still queued in callers' handles will run too.
        sequences = max(running, ctx.total_num_requests)
        return math.ceil(max(sequences / self.target_running_sequences, kv_usage / self.target_kv_usage))


class UnifiedPolicy(_Policy):
    """Colocated pool: its replicas prefill and decode, so the larger of the two needs."""

    def __init__(self, target_queued_tokens: float = 4096, target_ongoing_requests: float = 8,
                 target_running_sequences: float = 32, target_kv_usage: float = 0.7):
        self.prefill = PrefillQueuePolicy(target_queued_tokens, target_ongoing_requests)
        self.decode = DecodeLoadPolicy(target_running_sequences, target_kv_usage)

    def wanted(self, ctx) -> int:
        return max(self.prefill.wanted(ctx), self.decode.wanted(ctx))


def _bounded(ctx, replicas: int) -> int:
    return max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, replicas))


def ratio_band(prefill: int, decode: int, min_ratio: float, max_ratio: float) -> tuple[int, int]:
    """Raise the pool that falls behind until prefill / decode lies in [min_ratio, max_ratio];
    neither pool gets fewer replicas than it asked for."""
    if decode and prefill < min_ratio * decode:
        prefill = math.ceil(min_ratio * decode - 1e-9)
    if prefill > max_ratio * decode:
        decode = math.ceil(prefill / max_ratio - 1e-9)
    return prefill, decode


class PoolRatioPolicy:
    """Application-level policy (Ray Serve's `autoscaling_policy` of an application) for a
    disaggregated app whose pools both autoscale: each pool's own policy decides, then the
    prefill:decode replica ratio is kept within [min_ratio, max_ratio] (`ratio_band`), so a burst
    of long prompts that grows prefill also grows decode for the sequences it will hand over, and
    the reverse. Ray Serve applies each pool's min/max and delays to the result."""

    def __init__(self, prefill: dict[str, float], decode: dict[str, float], min_ratio: float, max_ratio: float):
        self.prefill, self.decode = PrefillQueuePolicy(**prefill), DecodeLoadPolicy(**decode)
        self.min_ratio, self.max_ratio = min_ratio, max_ratio

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        by_name = {ctx.deployment_name: (dep_id, ctx) for dep_id, ctx in contexts.items()}
        if "Prefill" not in by_name or "Decode" not in by_name:  # a pool not registered yet: hold
            return {dep_id: ctx.current_num_replicas for dep_id, ctx in contexts.items()}, {}
        (p_id, p_ctx), (d_id, d_ctx) = by_name["Prefill"], by_name["Decode"]
        # The band holds between what the pools will run, so each pool's bounds come first.
        prefill, decode = ratio_band(_bounded(p_ctx, self.prefill.wanted(p_ctx)),
                                     _bounded(d_ctx, self.decode.wanted(d_ctx)), self.min_ratio, self.max_ratio)
        return {p_id: _decided(p_ctx, prefill)[0], d_id: _decided(d_ctx, decode)[0]}, {}


def _asked(ctx) -> int:
    """The replicas a pool has been asked for: those running (`current_num_replicas`) and those
    still starting (up to the last target)."""
    return max(ctx.current_num_replicas, ctx.target_num_replicas)


def _mean(ctx, name: str) -> float | None:
    per_replica = (ctx.aggregated_metrics or {}).get(name)
    return None if not per_replica else float(sum(per_replica.values()) / len(per_replica))


class JointSloPolicy:
    """Application-level policy for a disaggregated app with a latency target (`slo`): sizes the
    Prefill and Decode pools together within `max_total_replicas` (`pdserve.autoscale.joint`:
    prefill on its prompt-token load and TTFT attainment, decode on KV occupancy and ITL
    attainment, with hysteresis). Replaces the per-pool policies and `PoolRatioPolicy`.

    The figures come from the replicas' autoscaling stats (`autoscaling_stats`): prefill replicas'
    `queued_prefill_tokens`, `prefill_tokens_per_s` (a busy replica's rate) and
    `prompt_tokens_per_s` and `prompts_per_s` (what it computed over its last window, the pool's
    load, in tokens and in prompts); decode replicas' `kv_usage` and `num_running` (of
    `max_num_seqs` slots each), plus the requests waiting for a slot: in callers' handles
    (`total_num_requests` beyond those the replicas hold, `num_in_flight_requests`) and on the
    replicas (`num_waiting`: prompts, and requests prefilled elsewhere; not those with the prefill
    pool, which are its load), the requests they take a second (`requests_per_s`), hold
    (`num_in_flight_requests`) and how long they held those that ended (`residence_s`), and the
    KV's share of the bytes their steps read
    (`kv_read_share`: how much longer a step grows when the pool shrinks); the decode replicas'
    `ttft_attainment` / `itl_attainment` (the share within target over the window). Replicas
    asked for and not running yet (the last target beyond `current_num_replicas`) count as
    starting. A figure no replica reports counts as no signal: no load, no attainment to react
    to, steps that read weights only. Before the prefill pool has measured its rate,
    `prefill_tokens_per_s` stands in. `max_num_seqs` is the decode engine's; `replica_start_s`
    how long a new replica takes to serve (a backlog is cleared within it) until the policy has
    seen one start (`joint.StartClock`). Ray Serve applies each pool's min/max and delays to the
    result."""

    def __init__(self, ttft_ms: float, itl_ms: float, percentile: float, max_total_replicas: int,
                 downscale_delay_s: float = 30.0, prefill_tokens_per_s: float = 1000.0, replica_start_s: float = 0.0,
                 max_num_seqs: int = 256):
        from pdserve.autoscale.joint import JointScaler, Slo

        self.scaler = JointScaler(Slo(ttft_ms / 1000, itl_ms / 1000, percentile), max_total_replicas,
                                  downscale_delay_s, replica_start_s)
        self.max_num_seqs = max_num_seqs
        self.prefill_tokens_per_s = prefill_tokens_per_s

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        import time

        from pdserve.autoscale.joint import DecodeSignal, PrefillSignal

        by_name = {ctx.deployment_name: (dep_id, ctx) for dep_id, ctx in contexts.items()}
        if "Prefill" not in by_name or "Decode" not in by_name:  # a pool not registered yet: hold
            return {dep_id: ctx.current_num_replicas for dep_id, ctx in contexts.items()}, {}
        (p_id, p_ctx), (d_id, d_ctx) = by_name["Prefill"], by_name["Decode"]
        rate = _mean(p_ctx, "prefill_tokens_per_s") or self.prefill_tokens_per_s
        prefill = PrefillSignal(_asked(p_ctx), _total(p_ctx, "queued_prefill_tokens") or 0.0,
                                _total(p_ctx, "prompt_tokens_per_s") or 0.0, rate,
                                _mean(d_ctx, "ttft_attainment"), _asked(p_ctx) - p_ctx.current_num_replicas,
                                _total(p_ctx, "prompts_per_s"))
        running = _total(d_ctx, "num_running") or 0.0
        held = _total(d_ctx, "num_in_flight_requests") or 0.0
        slots = max(d_ctx.current_num_replicas, 1) * self.max_num_seqs
        waiting = max(0.0, d_ctx.total_num_requests - max(held, running)) + (_total(d_ctx, "num_waiting") or 0.0)
        decode = DecodeSignal(_asked(d_ctx), _mean(d_ctx, "kv_usage") or 0.0,
                              _mean(d_ctx, "itl_attainment"), running / slots, waiting, self.max_num_seqs,
                              _asked(d_ctx) - d_ctx.current_num_replicas, _total(d_ctx, "requests_per_s"),
                              _mean(d_ctx, "residence_s"), held, _mean(d_ctx, "kv_read_share") or 0.0)
        p, d = self.scaler.decide(prefill, decode, time.monotonic(), p_ctx.capacity_adjusted_max_replicas,
                                  d_ctx.capacity_adjusted_max_replicas)
        targets = (_bounded(p_ctx, p), _bounded(d_ctx, d))
        if targets != (prefill.num_replicas, decode.num_replicas):  # what it saw, in the controller's log
            logging.getLogger("ray.serve").info(
                "JointSloPolicy: prefill %d -> %d (%s), decode %d -> %d (%s), replica start %.1f s",
                prefill.num_replicas, targets[0], prefill, decode.num_replicas, targets[1], decode,
                self.scaler.starts.seconds)
        return {p_id: _decided(p_ctx, targets[0])[0], d_id: _decided(d_ctx, targets[1])[0]}, {}
