"""KV-event stream entries, bounded: what a publisher has to say is cut into entries of a bounded
size (a snapshot in parts, parents first), and a router skips, unread, entries of another
version, over the size bound, or malformed, counting each."""

import msgpack
import pytest

from pdserve.router import kv_events as ke
from pdserve.router.kv_events import (REMOVED, SNAPSHOT, SNAPSHOT_MORE, STORED, KVEventIndex, apply_snapshot,
                                      split_events, topological)
from pdserve.router.radix_index import RadixIndex


def _tree(depth: int, fan: int) -> list[tuple[int, int | None]]:
    """(hash, parent) pairs of a tree of blocks, children listed before their parents."""
    pairs, level, next_id = [], [None], 1
    for _ in range(depth):
        new = []
        for parent in level:
            for _ in range(fan):
                pairs.append((next_id, parent))
                new.append(next_id)
                next_id += 1
        level = new
    return pairs[::-1]


def test_long_events_are_cut_into_bounded_entries(monkeypatch):
    monkeypatch.setattr(ke, "_HASHES_PER_ENTRY", 10)
    chain = list(range(100, 125))
    entries = split_events([[STORED, chain, 7], [REMOVED, list(range(25))], [ke.CLEARED]])
    assert all(sum(len(e[1]) if len(e) > 1 else 1 for e in entry) <= 10 for entry in entries)
    stored = [e for entry in entries for e in entry if e[0] == STORED]
    assert [h for e in stored for h in e[1]] == chain  # in order, each part continuing the last
    assert [e[2] for e in stored] == [7, chain[9], chain[19]]
    assert entries[-1][-1] == [ke.CLEARED]


def test_a_snapshot_in_parts_builds_what_one_snapshot_builds(monkeypatch):
    monkeypatch.setattr(ke, "_HASHES_PER_ENTRY", 7)
    pairs = topological(_tree(depth=3, fan=3) + [(999, 12345)])  # 999's parent is not cached: left out
    assert len(pairs) == 39 and 999 not in [h for h, _ in pairs]
    seen = set()
    for h, parent in pairs:  # parents before children
        assert parent is None or parent in seen
        seen.add(h)
    whole, parts = RadixIndex(), RadixIndex()
    apply_snapshot(whole, "r", [h for h, _ in pairs], [p for _, p in pairs])
    entries = split_events([[SNAPSHOT, [h for h, _ in pairs], [p for _, p in pairs]]])
    kinds = [e[0] for entry in entries for e in entry]
    assert kinds[0] == SNAPSHOT and set(kinds[1:]) == {SNAPSHOT_MORE} and len(entries) > 2
    parts.insert("r", [5000, 5001])  # stale: the first part clears it
    for entry in entries:
        for kind, hashes, parents in entry:
            apply_snapshot(parts, "r", hashes, parents, clear=kind == SNAPSHOT)
    assert parts.blocks("r") == whole.blocks("r") == seen


def test_a_router_skips_bad_entries_unread_and_counts_them(monkeypatch):
    told = []
    index = KVEventIndex(None, "s", on_reject=told.append)
    index.set_replicas(["r"])
    unpacked = []
    real = msgpack.unpackb
    monkeypatch.setattr(ke.msgpack, "unpackb", lambda data, **kw: unpacked.append(len(data)) or real(data, **kw))
    good = {b"v": b"1", b"r": b"r", b"id": b"1", b"ev": msgpack.packb([[STORED, [11, 12], None]])}
    index._apply_entry(good)
    bomb = b"\xdd" + (4 << 20).to_bytes(4, "big") + b"\x90" * (4 << 20)  # 4 Mi empty arrays
    for fields in ({**good, b"v": b"2"}, {k: v for k, v in good.items() if k != b"v"},
                   {**good, b"id": b"2", b"ev": bomb}, {**good, b"id": b"3", b"ev": b"\xc1"},
                   {**good, b"id": b"4", b"ev": msgpack.packb([[STORED, ["x"], None]])}):
        index._apply_entry(fields)
    assert index.rejected == {"version": 2, "oversized": 1, "malformed": 2}
    assert sorted(told) == ["malformed", "malformed", "oversized", "version", "version"]  # the metric's increments
    assert max(unpacked) < ke.MAX_ENTRY_BYTES  # the bomb was never unpacked
    assert index.precise.blocks("r") == {11, 12}


def test_lists_longer_than_a_publishers_parts_and_strangers_entries_are_not_unpacked(monkeypatch):
    index = KVEventIndex(None, "s")
    index.set_replicas(["r"])
    unpacked = []
    real = msgpack.unpackb
    monkeypatch.setattr(ke.msgpack, "unpackb", lambda data, **kw: unpacked.append(len(data)) or real(data, **kw))
    entry = {b"v": b"1", b"r": b"r", b"id": b"1"}
    longest = list(range(ke._HASHES_PER_ENTRY))
    index._apply_entry({**entry, b"ev": msgpack.packb([[STORED, longest, None]])})  # the largest honest part
    assert index.precise.num_blocks("r") == ke._HASHES_PER_ENTRY
    index._apply_entry({**entry, b"id": b"2", b"ev": msgpack.packb([[STORED, longest + [-1], None]])})
    assert index.rejected["malformed"] == 1 and index.precise.num_blocks("r") == ke._HASHES_PER_ENTRY
    index._apply_entry({**entry, b"r": b"stranger", b"ev": msgpack.packb([[STORED, [1], None]])})
    assert len(unpacked) == 2  # the stranger's entry was never unpacked


def test_a_forged_high_entry_number_does_not_hide_the_replicas_later_entries():
    index = KVEventIndex(None, "s")
    index.set_replicas(["r"])
    assert index.apply("r", 1, [[STORED, [1, 2], None]])
    assert not index.apply("r", 10**9, [[STORED, [666], None]])  # forged: a gap, so a resync is asked
    assert not index.apply("r", 2, [[STORED, [3], 2]])  # the replica's own next entry still applies
    assert index.precise.match([1, 2, 3], ["r"]) == {"r": 3}
    assert index.apply("r", 3, [[SNAPSHOT, [1, 2, 3], [None, 1, 2]]])  # the snapshot repairs the rest
    assert index.precise.blocks("r") == {1, 2, 3}
    assert index.apply("r", 4, [[STORED, [4], 3]])


def test_forged_events_index_no_more_blocks_than_the_replica_can_hold():
    index = KVEventIndex(None, "s", max_blocks_per_replica=1_000_000)
    index.request_resync = lambda replica: None
    index.set_replicas(["r"])
    index.set_capacity("r", 5000)  # what the replica reports over Ray
    for i in range(10):  # 400,000 forged blocks in its name
        chain = list(range((i + 1) << 40, ((i + 1) << 40) + ke._HASHES_PER_ENTRY))
        index._apply_entry({b"v": b"1", b"r": b"r", b"id": str(i + 1).encode(),
                            b"ev": msgpack.packb([[STORED, chain, None]])})
    assert index.precise.num_blocks("r") <= 5000


@pytest.mark.parametrize("url", ["redis://:secret@host:6379/0", "redis://user:secret@host/0", "rediss://u@h/0"])
def test_credentials_never_go_in_the_url(url):
    from pydantic import ValidationError

    from pdserve.config import RouterConfig

    with pytest.raises(ValidationError, match="redis_password_env"):
        RouterConfig(redis_url=url)
    RouterConfig(redis_url="redis://host:6379/0")
