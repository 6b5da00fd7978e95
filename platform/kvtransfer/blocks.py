"""Gather a request's blocks into one contiguous buffer, scatter a buffer into blocks; leases.

The engine's cache is one tensor `[layers, planes, num_blocks, block_size, kv_heads, head_dim]`
(planes: K and V, or one for the latent layout, whose one "head" is the latent; kv_cache.py). A
transfer moves `[layers, planes, n, block_size, heads in slice, head_dim]`, contiguous, so it goes
out in one send and lands in one receive, or slab by slab (`slab_view`: one layer's K, V or latent)
when a transfer is pipelined. `LeaseTable` pins an exported request's blocks (ref counts through the
engine's pool) until the importer acks or the lease runs out, and past that while a read is still
sending them (`hold`/`unhold`). Pure torch, no sockets.
"""

from __future__ import annotations

import hmac
import math
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from pdserve.engine.host_tensors import long_tensor
from pdserve.engine.kernels import triton_paged


def gather_blocks(kv: torch.Tensor, block_ids: list[int], heads: tuple[int, int] | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """`[layers, 2, n, block_size, heads in slice, head_dim]`, contiguous; into `out` when given.
    On a GPU the copy has finished when this returns: UCX reads the buffer outside torch's streams."""
    if kv.is_cuda:
        if triton_paged.HAS_TRITON:
            out = triton_paged.gather_blocks(kv, block_ids, heads, out)
        else:
            src = kv if heads is None else kv[:, :, :, :, heads[0]:heads[1]]
            index = long_tensor(block_ids, kv.device)
            out = src.index_select(2, index) if out is None else out.copy_(src.index_select(2, index))
        torch.cuda.current_stream(kv.device).synchronize()
        return out
    src = kv if heads is None else kv[:, :, :, :, heads[0]:heads[1]]
    if out is None:
        out = torch.empty((*src.shape[:2], len(block_ids), *src.shape[3:]), dtype=kv.dtype, device=kv.device)
    # mode="wrap" (ids checked by _block_index): "raise" would stage the whole result in a temporary.
    np.take(_bits(src), _block_index(block_ids, kv.shape[2]), axis=2, out=_bits(out), mode="wrap")
    return out


def scatter_blocks(kv: torch.Tensor, block_ids: list[int], data: torch.Tensor) -> None:
    """On a GPU the copy has finished when this returns: `data` (a staging buffer) may be reused."""
    if kv.is_cuda:
        if triton_paged.HAS_TRITON:
            triton_paged.scatter_blocks(kv, block_ids, data)
        else:
            kv.index_copy_(2, long_tensor(block_ids, kv.device), data)
        torch.cuda.current_stream(kv.device).synchronize()
        return
    _bits(kv)[:, :, _block_index(block_ids, kv.shape[2])] = _bits(data)


# On CPU the copies go through numpy: one thread, where torch's index ops wake its intra-op thread
# pool, whose spinning workers took the cores the transfer itself needs (measured: a scattered
# 32 MiB pull at 57% of raw ucxx with torch's copies, 93% with these). Same-size integer views
# copy any dtype bit for bit (numpy has no bfloat16).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(_BITS[t.element_size()]).numpy()


def cache_bits(buffer, element_size: int, block_shape: tuple[int, int, int, int],
               planes: int = 2) -> np.ndarray | None:
    """Another cache's memory (mapped from another process) as `_bits` views a cache tensor:
    `[layers, planes, blocks, block_size, heads, head_dim]` for `block_shape` `(layers, block_size,
    heads, head_dim)`; None when the size is not a whole number of blocks."""
    layers, block_size, heads, head_dim = block_shape
    bits = np.frombuffer(buffer, dtype=torch.empty(0, dtype=_BITS[element_size]).numpy().dtype)
    per_block = planes * layers * block_size * heads * head_dim
    if bits.size % per_block:
        return None
    return bits.reshape(layers, planes, bits.size // per_block, block_size, heads, head_dim)


def _wide(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors (of one dtype) as int64, for a copy in wide loads, where every one can be
    viewed so (its rows whole int64s, aligned); else as they are. Never one of each: a copy
    between two dtypes converts values."""
    try:
        return tuple(t.view(torch.int64) for t in tensors)
    except RuntimeError:
        return tensors


def _block_index(block_ids: list[int], num_blocks: int) -> np.ndarray:
    idx = np.asarray(block_ids, dtype=np.intp)
    if idx.size:
        _check_ids(idx, num_blocks, (int(idx.min()), int(idx.max())))
    return idx


def _check_ids(block_ids, num_blocks: int, ends: tuple[int, int] | None = None) -> None:
    """Every id names one of the cache's blocks (on a GPU an id past the end is a fault that takes
    the process down); `ends`, the lowest and highest id, where the caller knows them."""
    lo, hi = ends or (min(block_ids), max(block_ids))
    if lo < 0 or hi >= num_blocks:
        raise IndexError(f"block ids outside the cache's {num_blocks} blocks")


def copy_blocks(src: np.ndarray | torch.Tensor, src_ids: list[int], heads: tuple[int, int], kv: torch.Tensor,
                dst_ids: list[int]) -> None:
    """Blocks `src_ids` of another cache (`src`, `[layers, 2, blocks, block_size, heads, head_dim]`:
    on CPU its bits, on a GPU a tensor on `kv`'s device; heads `heads` of it) into blocks `dst_ids`
    of `kv`: one copy, no staging buffer. On CPU, a slice per run of blocks consecutive on both
    sides, so no index arrays; on a GPU asynchronous on the current stream: one strided copy when
    both sides are one run each (no ids to upload: on the H200, copy_blocks took ~240 us for 128 MiB
    whose copy alone is ~110 us), else one kernel over the ids."""
    if len(src_ids) != len(dst_ids) or not 0 <= heads[0] < heads[1] <= src.shape[4]:
        raise ValueError("copy_blocks: block counts differ, or heads outside the source")
    if not len(src_ids):
        return
    if kv.is_cuda:
        # The ids checked with builtins, a run by its ends: on the H200 host numpy's per-call costs
        # on a few hundred ids were ~60 us of a 128 MiB local pull's ~350 us.
        s, d, n = block_run(src_ids), block_run(dst_ids), len(src_ids)
        _check_ids(src_ids, src.shape[2], None if s is None else (s, s + n - 1))
        _check_ids(dst_ids, kv.shape[2], None if d is None else (d, d + n - 1))
        if s is not None and d is not None:
            into, out_of = _wide(kv, src)  # narrow, not slicing: less host work
            into.narrow(2, d, n).copy_(out_of.narrow(2, s, n).narrow(4, heads[0], heads[1] - heads[0]))
        elif triton_paged.HAS_TRITON:
            triton_paged.copy_blocks(src, src_ids, heads, kv, dst_ids)
        else:
            rows = src[:, :, :, :, heads[0]:heads[1]].index_select(2, long_tensor(src_ids, kv.device))
            kv.index_copy_(2, long_tensor(dst_ids, kv.device), rows)
        return
    src_index, dst_index = _block_index(src_ids, src.shape[2]), _block_index(dst_ids, kv.shape[2])
    dst = _bits(kv)
    if dst.dtype.itemsize != src.dtype.itemsize:
        raise ValueError("copy_blocks: element sizes differ")
    breaks = np.flatnonzero((np.diff(src_index) != 1) | (np.diff(dst_index) != 1)) + 1
    for start, end in zip(np.r_[0, breaks], np.r_[breaks, len(src_index)]):
        s, d, n = int(src_index[start]), int(dst_index[start]), int(end - start)
        dst[:, :, d:d + n] = src[:, :, s:s + n, :, heads[0]:heads[1]]


def block_pieces(kv: torch.Tensor, block_ids: list[int]) -> list[memoryview]:
    """The bytes of blocks `block_ids` (all heads) of every slab of a contiguous CPU cache, in the
    wire's order (slab by slab, each in the ids' order), as the fewest pieces: one per run of
    consecutive ids per slab. What a socket sends from, or receives into, with no copy."""
    num_slabs, num_blocks = kv.shape[0] * kv.shape[1], kv.shape[2]
    block_bytes = math.prod(kv.shape[3:]) * kv.element_size()
    idx = _block_index(block_ids, num_blocks)
    starts = np.r_[0, np.flatnonzero(np.diff(idx) != 1) + 1]
    runs = [(int(idx[a]) * block_bytes, int(n) * block_bytes) for a, n in zip(starts, np.diff(np.r_[starts, len(idx)]))]
    whole = memoryview(kv.reshape(-1).view(torch.uint8).numpy())
    slab_bytes = num_blocks * block_bytes
    return [whole[s * slab_bytes + b:s * slab_bytes + b + n] for s in range(num_slabs) for b, n in runs]


def slab_view(kv: torch.Tensor) -> torch.Tensor:
    """`kv` (contiguous) as `[layers * planes, 1, num_blocks, ...]`: slab s is layer s // 2, K or V
    (the latent layout: layer s). A range
    of slabs is again a cache tensor `gather_blocks`/`scatter_blocks` take, and contiguous."""
    return kv.view(kv.shape[0] * kv.shape[1], 1, *kv.shape[2:])


def block_run(block_ids: list[int]) -> int | None:
    """The first id when the ids are one run of consecutive blocks (a slab's blocks are then one
    contiguous range of memory, sent or received in place), else None (also for no ids)."""
    if not len(block_ids):
        return None
    first = block_ids[0]
    return first if list(block_ids) == list(range(first, first + len(block_ids))) else None


class BufferPool:
    """Reusable staging buffers: a fresh multi-MiB tensor costs page faults on every transfer
    (~15 ms per 32 MiB measured), a reused one does not. Thread-safe; one buffer per transfer."""

    def __init__(self, max_buffers: int = 4):
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.max_buffers = max_buffers

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A buffer of `shape` on the cache's device (a GPU cache stages on the GPU)."""
        numel = 1
        for d in shape:
            numel *= d
        device = torch.device(device)
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.dtype == dtype and buf.device == device and buf.numel() >= numel:
                    return self._free.pop(i)[:numel].view(shape)
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        base = buf._base if buf._base is not None else buf
        with self._lock:
            if len(self._free) < self.max_buffers:
                self._free.append(base.view(-1))


@dataclass
class Lease:
    block_ids: list[int]
    expiry_monotonic_s: float
    token: str  # 128 random bits: what lets an importer read or release it (the request id does not)
    num_readers: int = 0  # reads in flight (`hold`): the blocks stay pinned until they end
    is_dropped: bool = False  # acked or expired; unpinned once num_readers is 0
    board_slot: tuple[int, int] | None = None  # (slot, generation) on the exporter's lease board


class LeaseTable:
    """request id -> pinned blocks. `pin`/`unpin` are the engine pool's incref/free; thread-safe.

    Each lease has a random token (in the `KVHandle`, which travels only inside Ray calls): every
    read and release must show it, compared in constant time. A wrong token is treated as no
    lease at all, so a request id alone (partly chosen by clients) reveals and unlocks nothing.

    A read that sends the blocks over time (chunk by chunk, or straight from the cache) `hold`s the
    lease: an ack or expiry meanwhile ends the lease at once (no new reads), but the blocks return
    to the pool only at the last `unhold`, so the engine never overwrites blocks still on the wire.
    """

    def __init__(self, pin: Callable[[list[int]], None], unpin: Callable[[list[int]], None],
                 lease_s: float = 30.0, clock: Callable[[], float] = time.monotonic, board=None):
        # board: a `LeaseBoard` where the live leases are published for same-host importers
        self._pin, self._unpin, self.lease_s, self._clock, self.board = pin, unpin, lease_s, clock, board
        self._leases: dict[str, Lease] = {}
        self._expired: OrderedDict[str, str] = OrderedDict()  # recent ones' tokens: "expired", not "unknown"
        self.num_expired = 0  # leases released by expiry since the start (a metric)
        self.num_open_reads = 0  # reads holding blocks now (a fault must bring this back to 0)
        self._lock = threading.Lock()

    def add(self, request_id: str, block_ids: list[int]) -> Lease:
        """Pin the blocks under a new lease (its token drawn here)."""
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a lease")
            self._pin(block_ids)
            lease = Lease(list(block_ids), self._clock() + self.lease_s, secrets.token_hex(16))
            if self.board is not None:
                lease.board_slot = self.board.publish(lease.token)
            self._leases[request_id] = lease
            return lease

    def get(self, request_id: str, token: str) -> Lease | None:
        """The live lease, or None (an expired one is released on the spot; a wrong token: None)."""
        with self._lock:
            return self._live(request_id, token)

    def hold(self, request_id: str, token: str) -> Lease | None:
        """The live lease with one more reader (its blocks stay pinned until `unhold`), or None."""
        with self._lock:
            lease = self._live(request_id, token)
            if lease is not None:
                lease.num_readers += 1
                self.num_open_reads += 1
            return lease

    def unhold(self, lease: Lease) -> None:
        with self._lock:
            lease.num_readers -= 1
            assert lease.num_readers >= 0, "unhold without hold"
            self.num_open_reads -= 1
            if lease.is_dropped and lease.num_readers == 0:
                self._unpin(lease.block_ids)

    def was_expired(self, request_id: str, token: str) -> bool:
        with self._lock:
            expired = self._expired.get(request_id)
            return expired is not None and _same(expired, token)

    def release(self, request_id: str, token: str) -> bool:
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or not _same(lease.token, token):
                return False
            del self._leases[request_id]
            self._drop(lease)
            return True

    def expire(self) -> list[str]:
        """Release every lease past its expiry; returns their request ids."""
        now = self._clock()
        with self._lock:
            gone = [rid for rid, lease in self._leases.items() if lease.expiry_monotonic_s <= now]
            for rid in gone:
                self._drop_expired(rid)
        return gone

    def _live(self, request_id: str, token: str) -> Lease | None:
        lease = self._leases.get(request_id)
        if lease is None or not _same(lease.token, token):
            return None
        if lease.expiry_monotonic_s <= self._clock():
            self._drop_expired(request_id)
            return None
        return lease

    def _drop(self, lease: Lease) -> None:
        lease.is_dropped = True
        if lease.board_slot is not None:  # before the blocks can go back: a board reader sees it end first
            self.board.end(*lease.board_slot)
        if lease.num_readers == 0:
            self._unpin(lease.block_ids)

    def _drop_expired(self, request_id: str) -> None:
        lease = self._leases.pop(request_id)
        self._drop(lease)
        self._expired[request_id] = lease.token
        self.num_expired += 1
        while len(self._expired) > 4096:
            self._expired.popitem(last=False)

    def __len__(self) -> int:
        """Live leases (a dropped one still being read is not counted)."""
        return len(self._leases)


def _same(a: str, b) -> bool:
    """Token equality in constant time (a non-string never matches)."""
    return isinstance(b, str) and hmac.compare_digest(a.encode(), b.encode())
