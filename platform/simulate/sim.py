"""`Simulation`: a discrete-event run of a pdserve deployment on a simulated clock.

In: a `SimConfig` (model, each pool's accelerator, size and TP degree, the SLO, engine limits,
optional joint autoscaling) and requests in arrival order (workload.py). Out: a result dict: p50 /
p99 (and the SLO's percentile) TTFT, ITL and TPOT, SLO attainment, goodput, replica-seconds per
pool, placement decisions by reason, and the run's own cost (events, wall seconds, the ratio of
simulated to real time).

A request's way, as in the app (DESIGN.md section 2): the decode router picks a decode replica
(`DecodeRouter`, `rank_decode`) among those with room (fewer than `max_ongoing_requests`
requests); with none, the request waits until a replica has room or starts (as requests wait in
Ray Serve's handles), taken oldest first, those already past the TTFT target last (as pdserve's
routers take them). The replica looks up the prefix it caches and
asks `pdserve.decode.placement.place` with its own `CostModel`'s rates where to prefill; a remote
prompt goes to the prefill replica `PrefillRouter` picks (`rank_prefill` over the `RadixIndex`),
then the decode replica reserves its blocks (none free: it recomputes the prompt itself), its KV
crosses the link (uncached tokens x KV bytes / link bandwidth) and it joins the decode batch once
a sequence slot is free; a local one is prefilled in the decode replica's own steps, in the
chunks and after the pause placement chose (replicas.py: what the engine holds, when). The
first token goes out as the request joins the batch; each decode step adds one. With no prefill
pool (colocated) every prompt is prefilled locally, in chunks of the step budget.

Autoscaling (`AutoscaleSpec`): every tick the joint policy (`pdserve.autoscale.joint`) sees the
tick's window and sets each pool's size; new replicas take `replica_start_s` to start, removed
ones drain (no new requests; they go once idle, checked each tick). Replica-seconds count from a
replica's request to its removal.

On one shared host (`SimConfig.host`, the cpu profile's machine as the real app runs on it):
each request reaches the decode router the local path's delay after it arrives, a remote
prefill's KV joins what the remote path adds after its pull (the path's latency outside the
engines: `Host.local_delay_s`, `remote_delay_s`), each replica's own Python lengthens its steps,
and the steps stretch when the engines and the path's CPU use ask for more than the host's cores
(`SharedCores`).

Events: one per engine step per replica, one per request arrival, prefill completion and KV
pull, one per autoscaling tick; nothing per token.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
import random
import time
from dataclasses import dataclass, replace
from typing import Iterable

from pdserve.autoscale.joint import DecodeSignal, JointScaler, PrefillSignal, Slo
from pdserve.config import default_max_ongoing_requests
from pdserve.decode.placement import Load, Target, kv_read_share, place
from pdserve.router.policy import DEFAULT_QUEUE_WEIGHT, LateLast
from pdserve.router.radix_index import RadixIndex
from pdserve.simulate.hardware import Accelerator, Host
from pdserve.simulate.model import ModelSpec
from pdserve.simulate.replicas import Req, SharedCores, SimDecode, SimPrefill
from pdserve.simulate.roofline import StepCost
from pdserve.simulate.routing import DecodeRouter, PrefillRouter
from pdserve.simulate.stats import LogHistogram, Window
from pdserve.simulate.workload import SimRequest


@dataclass(frozen=True)
class PoolSpec:
    accelerator: Accelerator
    num_replicas: int
    tp: int = 1


@dataclass(frozen=True)
class AutoscaleSpec:
    max_total_replicas: int
    tick_s: float = 5.0  # the policy's control period and look-back window
    downscale_delay_s: float = 30.0
    replica_start_s: float = 30.0  # how long a new replica takes (the policy measures it, from this prior)
    # Each pool's own (min_replicas, max_replicas), applied to the policy's decision as Ray Serve
    # applies a deployment's; None: from 1 to the budget.
    prefill_bounds: tuple[int, int] | None = None
    decode_bounds: tuple[int, int] | None = None

    def bounds(self, pool: str) -> tuple[int, int]:
        return (self.prefill_bounds if pool == "prefill" else self.decode_bounds) or (1, self.max_total_replicas)


@dataclass(frozen=True)
class SimConfig:
    model: ModelSpec
    decode: PoolSpec
    prefill: PoolSpec | None  # None: colocated (the decode pool prefills every prompt)
    slo: Slo
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_ongoing_requests: int | None = None  # the decode pool's; None: config.py's default for max_num_seqs
    split_prompts_to_fill_steps: bool = True  # the engine option: off, a prompt that would not finish starts alone
    queue_weight: float = DEFAULT_QUEUE_WEIGHT
    seed: int = 0
    autoscale: AutoscaleSpec | None = None
    host: Host | None = None  # every replica on this one machine; None: each owns its accelerator


def num_kv_blocks(model: ModelSpec, pool: PoolSpec, block_size: int) -> int:
    kv_bytes = pool.accelerator.kv_cache_bytes_for(model.weight_bytes, pool.tp)
    blocks = int(kv_bytes // (model.kv_bytes_per_token * block_size))
    if blocks < 1:
        raise ValueError(f"{model.name} does not fit on {pool.accelerator.name} x{pool.tp}: no memory left for KV")
    return blocks


class Simulation:
    def __init__(self, config: SimConfig):
        self.config = c = config
        self.rng = random.Random(c.seed)
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.target = Target(c.slo.ttft_s, c.slo.itl_s)
        self.kv_bytes = c.model.kv_bytes_per_token
        pools = [c.decode] + ([c.prefill] if c.prefill else [])
        self.link_bytes_per_s = min(p.accelerator.link_bytes_per_s for p in pools)
        self.cores = SharedCores(c.host) if c.host else None
        self.prefill_router = PrefillRouter(c.block_size, self.rng, c.queue_weight)
        self.decode_router = DecodeRouter(self.rng)
        self.decode_index = RadixIndex()  # what each decode replica's prefix cache holds
        self._costs = {"decode": StepCost(c.model, c.decode.accelerator, c.decode.tp)}
        self._blocks = {"decode": num_kv_blocks(c.model, c.decode, c.block_size)}
        if c.prefill:
            self._costs["prefill"] = StepCost(c.model, c.prefill.accelerator, c.prefill.tp)
            self._blocks["prefill"] = num_kv_blocks(c.model, c.prefill, c.block_size)
        self.pools: dict[str, list] = {"prefill": [], "decode": []}  # provisioned, not draining
        self.draining: list = []
        self.retired: list = []  # drained and removed
        self.lifetimes: list[tuple[str, float, float]] = []  # (pool, requested at, removed at)
        self._counts = {"prefill": 0, "decode": 0}
        self.replica_seconds = {"prefill": 0.0, "decode": 0.0}
        self._counted_at = 0.0
        self._names = itertools.count()
        self._prefix_hashes: dict = {}
        self._next_hash = 1
        # what the run saw
        self.ttft, self.itl, self.tpot = LogHistogram(), LogHistogram(), LogHistogram()
        self.window = Window()
        self.pending: deque[Req] = deque()  # arrived, waiting for a decode replica with room
        self.late = LateLast(c.slo.ttft_s, lambda req: req.arrival)  # of those, the ones past the TTFT target
        self.num_arrived = self.num_finished = self.num_good = 0
        self.finish_counts = bytearray()  # per request id: how many times it finished
        self.placements: dict[str, int] = {}
        self.num_recomputed = 0  # remote prefills whose decode replica had no blocks for the pull
        self.start_s = self.end_s = 0.0  # the measured run's (after any warm-up)
        self.num_events = 0
        self._arrivals = None
        self.scaler = (JointScaler(c.slo, c.autoscale.max_total_replicas, c.autoscale.downscale_delay_s,
                                   c.autoscale.replica_start_s)
                       if c.autoscale else None)
        self._prefill_rate = 0.0  # a full step's prompt tokens a second, until the window measures it
        if c.prefill:
            budget = c.max_num_batched_tokens
            self._prefill_rate = budget / self._costs["prefill"].seconds(budget, budget, budget ** 2 / 2)
        for _ in range(c.prefill.num_replicas if c.prefill else 0):
            self._add_replica("prefill", 0.0, started=True)
        for _ in range(c.decode.num_replicas):
            self._add_replica("decode", 0.0, started=True)

    # ---- the event loop

    def at(self, t: float, fn, arg) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, arg))

    def run(self, requests: Iterable[SimRequest], progress=None, warmup: Iterable[SimRequest] = ()) -> dict:
        """Run to the last request's end; `progress(simulated_s)` is called every few thousand events.

        `warmup`: requests served one at a time before `requests`, as a benchmark warms an app up
        (benchmarks/serving.py sends one): the replicas keep what their cost models and caches
        learned from them, and the result starts after them (`requests`' arrival times count from
        the last one's end)."""
        started = time.perf_counter()
        warmup = list(warmup)
        for s in warmup:
            self._serve(iter([replace(s, arrival_s=self.now)]), None)
        if warmup:
            self._measure_from(t0 := self.now)
            requests = (replace(s, arrival_s=t0 + s.arrival_s) for s in requests)
        if self.scaler:
            self.at(self.now + self.config.autoscale.tick_s, self._tick, None)
        self._serve(iter(requests), progress)
        self._count(self.end_s)
        for pool in ("prefill", "decode"):
            for r in self.pools[pool]:
                self.lifetimes.append((pool, r.started_s, self.end_s))
        for r in self.draining:
            self.lifetimes.append((r.pool, r.started_s, self.end_s))
        return self.result(time.perf_counter() - started)

    def _serve(self, arrivals, progress) -> None:
        """Run the events until every one of `arrivals` has arrived and finished."""
        self._arrivals = arrivals
        self._next_arrival()
        events, pop = self._events, heapq.heappop
        n = 0
        while events:
            t, _, fn, arg = pop(events)
            self.now = t
            fn(t, arg)
            n += 1
            if self._arrivals is None and self.num_finished == self.num_arrived:
                break
            if progress is not None and not n & 4095:
                progress(t - self.start_s)
        self.num_events += n

    def _measure_from(self, now: float) -> None:
        """What the result reports counts from `now` (the warm-up's requests all finished)."""
        self._count(now)
        self.replica_seconds = dict.fromkeys(self.replica_seconds, 0.0)
        for r in self.pools["prefill"] + self.pools["decode"]:
            r.started_s = now
        self.ttft, self.itl, self.tpot = LogHistogram(), LogHistogram(), LogHistogram()
        self.window, self.placements, self.num_recomputed = Window(), {}, 0
        self.num_arrived = self.num_finished = self.num_good = 0  # request ids start again
        self.finish_counts = bytearray()
        self.start_s = self.end_s = now

    def _next_arrival(self) -> None:
        nxt = next(self._arrivals, None)
        if nxt is None:
            self._arrivals = None
        else:
            self.at(nxt.arrival_s, self._arrive, nxt)

    # ---- a request's way

    def _arrive(self, now: float, s: SimRequest) -> None:
        req = Req(self.num_arrived, now, s.prompt_tokens, s.output_tokens, s.prefix_id, s.prefix_tokens,
                  -(-(s.prompt_tokens + s.output_tokens) // self.config.block_size))
        self.num_arrived += 1
        self.finish_counts.append(0)
        self._next_arrival()
        host = self.config.host
        if host is None:
            self._enter(now, req)
            return
        self.cores.spend(host.request_cpu_s, now)
        self.at(now + host.local_delay_s(req.prompt, self._most_cached(req)), self._enter, req)

    def _enter(self, now: float, req: Req) -> None:
        self.pending.append(req)
        self.route_pending(now)

    def route_pending(self, now: float) -> None:
        """Route waiting requests while the decode router's choice can admit them (else they wait
        in the callers' handles, as Ray Serve queues past max_ongoing_requests), in the order the
        app's routers take them (`LateLast`: oldest first, those past the TTFT target last)."""
        while queue := self.late.next_queue(self.pending, now):
            d = self.decode_router.choose(queue[0].blocks)
            if d is None:
                return
            d.route(queue.popleft(), now)

    def _most_cached(self, req: Req) -> int:
        """The most of the prompt any decode replica holds cached: the path's cost is charged as the
        request comes in, before a replica is chosen (one replica a pool where it is measured)."""
        hashes = self._hashes(req)
        if not hashes:
            return 0
        matched = max(self.decode_index.match(hashes).values(), default=0)
        return min(matched * self.config.block_size, req.prompt - 1)

    def _hashes(self, req: Req) -> tuple:
        if req.prefix_id is None:
            return ()
        hashes = self._prefix_hashes.get(req.prefix_id)
        if hashes is None:
            n = req.prefix_tokens // self.config.block_size
            hashes = self._prefix_hashes[req.prefix_id] = tuple(range(self._next_hash, self._next_hash + n))
            self._next_hash += n
        return hashes

    def place_prefill(self, req: Req, d: SimDecode, now: float) -> None:
        """`d` took the request: place its prefill."""
        hashes = self._hashes(req)
        if hashes:
            matched = self.decode_index.match(hashes, (d.name,))[d.name]
            req.uncached = req.prompt - min(matched * self.config.block_size, req.prompt - 1)
        if not self.prefill_router.num_replicas:  # colocated, or no prefill replica started: plain chunked prefill here
            self._placed("local", "no prefill pool")
            d.prefill_locally(req, 0, now, now)
            return
        ahead = self.prefill_router.least_queued_tokens()
        p = place(Load(req.uncached, ahead, d.local_queued_tokens, d.num_running, self.kv_bytes,
                       self.config.max_num_batched_tokens), d.cm.rates(), self.target)
        self._placed(p.where, p.reason)
        req.placed = (p.where, p.expected_ttft_s, now)
        if p.where == "local":
            d.prefill_locally(req, p.chunk_tokens, now + p.pause_s, now)
            return
        d.remote_queued_tokens += req.uncached
        req.ahead, req.dispatched = ahead + req.uncached, now
        prefill, num_tokens = self.prefill_router.choose(req.prompt, req.prefix_id, hashes)
        self.window.prompt_tokens += num_tokens
        self.window.num_prompts += 1
        prefill.enqueue(req, num_tokens, now)

    def _placed(self, where: str, reason: str) -> None:
        key = f"{where}: {reason}"
        self.placements[key] = self.placements.get(key, 0) + 1

    def prefill_done(self, req: Req, prefill: SimPrefill, now: float) -> None:
        d = req.decode
        d.remote_queued_tokens -= req.uncached
        d.cm.remote_prefill(req.ahead, now - req.dispatched, prefill.prefill_rate.value)
        if not d.reserve(req):  # no blocks for the pull: the prompt is recomputed on the decode replica
            self.num_recomputed += 1
            req.placed = None  # (not the path predicted: no error to learn from)
            d.prefill_locally(req, 0, now, now)
            return
        req.pull_bytes = req.uncached * self.kv_bytes
        delay = self.config.host.remote_delay_s(req.prompt, req.prompt - req.uncached) if self.config.host else 0.0
        self.at(now + req.pull_bytes / self.link_bytes_per_s + delay, self._pulled, req)

    def _pulled(self, now: float, req: Req) -> None:
        d = req.decode
        d.cm.pull(req.pull_bytes, req.pull_bytes / self.link_bytes_per_s)
        self._cache_prefix(req, d)
        d.join(req, now)

    def local_prefill_done(self, req: Req, d: SimDecode, now: float) -> None:
        self._cache_prefix(req, d)

    def _cache_prefix(self, req: Req, d: SimDecode) -> None:
        hashes = self._hashes(req)
        if hashes:
            self.decode_index.insert(d.name, hashes)

    def first_token(self, req: Req, now: float) -> None:
        req.first = now
        if req.placed is not None:
            where, expected_s, at = req.placed
            req.decode.cm.first_token(where, expected_s, now - at)
        ttft = now - req.arrival
        self.ttft.add(ttft)
        self.window.num_first += 1
        self.window.num_first_within += ttft <= self.config.slo.ttft_s

    def tokens(self, num_streams: int, gap_s: float) -> None:
        """A decode step gave `num_streams` streams a token, `gap_s` after their last one."""
        self.itl.add(gap_s, num_streams)
        if self.cores is not None:
            self.cores.spend(num_streams * self.config.host.token_cpu_s, self.now)
        self.window.gap_weight += num_streams
        if gap_s <= self.config.slo.itl_s:
            self.window.gap_weight_within += num_streams

    def prefill_step(self, num_tokens: int, seconds: float) -> None:
        self.window.prefill_tokens += num_tokens
        self.window.prefill_busy_s += seconds

    def finished(self, req: Req, now: float) -> None:
        self.finish_counts[req.id] += 1
        self.num_finished += 1
        self.window.num_finished += 1
        self.window.held_s += now - req.routed
        self.end_s = now
        ttft_ok = req.first - req.arrival <= self.config.slo.ttft_s
        if req.output > 1:
            tpot = (now - req.first) / (req.output - 1)
            self.tpot.add(tpot)
            self.num_good += ttft_ok and tpot <= self.config.slo.itl_s
        else:
            self.num_good += ttft_ok

    def changed(self, replica) -> None:
        (self.prefill_router if replica.pool == "prefill" else self.decode_router).changed(replica)

    # ---- replicas and autoscaling

    def _count(self, now: float) -> None:
        for pool, n in self._counts.items():
            self.replica_seconds[pool] += n * (now - self._counted_at)
        self._counted_at = now

    def _add_replica(self, pool: str, now: float, started: bool) -> None:
        c = self.config
        name = f"{pool}-{next(self._names)}"
        if pool == "prefill":
            r = SimPrefill(self, name, self._costs[pool], c.max_num_batched_tokens, self._blocks[pool])
        else:
            r = SimDecode(self, name, self._costs[pool], c.max_num_batched_tokens, self._blocks[pool], c.max_num_seqs,
                          c.max_ongoing_requests or default_max_ongoing_requests(c.max_num_seqs))
        r.pool, r.started_s = pool, now
        self._count(now)
        self._counts[pool] += 1
        self.pools[pool].append(r)
        r.is_active = False
        if started:
            self._activate(now, r)
        else:
            self.at(now + c.autoscale.replica_start_s, self._activate, r)

    def _activate(self, now: float, r) -> None:
        if r not in self.pools[r.pool]:  # removed while starting
            return
        r.is_active = True
        if r.pool == "prefill":
            self.prefill_router.add(r)
        else:
            self.decode_index.set_limit(r.name, r.num_blocks)
            self.decode_router.add(r)
            self.route_pending(now)

    def _drain(self, r, now: float) -> None:
        self.pools[r.pool].remove(r)
        if r.is_active:
            (self.prefill_router if r.pool == "prefill" else self.decode_router).remove(r)
        r.is_active = False
        self.draining.append(r)

    def _retire_idle(self, now: float) -> None:
        for r in [r for r in self.draining if r.is_idle]:
            self.draining.remove(r)
            self.retired.append(r)
            self._count(now)
            self._counts[r.pool] -= 1
            self.lifetimes.append((r.pool, r.started_s, now))
            if r.pool == "decode":
                self.decode_index.remove_replica(r.name)

    def _kv_read_share(self, serving: list[SimDecode]) -> float:
        """What the serving decode replicas report, on average: the KV's share of a step's bytes."""
        model, block_size = self.config.model, self.config.block_size
        shares = [kv_read_share(r.used_blocks * block_size * model.kv_bytes_per_token, model.weight_bytes)
                  for r in serving]
        return sum(shares) / len(shares) if shares else 0.0

    def _tick(self, now: float, _) -> None:
        spec, w = self.config.autoscale, self.window
        self.window = Window()
        self._retire_idle(now)
        prefill, decode = self.pools["prefill"], self.pools["decode"]
        if w.prefill_busy_s > 0:
            self._prefill_rate = w.prefill_tokens / w.prefill_busy_s
        p_signal = PrefillSignal(len(prefill), sum(r.queued_tokens for r in prefill), w.prompt_tokens / spec.tick_s,
                                 self._prefill_rate, w.num_first_within / w.num_first if w.num_first else None,
                                 sum(not r.is_active for r in prefill), w.num_prompts / spec.tick_s)
        serving = [r for r in decode if r.is_active]
        num_unrouted = len(self.pending) + len(self.late)
        capacity, slots = sum(r.num_blocks for r in serving), len(serving) * self.config.max_num_seqs
        # As the serving replicas report them: blocks and sequences of the requests whose KV they
        # hold (not those still with the prefill pool); the requests waiting for a slot (for a
        # replica, or on one); the requests routed to the pool, how long those that ended were held,
        # and those it holds.
        d_signal = DecodeSignal(len(decode), sum(r.used_blocks for r in serving) / capacity if capacity else 0.0,
                                w.gap_weight_within / w.gap_weight if w.gap_weight else None,
                                sum(r.num_seqs for r in serving) / slots if slots else 0.0,
                                num_unrouted + sum(r.num_waiting for r in serving), self.config.max_num_seqs,
                                len(decode) - len(serving),
                                w.num_routed / spec.tick_s, w.held_s / w.num_finished if w.num_finished else None,
                                sum(r.num_in_flight for r in (*decode, *self.draining) if r.pool == "decode"),
                                self._kv_read_share(serving))
        (p_min, p_max), (d_min, d_max) = spec.bounds("prefill"), spec.bounds("decode")
        want_p, want_d = self.scaler.decide(p_signal, d_signal, now, p_max, d_max)
        want_p, want_d = max(p_min, want_p), max(d_min, want_d)
        for pool, want in (("prefill", want_p), ("decode", want_d)) if self.config.prefill else (("decode", want_d),):
            live = self.pools[pool]
            # Draining replicas still hold their devices: the budget counts them until they go.
            room = spec.max_total_replicas - sum(map(len, self.pools.values())) - len(self.draining)
            for _ in range(min(want - len(live), room)):
                self._add_replica(pool, now, started=False)
            if want < len(live):  # drain the least loaded
                key = (lambda r: r.queued_tokens) if pool == "prefill" else (lambda r: r.num_in_flight)
                for r in sorted(live, key=lambda r: (r.is_active, key(r)))[:len(live) - want]:
                    self._drain(r, now)
        self._retire_idle(now)
        if self._arrivals is not None or self.num_finished < self.num_arrived:
            self.at(now + spec.tick_s, self._tick, None)

    # ---- the result

    def result(self, wall_s: float) -> dict:
        slo = self.config.slo

        def ms(h: LogHistogram) -> dict:
            out = {f"p{p:g}": h.percentile(p) for p in sorted({50.0, 99.0, slo.percentile})}
            out["mean"] = h.mean
            return {k: None if v is None else v * 1000 for k, v in out.items()}

        total = sum(self.replica_seconds.values())
        simulated_s = self.end_s - self.start_s
        return {
            "num_requests": self.num_arrived, "completed": self.num_finished, "simulated_s": simulated_s,
            "slo": {"ttft_ms": slo.ttft_s * 1000, "itl_ms": slo.itl_s * 1000, "percentile": slo.percentile},
            "ttft_ms": ms(self.ttft), "itl_ms": ms(self.itl), "tpot_ms": ms(self.tpot),
            "slo_attainment": self.num_good / self.num_arrived if self.num_arrived else None,
            "goodput_rps": self.num_good / simulated_s if simulated_s > 0 else None,
            "replica_seconds": {**self.replica_seconds, "total": total},
            "goodput_per_replica": self.num_good / total if total > 0 else None,
            "placements": dict(sorted(self.placements.items())), "recomputed": self.num_recomputed,
            "final_replicas": {pool: len(rs) for pool, rs in self.pools.items()},
            "num_events": self.num_events, "wall_s": wall_s,
            "real_time_ratio": simulated_s / wall_s if wall_s > 0 else None,
        }
