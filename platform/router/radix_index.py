"""`RadixIndex`: which replica holds which KV blocks, as a radix tree over chained block hashes.

A path from the root spells a prefix, one block hash per block; runs of single-child blocks are
compressed into one node. Every node records which replicas hold *all* of its blocks and when each
last used them, so a node is split wherever holder sets differ (a replica that lost a middle block
ends its match there). Chained hashes name whole prefixes, so a hash -> node map finds any block
in O(1): KV events that say "stored after parent P" or "removed H" need no walk from the root.

Bounded memory: each replica keeps the nodes it holds in a least-recently-used order (an
OrderedDict), ancestors always newer than descendants (inserts touch leaf-first), so trimming pops
the oldest entry, a leaf of that replica's subtree, one node (or the tail of one) at a time: no
heap rebuilt per eviction.

Cost: `match` and `insert` walk one node per compressed run; block runs compare in C. Nothing here
knows about Ray, Redis or engines.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Iterable, Sequence

from pdserve.engine.block_hash import ROOT_BLOCK_HASH


class _Node:
    __slots__ = ("run", "parent", "children", "holders")

    def __init__(self, run: tuple[int, ...], parent: _Node | None):
        self.run = run  # block hashes, root-most first (a tuple of ints: the GC need not track it)
        self.parent = parent  # None once merged away or deleted (and for the root)
        self.children: dict[int, _Node] = {}  # first hash of the child's run -> child
        self.holders: dict[str, float] = {}  # replica -> when it last used these blocks


class _Replica:
    __slots__ = ("num_blocks", "lru", "max_blocks")

    def __init__(self):
        self.num_blocks = 0
        self.max_blocks: int | None = None  # its own bound (`set_limit`), else the index's
        self.lru: OrderedDict[_Node, None] = OrderedDict()  # the nodes it holds, oldest first


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


class RadixIndex:
    """Which replicas hold which chained block hashes; see the module docstring.

    `max_blocks_per_replica` bounds each replica's holds (least recently used trimmed first)
    unless `set_limit` gave that replica its own bound; `clock` stamps uses (seconds; `expire`
    compares against it).
    """

    def __init__(self, max_blocks_per_replica: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if max_blocks_per_replica is not None and max_blocks_per_replica < 1:
            raise ValueError("max_blocks_per_replica must be at least 1")
        self.max_blocks_per_replica = max_blocks_per_replica
        self._clock = clock
        self._root = _Node((), None)
        self._where: dict[int, _Node] = {}
        self._replicas: dict[str, _Replica] = {}

    # ---- queries

    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def __len__(self) -> int:
        """Distinct blocks in the tree."""
        return len(self._where)

    def num_blocks(self, replica: str) -> int:
        rep = self._replicas.get(replica)
        return rep.num_blocks if rep else 0

    def blocks(self, replica: str) -> set[int]:
        """Every block hash `replica` holds (for tests, resync checks and debugging)."""
        rep = self._replicas.get(replica)
        return {h for node in rep.lru for h in node.run} if rep else set()

    def match(self, hashes: Sequence[int], replicas: Iterable[str] | None = None) -> dict[str, int]:
        """For each candidate replica (all known ones when None), how many leading blocks it holds."""
        result = dict.fromkeys(self._replicas if replicas is None else replicas, 0)
        alive = list(result)
        hashes = tuple(hashes)  # slices compare with runs in C
        node, i, n = self._root, 0, len(hashes)
        while alive and i < n:
            child = node.children.get(hashes[i])
            if child is None:
                break
            run = child.run
            size = len(run)
            seg = hashes[i:i + size]
            m = size if seg == run else _common_prefix(run, seg)
            holders = child.holders
            alive = [r for r in alive if r in holders]
            i += m
            for r in alive:
                result[r] = i
            if m < size:
                break
            node = child
        return result

    # ---- updates

    def insert(self, replica: str, hashes: Sequence[int], parent: int | None = None) -> int:
        """Record that `replica` holds `hashes`, a chain that starts at the root (`parent` None or
        the root hash) or right after block `parent`. Returns the blocks recorded: 0 when `parent`
        is unknown here (evicted, or never seen), since the chain cannot be placed.
        """
        if not hashes:
            return 0
        rep = self._replicas.get(replica)
        if rep is None:
            rep = self._replicas[replica] = _Replica()
        if parent is None or parent == ROOT_BLOCK_HASH:
            node = self._root
        else:
            node = self._where.get(parent)
            if node is None:
                return 0
            cut = node.run.index(parent) + 1
            if cut < len(node.run):
                self._split(node, cut)
        start = node
        hashes = tuple(hashes)
        path: list[_Node] = []
        i, n = 0, len(hashes)
        while i < n:
            child = node.children.get(hashes[i])
            if child is None:
                child = _Node(hashes[i:], node)
                node.children[hashes[i]] = child
                self._where.update(dict.fromkeys(child.run, child))
                path.append(child)
                break
            run = child.run
            size = len(run)
            seg = hashes[i:i + size]
            m = size if seg == run else _common_prefix(run, seg)
            if m < size:
                self._split(child, m)
            path.append(child)
            node = child
            i += m
        now = self._clock()
        lru = rep.lru
        gained = []
        # Leaf first, then up to the root: ancestors stay newer than descendants in the LRU.
        for nd in reversed(path):
            if replica in nd.holders:
                lru.move_to_end(nd)
            else:
                lru[nd] = None
                rep.num_blocks += len(nd.run)
                gained.append(nd)
            nd.holders[replica] = now
        nd = start
        while nd is not self._root:
            if replica in nd.holders:
                nd.holders[replica] = now
                lru.move_to_end(nd)
            nd = nd.parent
        for nd in reversed(gained):  # a new holder may make a split needless: merge root-first
            if nd.parent is not None:
                self._compact(nd)
        limit = self._limit(rep)
        if limit is not None and rep.num_blocks > limit:
            self._trim(rep, replica, limit)
        return n

    def set_limit(self, replica: str, max_blocks: int) -> None:
        """Bound `replica`'s holds by `max_blocks` from now on (trimming it now if it holds more)."""
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        rep = self._replicas.get(replica)
        if rep is None:
            rep = self._replicas[replica] = _Replica()
        rep.max_blocks = max_blocks
        if rep.num_blocks > max_blocks:
            self._trim(rep, replica, max_blocks)

    def _limit(self, rep: _Replica) -> int | None:
        return rep.max_blocks if rep.max_blocks is not None else self.max_blocks_per_replica

    def remove(self, replica: str, hashes: Iterable[int]) -> None:
        """`replica` no longer holds these blocks; its matches end before the first of them."""
        rep = self._replicas.get(replica)
        if rep is None:
            return
        for h in hashes:
            node = self._where.get(h)
            if node is None or replica not in node.holders:
                continue
            at = node.run.index(h)
            if at:
                self._split(node, at)
                node = node.children[h]
            if len(node.run) > 1:
                self._split(node, 1)
            self._drop(rep, node, replica)

    def remove_replica(self, replica: str) -> None:
        """Forget a replica (it left the deployment, or its cache was cleared)."""
        rep = self._replicas.pop(replica, None)
        if rep is None:
            return
        for node in rep.lru:
            del node.holders[replica]
        for node in rep.lru:  # merges may retire nodes of this list: skip those
            if node.parent is not None:
                self._prune(node)

    def drop_oldest(self, replica: str, num_blocks: int) -> int:
        """Drop `replica`'s least recently used holds until about `num_blocks` blocks went (whole
        holds); returns how many it still holds. Clearing a large replica a slice at a time lets
        the caller release its lock between slices."""
        rep = self._replicas.get(replica)
        if rep is None:
            return 0
        dropped = 0
        while rep.lru and dropped < num_blocks:
            oldest = next(iter(rep.lru))  # a descendant is older than its ancestors: leaves go first
            dropped += len(oldest.run)
            self._drop(rep, oldest, replica)
        return rep.num_blocks

    def clear_replica(self, replica: str) -> None:
        """Drop every block of `replica` but keep it as a known (empty) replica, and its bound."""
        limit = self._replicas[replica].max_blocks if replica in self._replicas else None
        self.remove_replica(replica)
        self._replicas[replica] = _Replica()
        self._replicas[replica].max_blocks = limit

    def expire(self, older_than: float) -> int:
        """Drop holds last used before `older_than` (on `clock`'s scale), oldest first; returns the
        blocks dropped. (A node split off a run's end ranks as its replica's oldest hold, so expiry
        can wait behind it until it expires too.)"""
        dropped = 0
        for replica, rep in self._replicas.items():
            lru = rep.lru
            while lru:
                oldest = next(iter(lru))
                if oldest.holders[replica] >= older_than:
                    break
                dropped += len(oldest.run)
                self._drop(rep, oldest, replica)
        return dropped

    # ---- internals

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node` after `at` blocks; the tail becomes its only child, with the same holders.

        The tail joins each holder's LRU at the oldest end: a descendant must stay older than its
        ancestor, and an OrderedDict inserts only at its ends."""
        tail = _Node(node.run[at:], node)
        node.run = node.run[:at]
        tail.children = node.children
        for c in tail.children.values():
            c.parent = tail
        node.children = {tail.run[0]: tail}
        self._where.update(dict.fromkeys(tail.run, tail))
        tail.holders = dict(node.holders)
        for replica in tail.holders:
            lru = self._replicas[replica].lru
            lru[tail] = None
            lru.move_to_end(tail, last=False)
        return tail

    def _drop(self, rep: _Replica, node: _Node, replica: str) -> None:
        del node.holders[replica]
        del rep.lru[node]
        rep.num_blocks -= len(node.run)
        self._prune(node)

    def _prune(self, node: _Node) -> None:
        """Delete holderless leaves upwards; merge a node into its parent when nothing tells them apart."""
        while node is not self._root and not node.holders and not node.children:
            parent = node.parent
            del parent.children[node.run[0]]
            for h in node.run:
                if self._where.get(h) is node:
                    del self._where[h]
            node.parent = None  # dead
            node = parent
        if node is not self._root:
            self._compact(node)

    def _compact(self, node: _Node) -> None:
        """Merge `node` into its parent, and its only child into it, where holders are the same."""
        parent = node.parent
        if parent is not self._root and len(parent.children) == 1 and self._merge_child(parent):
            node = parent
        if len(node.children) == 1:
            self._merge_child(node)

    def _merge_child(self, node: _Node) -> bool:
        (child,) = node.children.values()
        if child.holders.keys() != node.holders.keys():
            return False
        for replica, last_used in child.holders.items():
            del self._replicas[replica].lru[child]  # the ancestor's entry, newer, stands for both
            if last_used > node.holders[replica]:
                node.holders[replica] = last_used
        self._where.update(dict.fromkeys(child.run, node))
        node.run = node.run + child.run
        node.children = child.children
        for c in node.children.values():
            c.parent = node
        child.parent = None  # dead
        return True

    def _trim(self, rep: _Replica, replica: str, limit: int) -> None:
        # Trim a little below the bound so the next inserts need no trimming (fewer partial splits).
        target = limit - limit // 128
        while rep.num_blocks > target:
            oldest = next(iter(rep.lru))
            excess = rep.num_blocks - target
            if excess < len(oldest.run):
                oldest = self._split(oldest, len(oldest.run) - excess)
            self._drop(rep, oldest, replica)
