"""Paged KV cache: the tensors, the block pool, per-request block tables and prefix reuse.

Layouts (DESIGN.md §4), one tensor `[num_layers, planes, num_blocks, block_size, heads, head_dim]`:
- K/V (every family but DeepSeek's): planes K and V, the rank's KV heads; `KVCache.layer(i)` is
  layer i's `[2, num_blocks, block_size, num_kv_heads, head_dim]` view (K at 0, V at 1).
- latent (multi-head latent attention, DeepSeek-V3): one vector of `kv_lora_rank +
  qk_rope_head_dim` values per token per layer, no K/V split, no heads (one plane, one "head", so
  every block-moving path, the KV transfer's included, takes both layouts alike);
  `KVCache.layer(i)` is `[num_blocks, block_size, latent_dim]`. Every tensor-parallel rank holds
  the whole latent.
A request's block table maps its logical blocks to physical block ids.

Prefix reuse: a *full* block is named by its chained hash `h_i = H(h_{i-1}, tokens of block i)`
(`block_hashes`), so equal hashes mean equal prefixes. Cached blocks keep their hash while free and
sit in an LRU free queue; a new request whose prefix hashes hit takes them back (ref counts let many
requests share one block). Allocation evicts the least recently freed block first.

The pool can record KV events (blocks stored / removed / all cleared) for the prefix-aware router.
Nothing here knows about models, scheduling policy or Ray.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from pdserve.engine.shared_memory import shared_zeros


class KVCache:
    """The KV tensors of all layers, allocated once."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 layer_slots: list[int] | None = None, layer_groups: list[int] | None = None,
                 is_latent: bool = False):
        """`layer_slots`/`layer_groups` (kv_groups.py): each layer's slot in the tensor and its
        group, for a model of several layer groups; None: one slot per layer, one group.
        `is_latent`: the latent layout, `head_dim` values per token per layer (`num_kv_heads` 1)."""
        if is_latent and num_kv_heads != 1:
            raise ValueError("a latent cache has no KV heads: pass num_kv_heads=1 and the latent's width as head_dim")
        self.is_latent = is_latent
        self.num_layers = num_layers
        self.layer_slots = layer_slots
        self.layer_groups = layer_groups
        num_slots = num_layers if layer_slots is None else max(layer_slots) + 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_slots, 1 if is_latent else 2, num_blocks, block_size, num_kv_heads, head_dim)
        # On CPU in shared memory: a decode replica on this host copies exported blocks straight out.
        self.kv = (shared_zeros(shape, dtype) if torch.device(device).type == "cpu"
                   else torch.zeros(shape, dtype=dtype, device=device))

    def layer(self, i: int) -> torch.Tensor:
        """Layer i's cache: `[2, num_blocks, block_size, num_kv_heads, head_dim]`, or for the latent
        layout `[num_blocks, block_size, latent_dim]`."""
        kv = self.kv[i] if self.layer_slots is None else self.kv[self.layer_slots[i]]
        return kv[0, :, :, 0] if self.is_latent else kv

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes on this rank, all layers together."""
        return self.kv[:, :, 0, 0].numel() * self.kv.element_size()

    @staticmethod
    def bytes_per_block_for(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                            dtype: torch.dtype, is_latent: bool = False) -> int:
        planes = 1 if is_latent else 2
        return planes * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class BlockStored:
    """Blocks gained a hash: `block_hashes[0]`'s parent is `parent_hash` (None for a first block)."""
    block_hashes: list[int]
    parent_hash: int | None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free blocks than asked for (an internal condition the scheduler handles)."""


class BlockPool:
    """Physical blocks with reference counts, a hash -> block map and an LRU free queue.

    A block is *free* when its ref count is 0; a free block may still be *cached* (keep its hash)
    until it is evicted by `allocate`. `incref` pins blocks (a request sharing a prefix, or the KV
    exporter holding blocks under a lease); `free` unpins.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_events: bool = False):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.parent_of: dict[int, int | None] = {}  # hash -> its parent's hash (for KV-event snapshots)
        # Free blocks, least recently freed first. Values unused; OrderedDict gives O(1) removal.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.enable_events = enable_events
        self._events: list[KVEvent] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref count > 0)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks, evicting the least recently freed cached ones."""
        if n > len(self.free_queue):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        removed = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[block_id]
            if h is not None:
                self.block_hash[block_id] = None
                if self.cached.get(h) == block_id:
                    del self.cached[h]
                    if h in self.parent_of:  # published (a block of a layer group past the first is not)
                        del self.parent_of[h]
                        removed.append(h)
            self.ref_counts[block_id] = 1
            out.append(block_id)
        if removed and self.enable_events:
            self._events.append(BlockRemoved(removed))
        return out

    def incref(self, block_ids: Iterable[int]) -> None:
        """Pin blocks: a cached free block leaves the free queue."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Unpin blocks; those reaching 0 join the free queue's tail (evicted last).

        Callers pass a request's blocks in reverse so its tail blocks, the least likely to be
        shared, are evicted before its head.
        """
        for b in block_ids:
            rc = self.ref_counts[b]
            assert rc > 0, f"double free of block {b}"
            self.ref_counts[b] = rc - 1
            if rc == 1:
                self.free_queue[b] = None

    def lookup(self, h: int) -> int | None:
        return self.cached.get(h)

    def cache_block(self, block_id: int, h: int, parent_hash: int | None, publish: bool = True) -> None:
        """Name a full, computed block by its chained hash so later requests can reuse it.
        `publish`: record the KV event (a layer group other than the first does not: kv_groups.py)."""
        if self.block_hash[block_id] is not None:
            return
        if h in self.cached:
            # Another block already holds this prefix (computed concurrently); keep the first.
            return
        self.block_hash[block_id] = h
        self.cached[h] = block_id
        if publish:
            self.parent_of[h] = parent_hash
            if self.enable_events:
                self._events.append(BlockStored([h], parent_hash))

    def reset_prefix_cache(self) -> None:
        """Forget every hash (blocks in use keep their contents)."""
        for b in self.cached.values():
            self.block_hash[b] = None
        self.cached.clear()
        self.parent_of.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared())

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def snapshot(self) -> list[tuple[int, int | None]]:
        """(hash, parent hash) of every cached block: what a router resyncs from."""
        return list(self.parent_of.items())


class KVCacheManager:
    """Per-request block tables on top of a `BlockPool`.

    The scheduler asks it to find a request's cached prefix, to make room for new tokens, to name
    blocks once they are full and computed, and to free a request. It never touches tensors.
    """

    def __init__(self, pool: BlockPool, enable_prefix_caching: bool = True):
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    def match_prefix(self, hashes: Sequence[int], num_tokens: int) -> list[int]:
        """Physical blocks holding the longest cached prefix, leaving at least one token to compute.

        At most `(num_tokens - 1) // block_size` blocks: the last prompt token is always computed
        (its logits are needed) and never written into a shared block.
        """
        if not self.enable_prefix_caching:
            return []
        limit = min(len(hashes), (num_tokens - 1) // self.block_size)
        blocks = []
        for h in hashes[:limit]:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def allocate(self, request_id: str, num_tokens: int, new_cached_blocks: Sequence[int] = (),
                 num_computed_tokens: int = 0) -> bool:
        """Grow the request's table to hold `num_tokens`; first take `new_cached_blocks` (a prefix hit).
        (`num_computed_tokens` matters only to sliding layer groups: kv_groups.py.)

        Returns False (and changes nothing) when the pool cannot supply the blocks.
        """
        table = self.block_tables.get(request_id, [])
        num_needed = -(-num_tokens // self.block_size) - len(table) - len(new_cached_blocks)
        # Cached-but-free blocks of the hit count against the free pool while they sit in it.
        num_hit_free = sum(1 for b in new_cached_blocks if self.pool.ref_counts[b] == 0)
        if max(num_needed, 0) + num_hit_free > self.pool.num_free_blocks:
            return False
        if new_cached_blocks:
            self.pool.incref(new_cached_blocks)
            table = table + list(new_cached_blocks)
            self._num_cached_blocks[request_id] = len(table)
        if num_needed > 0:
            table = table + self.pool.allocate(num_needed)
        self.block_tables[request_id] = table
        return True

    def cache_full_blocks(self, request_id: str, hashes: Sequence[int], num_computed_tokens: int) -> None:
        """Name the request's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables[request_id]
        start = self._num_cached_blocks.get(request_id, 0)
        end = min(num_computed_tokens // self.block_size, len(hashes), len(table))
        for i in range(start, end):
            self.pool.cache_block(table[i], hashes[i], hashes[i - 1] if i > 0 else None)
        if end > start:
            self._num_cached_blocks[request_id] = end

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if table:
            self.pool.free(reversed(table))

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    # -- what `HybridKVCacheManager` (kv_groups.py) answers per layer group; here, the one group --
    def get_block_tables(self, request_id: str) -> list[list[int]]:
        return [self.block_tables.get(request_id, [])]

    def num_held_blocks(self, request_id: str) -> list[int]:
        return [len(self.block_tables.get(request_id, []))]

    def max_blocks_for(self, num_tokens: int, max_chunk_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def export_blocks(self, request_id: str) -> list[int]:
        return list(self.block_tables.get(request_id, []))

    def import_blocks(self, request_id: str, num_tokens: int, num_hit_blocks: int) -> tuple[int, list[int]]:
        return num_hit_blocks, self.block_tables[request_id][num_hit_blocks:]
