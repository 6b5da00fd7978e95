"""How a replica is chosen (DESIGN.md section 2, steps 2 and 4). Pure functions, no Ray.

Prefill: a request costs each candidate the prompt tokens it does not cache plus the prefill work
already queued there, weighted by `queue_weight`; the cheapest candidate wins, ties broken at
random. The guard against hot spots is per candidate and falls out of the cost: a replica holding
a hot prefix keeps winning until its weighted queue outweighs the prefix itself, then a less
loaded replica computes the prefix once (and from then on holds it too), so a hot tenant spreads
over as many replicas as its load needs, while one overloaded replica never turns affinity off
for the others. `queue_weight` 1 is each request's own shortest time to first token; the default
3 also prices the wait a queue imposes on the requests behind it, which keeps the fleet's load
within ~1.5x (benchmarks/RESULTS.md, "Router").

Decode: the replica with the most KV headroom after this request, then the fewest running
sequences.

Requests waiting for a replica with room (every replica at `max_ongoing_requests`) are routed
oldest first among those that can still meet the TTFT target, then those past it, oldest first
(`LateLast`).
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Generic, Mapping, Sequence, TypeVar


DEFAULT_QUEUE_WEIGHT = 3.0


def rank_prefill(candidates: Sequence[str], num_prompt_tokens: int, matched_blocks: Mapping[str, int],
                 queued_tokens: Mapping[str, float], block_size: int, queue_weight: float = DEFAULT_QUEUE_WEIGHT,
                 rng: random.Random | None = None) -> list[str]:
    """`candidates` from cheapest to dearest: uncached prompt tokens + `queue_weight` x queued
    prefill tokens."""
    rng = rng or random
    costs = {}
    for r in candidates:
        # The last prompt token is always computed (DESIGN section 4): a full hit still costs 1.
        cached = min(matched_blocks.get(r, 0) * block_size, num_prompt_tokens - 1)
        costs[r] = num_prompt_tokens - cached + queue_weight * queued_tokens.get(r, 0.0)
    order = list(candidates)
    rng.shuffle(order)  # sort is stable: equal costs keep this random order
    order.sort(key=costs.__getitem__)
    return order


@dataclass(frozen=True)
class DecodeLoad:
    """What the decode ranking needs from a replica (its routing stats plus in-flight requests)."""
    num_free_kv_blocks: int
    num_kv_blocks: int
    num_running: int


def rank_decode(candidates: Sequence[str], loads: Mapping[str, DecodeLoad], blocks_needed: int,
                rng: random.Random | None = None) -> list[str]:
    """`candidates` by KV headroom left after `blocks_needed` (fraction of the cache), then by fewest
    running sequences. Replicas with no figures yet rank as empty (a new replica should get work)."""
    rng = rng or random

    def key(r: str) -> tuple[float, int]:
        load = loads.get(r)
        if load is None or load.num_kv_blocks <= 0:
            return (-1.0, 0)
        headroom = (load.num_free_kv_blocks - blocks_needed) / load.num_kv_blocks
        return (-headroom, load.num_running)

    order = list(candidates)
    rng.shuffle(order)
    order.sort(key=key)
    return order


class InFlight:
    """What this router sent to each replica and has not seen complete, and what it saw complete
    lately: enough to correct a replica's periodic report for what happened since it was taken.

    An entry is keyed by its routing attempt (`key`: a retried choice replaces it) and finished by
    `(request id, replica)`, which is all a completion says; several entries may share a request
    id (one client request fanning out), so a completion finishes the oldest one. Thread-safe: the
    router writes on its loop while a decode replica's placement reads (`least_queued_tokens`)."""

    def __init__(self, keep_s: float = 10.0, max_age_s: float = 600.0):
        self._max_age_s = max_age_s  # a choice never dispatched (client gone) never completes
        self._entries: dict[object, tuple[str, str, float, float]] = {}  # key -> (request, replica, amount, sent at)
        # The same open entries by replica, key -> (amount, sent at): a replica's figures read only its own.
        self._open: dict[str, dict[object, tuple[float, float]]] = {}
        self._done: dict[str, deque[tuple[float, float, float]]] = {}  # replica -> (finished at, amount, sent at)
        self._keep_s = keep_s
        self._lock = threading.RLock()

    def add(self, key: object, request_id: str, replica: str, amount: float) -> None:
        with self._lock:
            self._drop(key, finished=False)  # a retried choice replaces the earlier one
            now = time.time()
            while self._entries:  # oldest first (insertion order)
                oldest = next(iter(self._entries))
                if self._entries[oldest][3] >= now - self._max_age_s:
                    break
                self._drop(oldest, finished=False)
            self._entries[key] = (request_id, replica, amount, now)
            self._open.setdefault(replica, {})[key] = (amount, now)

    def finish(self, request_id: str, replica: str | None = None) -> None:
        with self._lock:
            # Oldest first either way; with the replica known, among its own entries only.
            keys = self._entries if replica is None else self._open.get(replica, {})
            for key in keys:
                if self._entries[key][0] == request_id:
                    self._drop(key, finished=True)
                    return

    def _drop(self, key: object, finished: bool) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        _, replica, amount, sent_at = entry
        self._open[replica].pop(key)
        if finished:
            now = time.time()
            done = self._done.setdefault(replica, deque())
            done.append((now, amount, sent_at))
            while done and done[0][0] < now - self._keep_s:
                done.popleft()

    def total(self, replica: str) -> float:
        with self._lock:
            return sum(a for a, _ in self._open.get(replica, {}).values())

    def estimate(self, replica: str, reported: float | None, reported_at: float | None) -> float:
        """The replica's queue now: its report, less what it held then and finished since, plus what
        was sent since and is still there (never less than this router's own in-flight work)."""
        with self._lock:
            open_ = list(self._open.get(replica, {}).values())
            own = sum(a for a, _ in open_)
            if reported is None or reported_at is None:
                return own
            finished = sum(a for t, a, sent in self._done.get(replica, ()) if sent <= reported_at < t)
            sent = sum(a for a, t in open_ if t > reported_at)
        return max(own, reported - finished + sent)

    def forget_replicas(self, keep: set[str]) -> None:
        with self._lock:
            for key, (_, replica, _, _) in list(self._entries.items()):
                if replica not in keep:
                    self._drop(key, finished=False)
            self._open = {r: v for r, v in self._open.items() if r in keep}
            self._done = {r: v for r, v in self._done.items() if r in keep}


T = TypeVar("T")


class LateLast(Generic[T]):
    """The order of the requests waiting for a replica with room, under a TTFT target: oldest
    first among those still inside it, then those past it, oldest first.

    First come, first served, a queue that outgrew the pool (a step of the load, before the new
    replicas start) makes every request late until it drains, each new one behind the old: the
    step costs the target to all it brings while the queue lasts. Routed past the late ones, the
    new requests meet the target from the time the pool keeps up with them, and the late ones wait
    for its slack (bounded by their own deadline, `gateway.request_timeout_s`). `queue` is the
    caller's, in arrival order; the requests found past the target at its head move here."""

    def __init__(self, target_s: float, arrived_at: Callable[[T], float]):
        self.target_s, self.arrived_at = target_s, arrived_at
        self.late: deque[T] = deque()

    def next_queue(self, queue: deque[T], now: float) -> deque[T]:
        """The queue whose head goes next: `queue` (once its head is inside the target), else the
        late ones (both empty: the late ones, empty)."""
        while queue and now - self.arrived_at(queue[0]) >= self.target_s:
            self.late.append(queue.popleft())
        return queue or self.late

    def __len__(self) -> int:
        return len(self.late)
