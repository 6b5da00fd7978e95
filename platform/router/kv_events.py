"""KV events: how every router instance keeps its `RadixIndex` true (DESIGN.md section 3).

Each engine replica publishes what its prefix cache gained and lost to one Redis stream per
deployment; every router instance reads the whole stream. No Ray here, and no pickle on the wire.

Stream entry (XADD fields): `r` the replica id (Ray Serve's replica unique id), `id` the
replica's event id (1, 2, 3, ... per replica, one per entry) and `ev` a msgpack list of events:
`[STORED, hashes, parent]` (a chain of block hashes after `parent`, None for a first block),
`[REMOVED, hashes]`, `[CLEARED]`, or `[SNAPSHOT, hashes, parents]` (everything the replica caches
now, replacing what a router knew of it).

A router that sees a replica's event id jump (it missed entries: Redis trimmed or lost them, or
it started late) asks that replica for a snapshot on the control stream `<stream>:resync`, and
keeps going meanwhile. Without Redis, or while it is unreachable, the router is *approximate*:
it matches against its own placements of the last `approx_ttl_s`. No request waits on Redis.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, Sequence

import msgpack

from pdserve.router.radix_index import RadixIndex

log = logging.getLogger(__name__)

STORED, REMOVED, CLEARED, SNAPSHOT = 0, 1, 2, 3


def stream_name(app: str, deployment: str) -> str:
    return f"pdserve:kv-events:{app}:{deployment}"


def encode_events(events: Iterable) -> list[list]:
    """Engine `KVEvent`s as wire events, merging chains stored one block after another."""
    from pdserve.engine.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored

    out: list[list] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, BlockStored):
            if last and last[0] == STORED and ev.parent_hash == last[1][-1]:
                last[1].extend(ev.block_hashes)
            else:
                out.append([STORED, list(ev.block_hashes), ev.parent_hash])
        elif isinstance(ev, BlockRemoved):
            if last and last[0] == REMOVED:
                last[1].extend(ev.block_hashes)
            else:
                out.append([REMOVED, list(ev.block_hashes)])
        elif isinstance(ev, AllBlocksCleared):
            out = [[CLEARED]]  # what came before is cleared too
    return out


def _is_hashes(x) -> bool:
    return isinstance(x, list) and all(type(h) is int for h in x)


def _check_events(events) -> None:
    """Raise ValueError unless `events` is a well-formed list of wire events."""
    if not isinstance(events, list):
        raise ValueError("events must be a list")
    for ev in events:
        ok = isinstance(ev, list) and ev and ev[0] in (STORED, REMOVED, CLEARED, SNAPSHOT)
        if ok and ev[0] == STORED:
            ok = len(ev) == 3 and _is_hashes(ev[1]) and (ev[2] is None or type(ev[2]) is int)
        elif ok and ev[0] == REMOVED:
            ok = len(ev) == 2 and _is_hashes(ev[1])
        elif ok and ev[0] == SNAPSHOT:
            ok = (len(ev) == 3 and _is_hashes(ev[1]) and isinstance(ev[2], list) and len(ev[2]) == len(ev[1])
                  and all(p is None or type(p) is int for p in ev[2]))
        if not ok:
            raise ValueError(f"malformed event {ev!r:.80}")


def apply_snapshot(index: RadixIndex, replica: str, hashes: Sequence[int], parents: Sequence[int | None]) -> None:
    """Replace what `index` knows of `replica` with a snapshot of (hash, parent) pairs.

    Blocks whose parent the replica no longer caches can never be matched (a match is a prefix)
    and are left out."""
    index.clear_replica(replica)
    children: dict[int | None, list[int]] = {}
    for h, p in zip(hashes, parents):
        children.setdefault(p, []).append(h)
    todo = [(None, h) for h in children.get(None, [])]
    while todo:  # walk each maximal single-child chain and insert it in one go
        parent, h = todo.pop()
        chain = [h]
        while len(kids := children.get(chain[-1], ())) == 1:
            chain.append(kids[0])
        index.insert(replica, chain, parent=parent)
        todo.extend((chain[-1], k) for k in children.get(chain[-1], ()))


def _redis(url: str, timeout_s: float):
    import redis

    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


class KVEventPublisher:
    """Replica side: drains the engine's KV events into the deployment's stream every
    `interval_s`, and answers resync requests with a snapshot.

    `take_events()` returns the engine's pending `KVEvent`s; `snapshot()` returns (hash, parent)
    pairs of every cached block. Both are called from this publisher's thread (wrap them in the
    engine lock). While Redis is unreachable events are drained and dropped; once it is back a
    snapshot goes out first, so routers resync.
    """

    def __init__(self, redis_url: str, stream: str, replica_id: str, take_events: Callable[[], list],
                 snapshot: Callable[[], list[tuple[int, int | None]]], interval_s: float = 0.05,
                 maxlen: int = 100_000):
        self.stream, self.replica_id = stream, replica_id
        self._take_events, self._snapshot = take_events, snapshot
        self._interval_s, self._maxlen = interval_s, maxlen
        self._redis = _redis(redis_url, timeout_s=max(2.0, 4 * interval_s))
        self._seq = 0
        self._need_snapshot = False
        self._control_id = "$"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{replica_id}", daemon=True)

    @classmethod
    def for_engine(cls, engine, redis_url: str, stream: str, replica_id: str) -> KVEventPublisher:
        """Publish an `AsyncLLMEngine`'s KV events (turned on here), taken under its lock."""
        pool = engine.engine.block_pool
        pool.enable_events = True
        return cls(redis_url, stream, replica_id, lambda: engine.locked(pool.take_events),
                   lambda: engine.locked(pool.snapshot)).start()

    def start(self) -> KVEventPublisher:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._redis.close()

    def publish_once(self) -> None:
        """Publish pending events (and a snapshot when one is owed). Raises redis errors."""
        events = encode_events(self._take_events())
        if self._need_snapshot:  # taken after the events, so it already holds what they say
            hashes, parents = zip(*pairs) if (pairs := self._snapshot()) else ((), ())
            events = [[SNAPSHOT, list(hashes), list(parents)]]
        if events:
            self._seq += 1
            self._redis.xadd(self.stream, {"r": self.replica_id, "id": self._seq,
                                           "ev": msgpack.packb(events)},
                             maxlen=self._maxlen, approximate=True)
        self._need_snapshot = False

    def _wait_for_resync_requests(self) -> None:
        """Sleep up to `interval_s` on the control stream; a request for us (or all) owes a snapshot."""
        reply = self._redis.xread({self.stream + ":resync": self._control_id}, block=int(self._interval_s * 1000))
        for _, entries in reply or ():
            for entry_id, fields in entries:
                self._control_id = entry_id
                if fields.get(b"r", b"").decode() in (self.replica_id, "*"):
                    self._need_snapshot = True

    def _run(self) -> None:
        down = False
        while not self._stop.is_set():
            try:
                if self._control_id == "$":  # learn where the control stream is now
                    last = self._redis.xrevrange(self.stream + ":resync", count=1)
                    self._control_id = last[0][0] if last else "0-0"
                self._wait_for_resync_requests()
                self.publish_once()
                if down:
                    log.info("KV events: redis is back; %s published a snapshot", self.replica_id)
                    down = False
            except Exception as e:  # noqa: BLE001 - redis down or slow: keep the engine's queue drained
                try:
                    self._take_events()
                except Exception:  # noqa: BLE001
                    log.exception("KV events: taking the engine's events failed")
                self._need_snapshot = True
                if not down:
                    log.warning("KV events: cannot publish to redis (%r); routers go approximate", e)
                    down = True
                self._stop.wait(min(1.0, 10 * self._interval_s))


class KVEventIndex:
    """Router side: a `RadixIndex` per deployment, precise while the KV-event stream flows and
    approximate (own placements, `approx_ttl_s`) without it. Thread-safe: a reader thread applies
    the stream while `match` runs on the caller's thread."""

    def __init__(self, redis_url: str | None, stream: str, max_blocks_per_replica: int | None = None,
                 approx_ttl_s: float = 120.0, pending_ttl_s: float = 10.0, block_s: float = 0.5,
                 resync_every_s: float = 2.0):
        self.stream = stream
        self.precise = RadixIndex(max_blocks_per_replica)
        # This router's own placements. Approximate mode matches only these (for approx_ttl_s);
        # precise mode also counts them for pending_ttl_s, until the replica's events catch up
        # (a burst of one prefix must not scatter before the first of it is even computed).
        self.approx = RadixIndex(max_blocks_per_replica)
        self.approx_ttl_s, self.pending_ttl_s = approx_ttl_s, pending_ttl_s
        self._lock = threading.Lock()
        self._last_seq: dict[str, int] = {}
        self._resync_asked: dict[str, float] = {}
        self._resync_every_s = resync_every_s
        self._replicas: set[str] | None = None
        self._connected = False
        self._last_expire = 0.0
        self._url, self._block_s = redis_url, block_s
        self._stop = threading.Event()
        self._thread = None
        if redis_url:
            self._redis = _redis(redis_url, timeout_s=block_s + 2.0)
            self._thread = threading.Thread(target=self._run, name="kv-event-reader", daemon=True)

    @property
    def mode(self) -> str:
        return "precise" if self._connected else "approximate"

    def start(self) -> KVEventIndex:
        if self._thread is not None:
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._url:
            self._redis.close()

    # ---- the router's side

    def match(self, hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        replicas = list(replicas)
        with self._lock:
            now = time.monotonic()
            if now - self._last_expire > 0.5:
                self.approx.expire(now - (self.pending_ttl_s if self._connected else self.approx_ttl_s))
                self._last_expire = now
            own = self.approx.match(hashes, replicas)
            if not self._connected:
                return own
            known = self.precise.match(hashes, replicas)
            return {r: max(n, own[r]) for r, n in known.items()}

    def record_placement(self, replica: str, hashes: Sequence[int]) -> None:
        """The router sent `hashes` to `replica`."""
        with self._lock:
            self.approx.insert(replica, hashes)

    def set_replicas(self, replicas: Iterable[str]) -> None:
        """The deployment's replicas now; the ones that left drop out of the index."""
        replicas = set(replicas)
        with self._lock:
            for gone in set(self.precise.replicas) | set(self.approx.replicas) | set(self._last_seq):
                if gone not in replicas:
                    self.precise.remove_replica(gone)
                    self.approx.remove_replica(gone)
                    self._last_seq.pop(gone, None)
            self._replicas = replicas

    # ---- the stream's side

    def apply(self, replica: str, seq: int, events: list) -> bool:
        """Apply one stream entry. Returns False when entries were missed (a resync is due)."""
        with self._lock:
            if self._replicas is not None and replica not in self._replicas:
                return True  # a replica that left (or is not ours yet): nothing to route to
            last = self._last_seq.get(replica)
            if last is not None and seq <= last:
                return True  # already seen
            in_order = seq == 1 if last is None else seq == last + 1
            self._last_seq[replica] = seq
            index = self.precise
            for ev in events:
                kind = ev[0]
                if kind == STORED:
                    index.insert(replica, ev[1], parent=ev[2])
                elif kind == REMOVED:
                    index.remove(replica, ev[1])
                elif kind == CLEARED:
                    index.clear_replica(replica)
                elif kind == SNAPSHOT:
                    apply_snapshot(index, replica, ev[1], ev[2])
                    in_order = True
                    self._resync_asked.pop(replica, None)
            return in_order

    def request_resync(self, replica: str) -> None:
        now = time.monotonic()
        if now - self._resync_asked.get(replica, -1e9) < self._resync_every_s:
            return
        self._resync_asked[replica] = now
        log.info("KV events: %s missed entries of %s; asking it for a snapshot", self.stream, replica)
        self._redis.xadd(self.stream + ":resync", {"r": replica}, maxlen=1000, approximate=True)

    def _apply_entry(self, fields: dict) -> None:
        try:
            replica = fields[b"r"].decode()
            seq = int(fields[b"id"])
            events = msgpack.unpackb(fields[b"ev"])
            _check_events(events)
        except (KeyError, ValueError, TypeError, UnicodeDecodeError, msgpack.UnpackException) as e:
            log.warning("KV events: skipping a malformed entry of %s (%r)", self.stream, e)
            return
        try:
            in_order = self.apply(replica, seq, events)
        except (IndexError, TypeError, ValueError) as e:
            log.warning("KV events: entry %d of %s did not apply (%r); resyncing it", seq, replica, e)
            in_order = False
        if not in_order:
            self.request_resync(replica)

    def _run(self) -> None:
        last_id = "0-0"  # the whole retained stream first
        backoff = 0.1
        first = True
        while not self._stop.is_set():
            try:
                if first:  # a new reader may have missed anything: every replica sends a snapshot
                    self._redis.xadd(self.stream + ":resync", {"r": "*"}, maxlen=1000, approximate=True)
                    first = False
                reply = self._redis.xread({self.stream: last_id}, block=int(self._block_s * 1000), count=500)
                if not self._connected:
                    log.info("KV events: reading %s; routing is precise", self.stream)
                self._connected = True
                backoff = 0.1
                for _, entries in reply or ():
                    for entry_id, fields in entries:
                        last_id = entry_id
                        self._apply_entry(fields)
                for replica in list(self._resync_asked):  # a request may be lost: ask again
                    self.request_resync(replica)
            except Exception as e:  # noqa: BLE001 - redis down: approximate until it is back
                if self._connected:
                    log.warning("KV events: lost redis (%r); routing is approximate until it is back", e)
                self._connected = False
                first = True
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
