"""KV events: how every router instance keeps its `RadixIndex` true (DESIGN.md section 3).

Each engine replica publishes what its prefix cache gained and lost to one Redis stream per
deployment; every router instance reads the whole stream. No Ray here, and no pickle on the wire.

Stream entry (XADD fields): `v` the format's version (`VERSION`), `r` the replica id (Ray
Serve's replica unique id), `id` the replica's event id (1, 2, 3, ... per replica, one per entry)
and `ev` a msgpack list of events: `[STORED, hashes, parent]` (a chain of block hashes after
`parent`, None for a first block), `[REMOVED, hashes]`, `[CLEARED]`, `[SNAPSHOT, hashes, parents]`
(what the replica caches now, replacing what a router knew of it) and `[SNAPSHOT_MORE, hashes,
parents]` (the rest of a snapshot, in later entries, parents before children).

Every router reads every entry, so entries are bounded: at most `MAX_ENTRY_BYTES` of `ev` (larger
ones are dropped unread: msgpack's one-byte integers become Python objects ~36 times their size),
unpacked with limits of the entry's own size; a publisher splits what it has to say to fit. A router
reads the stream through a script that runs in Redis (`_READ_SCRIPT`): an entry over the bound
comes back as a stub naming its size, and one read returns at most `MAX_READ_BYTES`, so no writer
to the stream can make a router hold more than that, whatever Redis holds. Scripts cannot block,
so routers poll (every `poll_s`, as often as replicas publish).
Entries of another version, malformed or oversized are counted (`KVEventIndex.rejected`) and
skipped. A replica answers resync requests at most once per `RESYNC_MIN_INTERVAL_S` (each is a
snapshot taken under the engine's lock), however many arrive. The Redis password comes from the
environment variable `router.redis_password_env` names, never from the URL in the Serve config.

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

STORED, REMOVED, CLEARED, SNAPSHOT, SNAPSHOT_MORE = 0, 1, 2, 3, 4
VERSION = 1
MAX_ENTRY_BYTES = 1 << 20
# Hashes per event in one entry: a 64-bit hash packs into 9 bytes (a snapshot's pairs into 18),
# so this keeps an entry well under MAX_ENTRY_BYTES.
_HASHES_PER_ENTRY = 40_000
RESYNC_MIN_INTERVAL_S = 1.0
MAX_READ_BYTES = 8 << 20
_READ_COUNT = 500  # entries per read, at most
_FIELDS_BYTES = 1024  # room for an entry's other fields beside `ev`
# Blocks applied or dropped per hold of the router's lock (a few ms at most), so `match` never
# waits behind a whole entry.
_APPLY_PIECE = 4096

# The entries after ARGV[1] (at most ARGV[2]), in XRANGE's shape; an entry whose fields add up to
# more than ARGV[3] bytes as the stub {oversized: <bytes>}; no more than ARGV[4] bytes of fields in all
# (one entry at least). The bytes never leave Redis. XRANGE copies what it returns into the script,
# so it takes a few entries at a time: a read costs Redis about what it returns.
_READ_SCRIPT = """
local max_count, max_entry, max_read = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local out, total, last = {}, 0, ARGV[1]
while #out < max_count do
  local entries = redis.call('XRANGE', KEYS[1], '(' .. last, '+', 'COUNT', math.min(16, max_count - #out))
  for _, e in ipairs(entries) do
    local size = 0
    for _, f in ipairs(e[2]) do size = size + #f end
    if size > max_entry then
      out[#out + 1] = {e[1], {'oversized', tostring(size)}}
    else
      if total + size > max_read and #out > 0 then return out end
      total = total + size
      out[#out + 1] = e
    end
    last = e[1]
  end
  if #entries < 16 then return out end
end
return out
"""


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


def split_events(events: list[list]) -> list[list[list]]:
    """Wire events as entries: long chains and snapshots cut into parts of `_HASHES_PER_ENTRY`
    (a snapshot's later parts are SNAPSHOT_MORE), short events gathered, order kept."""
    entries: list[list[list]] = [[]]
    size = 0
    for ev in events:
        parts = [ev]
        if ev[0] in (STORED, REMOVED, SNAPSHOT) and len(ev[1]) > _HASHES_PER_ENTRY:
            n = _HASHES_PER_ENTRY
            if ev[0] == STORED:  # each part continues the chain after the last hash of the one before
                parts = [[STORED, ev[1][i:i + n], ev[2] if i == 0 else ev[1][i - 1]] for i in range(0, len(ev[1]), n)]
            elif ev[0] == REMOVED:
                parts = [[REMOVED, ev[1][i:i + n]] for i in range(0, len(ev[1]), n)]
            else:
                parts = [[SNAPSHOT if i == 0 else SNAPSHOT_MORE, ev[1][i:i + n], ev[2][i:i + n]]
                         for i in range(0, len(ev[1]), n)]
        for part in parts:
            weight = len(part[1]) if len(part) > 1 else 1
            if entries[-1] and size + weight > _HASHES_PER_ENTRY:
                entries.append([])
                size = 0
            entries[-1].append(part)
            size += weight
    return [e for e in entries if e]


def topological(pairs: list[tuple[int, int | None]]) -> list[tuple[int, int | None]]:
    """A snapshot's (hash, parent) pairs, parents before their children (split over entries, each
    part is then placed on what the parts before it placed); blocks whose parent is not cached
    are left out: they can never be matched (a match is a prefix)."""
    children: dict[int | None, list[int]] = {}
    for h, parent in pairs:
        children.setdefault(parent, []).append(h)
    out, todo = [], [(h, None) for h in children.get(None, [])]
    while todo:
        h, parent = todo.pop()
        out.append((h, parent))
        todo.extend((c, h) for c in children.get(h, ()))
    return out


def _is_hashes(x) -> bool:
    return isinstance(x, list) and all(type(h) is int for h in x)


def _check_events(events) -> None:
    """Raise ValueError unless `events` is a well-formed list of wire events."""
    if not isinstance(events, list):
        raise ValueError("events must be a list")
    for ev in events:
        ok = isinstance(ev, list) and ev and ev[0] in (STORED, REMOVED, CLEARED, SNAPSHOT, SNAPSHOT_MORE)
        if ok and ev[0] == STORED:
            ok = len(ev) == 3 and _is_hashes(ev[1]) and (ev[2] is None or type(ev[2]) is int)
        elif ok and ev[0] == REMOVED:
            ok = len(ev) == 2 and _is_hashes(ev[1])
        elif ok and ev[0] in (SNAPSHOT, SNAPSHOT_MORE):
            ok = (len(ev) == 3 and _is_hashes(ev[1]) and isinstance(ev[2], list) and len(ev[2]) == len(ev[1])
                  and all(p is None or type(p) is int for p in ev[2]))
        if not ok:
            raise ValueError(f"malformed event {ev!r:.80}")


def apply_snapshot(index: RadixIndex, replica: str, hashes: Sequence[int], parents: Sequence[int | None],
                   clear: bool = True) -> None:
    """Replace what `index` knows of `replica` with a snapshot of (hash, parent) pairs (with
    `clear=False`, add a later part of one: its chains hang on blocks the parts before placed).

    Blocks whose parent the replica no longer caches can never be matched (a match is a prefix)
    and are left out."""
    if clear:
        index.clear_replica(replica)
    children: dict[int | None, list[int]] = {}
    for h, p in zip(hashes, parents):
        children.setdefault(p, []).append(h)
    here = set(hashes)
    todo = [(p, h) for p, kids in children.items() if p is None or p not in here for h in kids]
    while todo:  # walk each maximal single-child chain and insert it in one go
        parent, h = todo.pop()
        chain = [h]
        while len(kids := children.get(chain[-1], ())) == 1:
            chain.append(kids[0])
        index.insert(replica, chain, parent=parent)
        todo.extend((chain[-1], k) for k in children.get(chain[-1], ()))


def _redis(url: str, timeout_s: float, password_env: str | None = None):
    """A client of `url`, with the password in the environment variable `password_env` (if set)."""
    import os

    import redis

    password = os.environ.get(password_env) if password_env else None
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                **({"password": password} if password else {}))


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
                 maxlen: int = 100_000, password_env: str | None = None, clock: Callable[[], float] = time.monotonic):
        self.stream, self.replica_id = stream, replica_id
        self._take_events, self._snapshot = take_events, snapshot
        self._interval_s, self._maxlen = interval_s, maxlen
        self._redis = _redis(redis_url, timeout_s=max(2.0, 4 * interval_s), password_env=password_env)
        self._seq = 0
        self._need_snapshot = False
        self._clock, self._last_snapshot_s = clock, -1e9
        self.num_snapshots = 0
        self._control_id = "$"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{replica_id}", daemon=True)

    @classmethod
    def for_engine(cls, engine, redis_url: str, stream: str, replica_id: str,
                   password_env: str | None = None) -> KVEventPublisher:
        """Publish an `AsyncLLMEngine`'s KV events (turned on here), taken under its lock."""
        pool = engine.engine.block_pool
        pool.enable_events = True
        return cls(redis_url, stream, replica_id, lambda: engine.locked(pool.take_events),
                   lambda: engine.locked(pool.snapshot), password_env=password_env).start()

    def start(self) -> KVEventPublisher:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._redis.close()

    def publish_once(self) -> None:
        """Publish pending events (and a snapshot when one is owed and the last is at least
        RESYNC_MIN_INTERVAL_S old: a flood of resync requests costs one snapshot a second).
        Raises redis errors."""
        events = encode_events(self._take_events())
        now = self._clock()
        snapshot = self._need_snapshot and now - self._last_snapshot_s >= RESYNC_MIN_INTERVAL_S
        if snapshot:  # taken after the events, so it already holds what they say
            pairs = topological(self._snapshot())
            events = [[SNAPSHOT, [h for h, _ in pairs], [p for _, p in pairs]]]
            self._last_snapshot_s, self._need_snapshot = now, False
            self.num_snapshots += 1
        for entry in split_events(events):
            self._seq += 1
            self._redis.xadd(self.stream, {"v": VERSION, "r": self.replica_id, "id": self._seq,
                                           "ev": msgpack.packb(entry)},
                             maxlen=self._maxlen, approximate=True)

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
                 approx_ttl_s: float = 120.0, pending_ttl_s: float = 10.0, poll_s: float = 0.05,
                 resync_every_s: float = 2.0, password_env: str | None = None,
                 on_reject: Callable[[str], None] | None = None):
        # on_reject(why): told of every skipped entry (the router counts them as a metric).
        self.stream, self._on_reject = stream, on_reject
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
        self._url, self._poll_s = redis_url, poll_s
        self._stop = threading.Event()
        self._thread = None
        # Entries skipped, by why: "version" (another format), "oversized" (dropped unread), "malformed".
        self.rejected: dict[str, int] = {"version": 0, "oversized": 0, "malformed": 0}
        if redis_url:
            self._redis = _redis(redis_url, timeout_s=2.0, password_env=password_env)
            self._read = self._redis.register_script(_READ_SCRIPT)
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

    def set_capacity(self, replica: str, num_blocks: int) -> None:
        """`replica`'s KV cache holds `num_blocks` blocks (it says so over Ray, not over Redis): no
        more of its blocks are indexed than it can hold, however many events claim otherwise."""
        with self._lock:
            self.precise.set_limit(replica, num_blocks)
            self.approx.set_limit(replica, num_blocks)

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
        """Apply one stream entry. Returns False when entries were missed (a resync is due).

        The lock is taken per piece of `_APPLY_PIECE` blocks (an entry holds up to
        `_HASHES_PER_ENTRY`), so `match` never waits long behind a large snapshot, nor behind a
        flood of forged ones."""
        with self._lock:
            if not self._is_ours(replica):
                return True  # a replica that left (or is not ours yet): nothing to route to
            last = self._last_seq.get(replica)
            # A replica numbers its entries 1, 2, 3, ... and the stream is read once, in order: any
            # other step (a lost entry, or a forged one: a writer with the password) is a gap, and
            # the replica's next snapshot repairs it. Trusting a number that went back would let
            # one forged high number hide the replica's real entries.
            in_order = seq == 1 if last is None else seq == last + 1
            self._last_seq[replica] = seq
        index, n = self.precise, _APPLY_PIECE
        for ev in events:
            kind = ev[0]
            if kind in (CLEARED, SNAPSHOT):
                while True:
                    with self._lock:
                        if not self._is_ours(replica):
                            return True  # it left meanwhile
                        if index.drop_oldest(replica, n) == 0:
                            index.clear_replica(replica)  # known, and empty
                            break
            hashes = ev[1] if len(ev) > 1 else []
            for i in range(0, len(hashes), n):  # a snapshot's pieces, like its parts, parents first
                with self._lock:
                    if not self._is_ours(replica):
                        return True  # it left meanwhile
                    if kind == STORED:
                        index.insert(replica, hashes[i:i + n], parent=ev[2] if i == 0 else hashes[i - 1])
                    elif kind == REMOVED:
                        index.remove(replica, hashes[i:i + n])
                    else:
                        apply_snapshot(index, replica, hashes[i:i + n], ev[2][i:i + n], clear=False)
            if kind == SNAPSHOT:
                in_order = True
                self._resync_asked.pop(replica, None)
        return in_order

    def _is_ours(self, replica: str) -> bool:
        return self._replicas is None or replica in self._replicas

    def _reject(self, why: str, detail: str) -> None:
        self.rejected[why] += 1
        if self._on_reject is not None:
            self._on_reject(why)
        if self.rejected[why] in (1, 10, 100) or self.rejected[why] % 1000 == 0:  # a flood logs a few lines
            log.warning("KV events: skipped a %s entry of %s (%s); %d so far", why, self.stream, detail,
                        self.rejected[why])

    def request_resync(self, replica: str) -> None:
        now = time.monotonic()
        if now - self._resync_asked.get(replica, -1e9) < self._resync_every_s:
            return
        self._resync_asked[replica] = now
        log.info("KV events: %s missed entries of %s; asking it for a snapshot", self.stream, replica)
        self._redis.xadd(self.stream + ":resync", {"r": replica}, maxlen=1000, approximate=True)

    def _apply_entry(self, fields: dict) -> None:
        if b"oversized" in fields:  # the read script's stub: the entry stayed in Redis
            self._reject("oversized", f"{fields[b'oversized'][:20].decode(errors='replace')} bytes, over {MAX_ENTRY_BYTES}")
            return
        if fields.get(b"v") != str(VERSION).encode():
            self._reject("version", f"version {fields.get(b'v', b'none')[:20]!r}, this router reads {VERSION}")
            return
        raw = fields.get(b"ev", b"")
        if len(raw) > MAX_ENTRY_BYTES:
            self._reject("oversized", f"{len(raw)} bytes of events, over {MAX_ENTRY_BYTES}")
            return
        try:
            replica = fields[b"r"].decode()
            if not self._is_ours(replica):
                return  # a replica that left (or is not ours yet): nothing to route to, so not unpacked
            seq = int(fields[b"id"])
            n = len(raw)
            # No honest list is longer than a publisher's parts (split_events): a longer one fails
            # here, before it becomes a million Python objects.
            events = msgpack.unpackb(raw, max_str_len=0, max_bin_len=0, max_map_len=0, max_ext_len=0,
                                     max_array_len=min(n, _HASHES_PER_ENTRY))
            _check_events(events)
        except (KeyError, ValueError, TypeError, UnicodeDecodeError, msgpack.UnpackException) as e:
            self._reject("malformed", repr(e)[:200])
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
                entries = self._read(keys=[self.stream], args=[last_id, _READ_COUNT, MAX_ENTRY_BYTES + _FIELDS_BYTES,
                                                               MAX_READ_BYTES])
                if not self._connected:
                    log.info("KV events: reading %s; routing is precise", self.stream)
                self._connected = True
                backoff = 0.1
                for entry_id, flat in entries:
                    last_id = entry_id.decode()
                    self._apply_entry(dict(zip(flat[::2], flat[1::2])))
                for replica in list(self._resync_asked):  # a request may be lost: ask again
                    self.request_resync(replica)
                if len(entries) < _READ_COUNT:  # caught up: wait for more
                    self._stop.wait(self._poll_s)
            except Exception as e:  # noqa: BLE001 - redis down: approximate until it is back
                if self._connected:
                    log.warning("KV events: lost redis (%r); routing is approximate until it is back", e)
                self._connected = False
                first = True
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
