"""KV events over a real redis-server: engine block pools publish, router indexes follow.

Each "replica" here is the engine's real `BlockPool` + `KVCacheManager` (no tensors needed) and a
`KVEventPublisher`; routers are `KVEventIndex`es reading the same stream.
"""

from __future__ import annotations

import random
import threading
import time

import msgpack
import pytest
import redis

from pdserve.engine.kv_cache import BlockPool, KVCacheManager
from pdserve.router import block_hashes
from pdserve.router.kv_events import KVEventIndex, KVEventPublisher
from pdserve.router.redis_server import LocalRedis

BS = 4
STREAM = "pdserve:kv-events:test:Prefill"


class Replica:
    """An engine's prefix cache, driven by fake requests, publishing its KV events."""

    def __init__(self, name: str, redis_url: str, seed: int, num_blocks: int = 48):
        self.name = name
        self.pool = BlockPool(num_blocks, BS, enable_events=True)
        self.kv = KVCacheManager(self.pool)
        self.lock = threading.Lock()
        self.rng = random.Random(seed)
        self.stems = [[self.rng.randrange(50) for _ in range(BS * 5)] for _ in range(3)]
        self.publisher = KVEventPublisher(redis_url, STREAM, name, self._locked(self.pool.take_events),
                                          self._locked(self.pool.snapshot), interval_s=0.02)
        self.n = 0

    def _locked(self, fn):
        def call():
            with self.lock:
                return fn()
        return call

    def serve(self, count: int) -> None:
        """`count` requests: a shared stem (or not) plus a random tail, computed, cached, freed."""
        for _ in range(count):
            stem = self.rng.choice(self.stems)
            tokens = stem[:self.rng.randrange(len(stem) + 1)] + [self.rng.randrange(50) for _ in range(self.rng.randrange(1, 12))]
            hashes = block_hashes(tokens, BS)
            rid = f"{self.name}-{self.n}"
            self.n += 1
            with self.lock:
                hit = self.kv.match_prefix(hashes, len(tokens))
                if self.kv.allocate(rid, len(tokens), hit):
                    self.kv.cache_full_blocks(rid, hashes, len(tokens))
                    self.kv.free(rid)

    def cached(self) -> set[int]:
        with self.lock:
            return set(self.pool.cached)


def wait_until(cond, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def in_sync(router: KVEventIndex, replica: Replica) -> bool:
    with router._lock:
        return router.precise.blocks(replica.name) == replica.cached()


@pytest.fixture
def replicas(redis_server):
    reps = [Replica(f"r{i}", redis_server.url, seed=i) for i in range(2)]
    yield reps
    for r in reps:
        r.publisher.close()


def test_two_routers_fed_by_one_stream_converge(redis_server, replicas):
    for r in replicas:
        r.publisher.start()
    routers = [KVEventIndex(redis_server.url, STREAM, poll_s=0.02).start() for _ in range(2)]
    try:
        for _ in range(5):
            for r in replicas:
                r.serve(40)  # evictions included: 48 blocks cannot hold it all
        for router in routers:
            for r in replicas:
                wait_until(lambda: in_sync(router, r), what=f"router index == {r.name}'s cache")
        assert routers[0].mode == routers[1].mode == "precise"
        probe = block_hashes(replicas[0].stems[0], BS)
        assert routers[0].match(probe, ["r0", "r1"]) == routers[1].match(probe, ["r0", "r1"])
        assert routers[0].match(probe, ["r0"])["r0"] > 0
    finally:
        for router in routers:
            router.close()


def test_a_gap_is_detected_and_repaired_from_the_replica(redis_server, replicas):
    rep = replicas[0]
    rep.publisher.start()
    for _ in range(4):
        rep.serve(10)
        time.sleep(0.1)  # separate entries
    client = redis.Redis.from_url(redis_server.url)
    wait_until(lambda: client.xlen(STREAM) >= 3, what="three entries")
    entries = client.xrange(STREAM)
    client.xdel(STREAM, entries[1][0])  # the router will never see event id 2
    router = KVEventIndex(redis_server.url, STREAM, poll_s=0.02)
    applied = []
    apply = router.apply
    router.apply = lambda replica, seq, events: applied.append((seq, apply(replica, seq, events))) or applied[-1][1]
    router.start()
    try:
        wait_until(lambda: in_sync(router, rep), what="resync from the replica")
        assert (3, False) in applied  # the gap was seen, then a snapshot repaired it
        rep.serve(20)
        wait_until(lambda: in_sync(router, rep), what="events after the resync")
    finally:
        router.close()
        client.close()


def test_malformed_entries_are_skipped(redis_server, replicas):
    rep = replicas[0]
    rep.publisher.start()
    client = redis.Redis.from_url(redis_server.url)
    client.xadd(STREAM, {"r": "r0", "id": "x", "ev": b"\xc1"})
    client.xadd(STREAM, {"r": "r0", "id": 99, "ev": msgpack.packb([[0, "not hashes", None]])})
    client.xadd(STREAM, {"nothing": "useful"})
    router = KVEventIndex(redis_server.url, STREAM, poll_s=0.02).start()
    try:
        rep.serve(30)
        wait_until(lambda: in_sync(router, rep), what="the index to follow despite bad entries")
        assert router.mode == "precise"
    finally:
        router.close()
        client.close()


def test_oversized_entries_stay_in_redis_and_a_read_is_bounded(redis_server, replicas):
    """A writer to the stream (a pod with the password) adds entries over the bound and a run of
    entries just under it: the big ones reach the router only as stubs, each read returns at most
    MAX_READ_BYTES, and the index still follows."""
    from pdserve.router import kv_events as ke

    rep = replicas[0]
    rep.publisher.start()
    client = redis.Redis.from_url(redis_server.url)
    for i in range(3):
        client.xadd(STREAM, {"v": 1, "r": "r0", "id": 10_000 + i, "ev": b"\x90" * (4 << 20)})
    for i in range(12):  # 0.9 MiB each, under the bound: read, then refused as malformed
        client.xadd(STREAM, {"v": 1, "r": "r0", "id": 20_000 + i, "ev": b"\xc1" * (900 << 10)})
    router = KVEventIndex(redis_server.url, STREAM, poll_s=0.02)
    replies = []
    read = router._read
    router._read = lambda **kw: replies.append(r := read(**kw)) or r
    router.start()
    try:
        rep.serve(30)
        wait_until(lambda: in_sync(router, rep), what="the index to follow despite the big entries")
        assert router.rejected["oversized"] == 3 and router.rejected["malformed"] == 12
        sizes = [sum(len(f) for _, flat in reply for f in flat) for reply in replies]
        assert max(sizes) <= ke.MAX_READ_BYTES < 12 * (900 << 10)  # the run took two reads at least
    finally:
        router.close()
        client.close()


def test_killing_redis_keeps_routing_and_precise_mode_comes_back(redis_server, replicas):
    for r in replicas:
        r.publisher.start()
    router = KVEventIndex(redis_server.url, STREAM, poll_s=0.02).start()
    try:
        replicas[0].serve(30)
        wait_until(lambda: in_sync(router, replicas[0]), what="precise index")
        redis_server.stop()
        wait_until(lambda: router.mode == "approximate", what="approximate mode")
        # Routing goes on: the router matches its own recent placements.
        probe = block_hashes(list(range(20)), BS)
        assert router.match(probe, ["r0", "r1"]) == {"r0": 0, "r1": 0}
        router.record_placement("r1", probe)
        assert router.match(probe, ["r0", "r1"]) == {"r0": 0, "r1": len(probe)}
        for r in replicas:
            r.serve(30)  # the caches move on while redis is away
        restarted = LocalRedis(port=redis_server.port).start()
        try:
            wait_until(lambda: router.mode == "precise", what="precise mode again")
            for r in replicas:
                wait_until(lambda: in_sync(router, r), what=f"{r.name} resynced after the outage")
        finally:
            restarted.stop()
    finally:
        router.close()


def test_replicas_that_leave_drop_out_of_the_index(redis_server, replicas):
    for r in replicas:
        r.publisher.start()
        r.serve(20)
    router = KVEventIndex(redis_server.url, STREAM, poll_s=0.02).start()
    try:
        for r in replicas:
            wait_until(lambda: in_sync(router, r), what=f"{r.name} indexed")
        router.set_replicas(["r1"])
        assert router.precise.replicas == ["r1"]
        replicas[0].serve(10)  # a replica that left is not re-added by late events
        time.sleep(0.3)
        assert router.precise.replicas == ["r1"]
    finally:
        router.close()


def test_a_resync_flood_costs_one_snapshot_a_second(redis_server, replicas):
    rep = replicas[0]
    rep.serve(20)
    rep.publisher.start()
    client = redis.Redis.from_url(redis_server.url)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0:  # every 5 ms, for every replica: "send a snapshot"
            client.xadd(STREAM + ":resync", {"r": "*"}, maxlen=1000, approximate=True)
            time.sleep(0.005)
        assert 1 <= rep.publisher.num_snapshots <= 3  # at most one a second (and one right away)
    finally:
        client.close()


def test_the_password_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TEST_KV_EVENTS_PASSWORD", "s3cret")
    with LocalRedis(password="s3cret") as server:
        rep = Replica("r0", server.url, seed=0)
        rep.publisher = KVEventPublisher(server.url, STREAM, "r0", rep._locked(rep.pool.take_events),
                                         rep._locked(rep.pool.snapshot), interval_s=0.02,
                                         password_env="TEST_KV_EVENTS_PASSWORD").start()
        router = KVEventIndex(server.url, STREAM, poll_s=0.02, password_env="TEST_KV_EVENTS_PASSWORD").start()
        stranger = KVEventIndex(server.url, STREAM, poll_s=0.02).start()  # no password: approximate
        try:
            router.set_replicas(["r0"])
            rep.serve(30)
            wait_until(lambda: in_sync(router, rep), what="the index to follow with the password")
            assert router.mode == "precise"
            time.sleep(0.5)
            assert stranger.mode == "approximate"
        finally:
            for r in (router, stranger):
                r.close()
            rep.publisher.close()
