"""The simulated routers: pdserve's own ranking over pdserve's own index, at O(log n) a request.

A real router ranks every replica of its pool per request (`rank_prefill`, `rank_decode`); at a
thousand replicas and ten thousand requests a second that is the simulation's whole budget. The
ranking's winner is always among a few candidates known in advance, so the simulated routers rank
only those, with the same functions, and get the same choice:
- prefill: cost = uncached prompt tokens + queue_weight x queued tokens. A replica that caches
  none of the prompt costs `prompt + queue_weight x queued`, least on the least-queued replica;
  one that caches some of it holds the prompt's prefix, and every such replica was once sent a
  request with that prefix. Candidates: the `NUM_LEAST_LOADED` least-queued replicas (a heap)
  plus the replicas sent this prefix that still hold some of it (`RadixIndex.match`).
- decode: the most free blocks (headroom; the pool's replicas are alike), then the fewest
  sequences held (admitted, running or about to: what a replica's `num_running` report plus the
  router's in-flight count approach): candidates are the `NUM_LEAST_LOADED` first by that key (a heap).
Heaps are lazy: a replica's entry is pushed again whenever what it is ranked by changes and stale
entries are skipped. Ties break at random (a random key in the heap, then the ranking's shuffle).

The prefix-aware router's index is fed as in its approximate mode (each placement recorded as
held); the replicas' figures are read as they are now (the real routers read periodic reports
corrected by their own in-flight requests). Only blocks of a shared prefix are indexed: a
request's own blocks can never be hit.
"""

from __future__ import annotations

import heapq
import itertools
import random

from pdserve.router.policy import DEFAULT_QUEUE_WEIGHT, DecodeLoad, rank_decode, rank_prefill
from pdserve.router.radix_index import RadixIndex

NUM_LEAST_LOADED = 4


class _LazyHeap:
    def __init__(self, key, rng: random.Random):
        self._key, self._rng = key, rng
        self._heap: list = []
        self._seq = itertools.count()
        self.members: dict[str, object] = {}

    def push(self, replica) -> None:
        heapq.heappush(self._heap, (self._key(replica), self._rng.random(), next(self._seq), replica.version, replica))
        if len(self._heap) > 8 * len(self.members) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(self._key(r), self._rng.random(), next(self._seq), r.version, r) for r in self.members.values()]
        heapq.heapify(self._heap)

    def first(self, k: int) -> list:
        out, keep = [], []
        heap = self._heap
        while heap and len(out) < k:
            entry = heapq.heappop(heap)
            r = entry[4]
            if entry[3] != r.version or self.members.get(r.name) is not r or r in out:
                continue
            out.append(r)
            keep.append(entry)
        for entry in keep:
            heapq.heappush(heap, entry)
        return out


class PrefillRouter:
    def __init__(self, block_size: int, rng: random.Random, queue_weight: float = DEFAULT_QUEUE_WEIGHT):
        self.block_size, self.rng, self.queue_weight = block_size, rng, queue_weight
        self.index = RadixIndex()
        self._heap = _LazyHeap(lambda r: r.queued_tokens, rng)
        self._sent: dict[int, set[str]] = {}  # prefix id -> replicas sent a request with it

    @property
    def num_replicas(self) -> int:
        return len(self._heap.members)

    def add(self, replica) -> None:
        self._heap.members[replica.name] = replica
        self.index.set_limit(replica.name, replica.num_blocks)
        self._heap.push(replica)

    def remove(self, replica) -> None:
        self._heap.members.pop(replica.name, None)
        self.index.remove_replica(replica.name)

    def changed(self, replica) -> None:
        replica.version += 1
        if replica.name in self._heap.members:
            self._heap.push(replica)

    def least_queued_tokens(self) -> int:
        """The prompt tokens queued on the pool's least-queued replica (0: no replica): what a
        prompt sent now waits behind, as the decode replica's router sees it."""
        least = self._heap.first(1)
        return least[0].queued_tokens if least else 0

    def choose(self, prompt_tokens: int, prefix_id, hashes: tuple) -> tuple[object, int]:
        """(the replica, the prompt tokens it must compute)."""
        members = self._heap.members
        candidates = {r.name: r for r in self._heap.first(NUM_LEAST_LOADED)}
        matched = {}
        if hashes:
            sent = self._sent.setdefault(prefix_id, set())
            held = [name for name in sent if name in members]
            matched = self.index.match(hashes, held)
            for name, n in matched.items():
                if n:
                    candidates[name] = members[name]
                else:
                    sent.discard(name)  # evicted: it is among the least loaded or no candidate
        queued = {name: r.queued_tokens for name, r in candidates.items()}
        best = rank_prefill(list(candidates), prompt_tokens, matched, queued, self.block_size, self.queue_weight,
                            self.rng)[0]
        if hashes:
            self.index.insert(best, hashes)  # the approximate mode's record of a placement
            self._sent[prefix_id].add(best)
        cached = min(matched.get(best, 0) * self.block_size, prompt_tokens - 1)
        return candidates[best], prompt_tokens - cached


class DecodeRouter:
    def __init__(self, rng: random.Random):
        self.rng = rng
        # (requests in flight, not running sequences, break ties: they change on routing and
        # finishing only, not every step)
        self._heap = _LazyHeap(lambda r: (r.routed_blocks - r.num_blocks, r.num_in_flight), rng)

    @property
    def replicas(self) -> list:
        return list(self._heap.members.values())

    def add(self, replica) -> None:
        self._heap.members[replica.name] = replica
        self._heap.push(replica)

    def remove(self, replica) -> None:
        self._heap.members.pop(replica.name, None)

    def changed(self, replica) -> None:
        replica.version += 1
        if replica.name in self._heap.members:
            self._heap.push(replica)

    def choose(self, blocks_needed: int):
        candidates = [r for r in self._heap.first(NUM_LEAST_LOADED) if r.has_room]
        if not candidates:
            return None
        loads = {r.name: DecodeLoad(r.num_blocks - r.routed_blocks, r.num_blocks, r.num_in_flight)
                 for r in candidates}
        best = rank_decode(list(loads), loads, blocks_needed, self.rng)[0]
        return next(r for r in candidates if r.name == best)
