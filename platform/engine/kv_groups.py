"""Layer groups: block tables for a model whose layers keep different spans of KV (Gemma 3's
sliding-window layers beside its global ones). The design is in docs/architecture.md ("KV cache
layer groups"); in short:

- `layer_groups` splits the layers into groups of equal size: the global layers, and the sliding
  layers of each window, each kind cut into runs of `num_slots` layers (the smallest kind's count).
  The cache tensor holds `num_slots` layer slots (`KVCache(layer_slots=...)`): layer i of a group
  writes slot i of it, so one physical block id is one group's KV for one block of tokens, and all
  groups share one pool of block ids. A model with one kind of layer has one group of all its
  layers and the plain `KVCacheManager` (kv_cache.py), exactly as before.
- `HybridKVCacheManager` keeps one block table per group per request. Every table has the same
  logical length; a sliding group gives back the blocks wholly before its window once the request
  has computed past them (`cache_full_blocks`) and keeps block 0 in their entries (never read: the
  window masks them out). A request then holds at most `cdiv(W - 1 + chunk, block_size) + 1` blocks
  per sliding group.
- Prefix caching: group g caches block i under `group_block_hash(h_i, g)` (group 0's key is h_i
  itself, the only one published to the router). A hit of k blocks needs group 0's blocks 0..k-1
  and, for each sliding group, the blocks its window reaches back to from position k*block_size;
  the longest k that all groups hold is taken, so a hit is always exact. Blocks a sliding group gave
  back stay cached (free, evictable) until the pool reuses them.
- Transfer: a request's blocks go out as one list ordered by logical block, then group
  (`export_blocks`), which both sides derive alike; a decode replica's local prefix hit is then a
  prefix of that list, so `first_block` keeps its meaning and the wire protocol is unchanged.

Pure: no tensors, no models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pdserve.engine.block_hash import group_block_hash
from pdserve.engine.kv_cache import BlockPool

PLACEHOLDER_BLOCK = 0  # a given-back entry of a sliding table: any valid id, masked out by the window


@dataclass(frozen=True)
class LayerGroup:
    layers: tuple[int, ...]
    window: int | None  # the sliding window in tokens; None: a global group


def layer_groups(num_layers: int, layer_windows: Sequence[int | None] = ()) -> list[LayerGroup]:
    """The model's layer groups, global ones first (group 0's hashes are the router's)."""
    if not layer_windows or len(set(layer_windows)) == 1:
        return [LayerGroup(tuple(range(num_layers)), layer_windows[0] if layer_windows else None)]
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        kinds.setdefault(w, []).append(i)
    slots = min(len(v) for v in kinds.values())
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    return [LayerGroup(tuple(kinds[w][s:s + slots]), w) for w in order for s in range(0, len(kinds[w]), slots)]


def layer_slots(groups: Sequence[LayerGroup]) -> tuple[list[int], list[int]]:
    """(slot of each layer, group of each layer)."""
    num_layers = sum(len(g.layers) for g in groups)
    slot, group = [0] * num_layers, [0] * num_layers
    for gi, g in enumerate(groups):
        for s, layer in enumerate(g.layers):
            slot[layer], group[layer] = s, gi
    return slot, group


def first_needed_block(num_computed: int, window: int | None, block_size: int) -> int:
    """The first block a layer of this window still reads once `num_computed` tokens are computed:
    the next query (position num_computed) sees positions num_computed - window + 1 on."""
    if window is None:
        return 0
    return max(0, (num_computed - window + 1) // block_size)


def max_blocks_per_group(num_tokens: int, window: int | None, block_size: int, max_chunk_tokens: int) -> int:
    """The most blocks one request of `num_tokens` holds in a group at once (a prefill chunk of up
    to `max_chunk_tokens` is written whole before its start falls out of the window)."""
    full = -(-num_tokens // block_size)
    if window is None:
        return full
    return min(full, -(-(window - 1 + max_chunk_tokens) // block_size) + 1)


class HybridKVCacheManager:
    """`KVCacheManager`'s interface over one block table per layer group (see the module docstring).

    A prefix hit (`match_prefix`) is one entry per logical block: a tuple of one block id per group,
    None where a sliding group does not keep that block."""

    def __init__(self, pool: BlockPool, groups: Sequence[LayerGroup], enable_prefix_caching: bool = True):
        self.pool = pool
        self.block_size = pool.block_size
        self.groups = list(groups)
        self.windows = [g.window for g in self.groups]
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[list[int]]] = {}
        self._first_held: dict[str, list[int]] = {}  # per group: entries before it are placeholders
        self._num_cached_blocks: dict[str, list[int]] = {}

    def _key(self, h: int, g: int) -> int:
        return h if g == 0 else group_block_hash(h, g)

    def match_prefix(self, hashes: Sequence[int], num_tokens: int) -> list[tuple[int | None, ...]]:
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        k = min(len(hashes), (num_tokens - 1) // bs)
        found: list[list[int | None]] = []
        for g, w in enumerate(self.windows):  # global groups first: their run of hits bounds k
            blocks = []
            for h in hashes[:k] if w is None else ():
                b = self.pool.lookup(self._key(h, g))
                if b is None:
                    break
                blocks.append(b)
            k = min(k, len(blocks)) if w is None else k
            found.append(blocks)
        for g, w in enumerate(self.windows):
            if w is not None:
                found[g] = [self.pool.lookup(self._key(h, g)) for h in hashes[:k]]
        while k > 0:  # the longest k whose windows' blocks every sliding group holds
            missing = [j for g, w in enumerate(self.windows) if w is not None
                       for j in range(first_needed_block(k * bs, w, bs), k) if found[g][j] is None]
            if not missing:
                break
            k = max(missing)  # a k past a missing block whose window reaches it fails too
        if k == 0:
            return []
        starts = [first_needed_block(k * bs, w, bs) for w in self.windows]
        return [tuple(found[g][j] if j >= starts[g] else None for g in range(len(self.groups))) for j in range(k)]

    def allocate(self, request_id: str, num_tokens: int, new_cached_blocks: Sequence[tuple] = (),
                 num_computed_tokens: int = 0) -> bool:
        """As `KVCacheManager.allocate`. `num_computed_tokens`: tokens whose KV arrives from elsewhere
        (an import); a sliding group takes no block for what its window no longer needs after them."""
        tables = self.block_tables.get(request_id) or [[] for _ in self.groups]
        length = len(tables[0])
        if num_computed_tokens and new_cached_blocks:  # hit blocks a window has left behind: not taken
            needed = [first_needed_block(num_computed_tokens, w, self.block_size) for w in self.windows]
            new_cached_blocks = [tuple(b if length + j >= needed[g] else None for g, b in enumerate(entry))
                                 for j, entry in enumerate(new_cached_blocks)]
        num_needed = -(-num_tokens // self.block_size) - length - len(new_cached_blocks)
        start = length + len(new_cached_blocks)  # the first new entry
        skipped = [max(0, min(first_needed_block(num_computed_tokens, w, self.block_size) - start, num_needed))
                   for w in self.windows]
        hit_ids = [b for entry in new_cached_blocks for b in entry if b is not None]
        num_hit_free = sum(1 for b in hit_ids if self.pool.ref_counts[b] == 0)
        if max(num_needed, 0) * len(self.groups) - sum(skipped) + num_hit_free > self.pool.num_free_blocks:
            return False
        if request_id not in self.block_tables:
            self.block_tables[request_id] = tables
            self._first_held[request_id] = [0] * len(self.groups)
            self._num_cached_blocks[request_id] = [0] * len(self.groups)
        if new_cached_blocks:
            self.pool.incref(hit_ids)
            first_held = self._first_held[request_id]
            for g, table in enumerate(tables):
                column = [entry[g] for entry in new_cached_blocks]
                if length == 0:
                    first_held[g] = next((j for j, b in enumerate(column) if b is not None), len(column))
                table.extend(PLACEHOLDER_BLOCK if b is None else b for b in column)
            self._num_cached_blocks[request_id] = [len(t) for t in tables]
        if num_needed > 0:
            first_held = self._first_held[request_id]
            for g, table in enumerate(tables):
                if skipped[g]:  # it holds nothing before (hit blocks that far back were not taken)
                    first_held[g] = len(table) + skipped[g]
                    table.extend([PLACEHOLDER_BLOCK] * skipped[g])
                table.extend(self.pool.allocate(num_needed - skipped[g]))
        return True

    def cache_full_blocks(self, request_id: str, hashes: Sequence[int], num_computed_tokens: int) -> None:
        """Name the blocks now full and computed, then give back each sliding group's blocks that
        fell out of its window (named first, so they stay reusable while free)."""
        tables = self.block_tables[request_id]
        first_held, cached = self._first_held[request_id], self._num_cached_blocks[request_id]
        bs = self.block_size
        for g, table in enumerate(tables):
            if self.enable_prefix_caching:
                end = min(num_computed_tokens // bs, len(hashes), len(table))
                for i in range(max(cached[g], first_held[g]), end):
                    parent = hashes[i - 1] if i > 0 else None
                    self.pool.cache_block(table[i], self._key(hashes[i], g), parent, publish=g == 0)
                cached[g] = max(cached[g], end)
            stop = min(first_needed_block(num_computed_tokens, self.windows[g], bs), len(table))
            if stop > first_held[g]:
                self.pool.free(reversed(table[first_held[g]:stop]))
                table[first_held[g]:stop] = [PLACEHOLDER_BLOCK] * (stop - first_held[g])
                first_held[g] = stop

    def free(self, request_id: str) -> None:
        tables = self.block_tables.pop(request_id, None)
        first_held = self._first_held.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if tables:
            for table, start in zip(reversed(tables), reversed(first_held)):
                self.pool.free(reversed(table[start:]))

    def get_block_tables(self, request_id: str) -> list[list[int]]:
        return self.block_tables.get(request_id, [])

    def num_held_blocks(self, request_id: str) -> list[int]:
        """Blocks the request holds in each group."""
        tables = self.block_tables.get(request_id, [])
        return [len(t) - s for t, s in zip(tables, self._first_held.get(request_id, []))]

    def max_blocks_for(self, num_tokens: int, max_chunk_tokens: int) -> int:
        return sum(max_blocks_per_group(num_tokens, w, self.block_size, max_chunk_tokens) for w in self.windows)

    def export_blocks(self, request_id: str) -> list[int]:
        """The held blocks in transfer order: by logical block, then group."""
        return [b for _, b in self._held_entries(request_id)]

    def import_blocks(self, request_id: str, num_tokens: int, num_hit_blocks: int) -> tuple[int, list[int]]:
        """After `allocate` with a hit of `num_hit_blocks` for a request whose first `num_tokens`
        arrive from another engine: give back what the windows no longer need, then (entries this
        side holds already, the blocks to fill), in `export_blocks`' order."""
        tables, first_held = self.block_tables[request_id], self._first_held[request_id]
        for g, table in enumerate(tables):
            stop = min(first_needed_block(num_tokens, self.windows[g], self.block_size), len(table))
            if stop > first_held[g]:
                self.pool.free(reversed(table[first_held[g]:stop]))
                table[first_held[g]:stop] = [PLACEHOLDER_BLOCK] * (stop - first_held[g])
                first_held[g] = stop
        entries = self._held_entries(request_id)
        num_local = sum(1 for j, _ in entries if j < num_hit_blocks)
        return num_local, [b for _, b in entries[num_local:]]

    def _held_entries(self, request_id: str) -> list[tuple[int, int]]:
        tables, first_held = self.block_tables.get(request_id, []), self._first_held.get(request_id, [])
        if not tables:
            return []
        return [(j, table[j]) for j in range(len(tables[0])) for table, start in zip(tables, first_held)
                if j >= start]
