"""The two sides of a KV transfer, whatever carries the bytes.

`KVExporter` (prefill side) owns the leases over an engine's cache: `export` pins a finished
prefill's blocks and returns the `KVHandle`; `open_read` checks the lease and the importer's layout
and returns a `BlockRead` that yields the blocks (only the importer's heads) chunk by chunk, in
place when they are one run of blocks and every head goes, else gathered into a reused staging
buffer; `read` gathers them all at once; `ack` releases the lease. A daemon thread expires leases
whose importer never came. `KVImporter` (decode side) checks the layout before any byte moves,
fetches through its backend, scatters into its own blocks, and on any failure calls
`on_failure(dst_block_ids)` and raises a typed error.

The network backends (`tcp`, `ucx`) speak the same frames (protocol.py) and share what is not
about moving bytes: `NetworkExporter` (a listener's settings and `open_wire_read`, its answer to a
connection's READ or ACK frame), `mapped_cache` (an exporter's cache this importer can copy out of on the same host)
and `chunk_targets` (where each chunk lands). Backends (`tcp`, `ucx`, `local`) only move bytes.
`pin`/`unpin` are the engine pool's incref/free and must be safe to call from the exporter's
threads (take the engine's lock).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Callable

import numpy as np
import torch

from pdserve.kvtransfer import protocol as p
from pdserve.kvtransfer.blocks import (BufferPool, Lease, LeaseTable, block_run, cache_bits, copy_blocks,
                                       gather_blocks, scatter_blocks, slab_view)
from pdserve.kvtransfer.lease_board import BoardView, token_digest
from pdserve.engine import cuda_ipc, shared_memory
from pdserve.engine.cuda_ipc import CudaRegion
from pdserve.engine.shared_memory import SharedRegion, locate, map_region

log = logging.getLogger(__name__)

_MAX_SOURCES = 16  # exporters' caches an importer keeps mapped (a replaced replica's goes first)
_SWEEP_S = 10.0  # how often at most an importer looks for mapped exporters that have exited


class KVExporter:
    cache_region: SharedRegion | CudaRegion | None = None  # set where importers on this host may copy out of `kv`

    def __init__(self, exporter_id: str, kv: torch.Tensor, layout: p.KVLayout,
                 pin: Callable[[list[int]], None], unpin: Callable[[list[int]], None], lease_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.exporter_id, self.kv, self.layout = exporter_id, kv, layout
        self.leases = LeaseTable(pin, unpin, lease_s, clock)  # `clock`: a test's, to expire leases at once
        self.buffers = BufferPool()
        self._closed = threading.Event()
        self._expiry = threading.Thread(target=self._expire_leases, name=f"kv-leases-{exporter_id}", daemon=True)
        self._expiry.start()

    @property
    def address(self) -> str:
        return f"local:{self.exporter_id}"

    @property
    def is_healthy(self) -> bool:
        """Serving reads and expiring leases (a replica's health check fails otherwise)."""
        return not self._closed.is_set() and self._expiry.is_alive()

    def export(self, request_id: str, block_ids: list[int], num_tokens: int) -> p.KVHandle:
        """Pin a finished prefill's blocks under a lease and describe them for the importer."""
        lease = self.leases.add(request_id, block_ids)
        slot, generation = lease.board_slot or (-1, 0)
        return p.KVHandle(self.exporter_id, self.address, request_id, tuple(block_ids), num_tokens, self.layout,
                          lease.token, self.cache_region, self.leases.board.region if lease.board_slot else None,
                          slot, generation)

    def open_read(self, request_id: str, token: str, importer: p.KVLayout, first_block: int = 0) -> "BlockRead":
        """A read of the leased blocks from `first_block` on (the importer caches the ones before),
        only the importer's heads. It holds the blocks until its `close`, ack or expiry notwithstanding.
        Without the lease's token it is as if there were no lease."""
        heads = p.head_slice(self.layout, importer)
        lease = self.leases.hold(request_id, token)
        if lease is None:
            if self.leases.was_expired(request_id, token):
                raise p.LeaseExpiredError(f"the KV lease for request {request_id!r} expired before it was pulled")
            raise p.UnknownRequestError(f"exporter {self.exporter_id} holds no KV blocks for request {request_id!r}")
        if not isinstance(first_block, int) or not 0 <= first_block < len(lease.block_ids):
            self.leases.unhold(lease)
            raise p.ProtocolError(f"first_block {first_block!r} outside the lease's {len(lease.block_ids)} blocks")
        return BlockRead(self, lease, lease.block_ids[first_block:], heads)

    def read(self, request_id: str, token: str, importer: p.KVLayout, first_block: int = 0) -> torch.Tensor:
        """All of `open_read`'s blocks gathered into a staging buffer: hand it back with `release_buffer`."""
        with self.open_read(request_id, token, importer, first_block) as r:
            staging = self.buffers.take(r.shape, self.kv.dtype, self.kv.device)
            return gather_blocks(self.kv, r.block_ids, r.heads, staging)

    def release_buffer(self, buf: torch.Tensor) -> None:
        self.buffers.give(buf)

    def ack(self, request_id: str, token: str) -> bool:
        return self.leases.release(request_id, token)

    def close(self) -> None:
        self._closed.set()
        self._expiry.join(5)

    def _expire_leases(self) -> None:
        while not self._closed.wait(0.2):
            for rid in self.leases.expire():
                log.warning("KV lease for %s expired; its blocks return to the pool", rid)


class NetworkExporter(KVExporter):
    """An exporter behind a listener (the tcp and ucx backends): the address it listens on, how
    long it waits for a peer's frames (`ack_timeout_s` for the first and for an ACK,
    `idle_timeout_s` between reads), how many connections it serves at once, and whether
    importers on this host may copy straight out of its cache (`shared_memory`)."""

    def __init__(self, exporter_id: str, kv: torch.Tensor, layout: p.KVLayout,
                 pin: Callable[[list[int]], None], unpin: Callable[[list[int]], None], lease_s: float,
                 host: str, ack_timeout_s: float, idle_timeout_s: float, shared_memory: bool, max_connections: int):
        super().__init__(exporter_id, kv, layout, pin, unpin, lease_s)
        self.host, self.ack_timeout_s, self.idle_timeout_s = host, ack_timeout_s, idle_timeout_s
        if shared_memory:  # its shared-memory region, or its CUDA IPC handle (None: in neither)
            self.cache_region = cuda_ipc.share(kv) if kv.is_cuda else locate(kv)
        self.max_connections = max_connections
        self.num_connections = 0  # accepted so far (importers keep theirs between pulls)
        self.num_open_connections = 0
        self.port = 0  # the subclass's listener's, once it listens

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def open_wire_read(self, kind: int, req: dict, budget_s: float
                       ) -> tuple[str, str, "BlockRead", float, bool] | bool:
        """What a connection's frame asks: for an ACK (an importer dropping a lease it will not
        read, or one it read by the lease board), whether it released a lease here; else the READ's
        (request id, token, the read, how long its sends may take, whether the importer copies the
        blocks out of this host's cache itself); a ProtocolError for any other frame. The
        importer's deadline is held to `budget_s` or the lease's length: no READ pins blocks
        longer than a lease would anyway."""
        rid, token = p.lease_ref(req)
        if kind == p.ACK:
            return self.ack(rid, token)
        if kind != p.READ:
            raise p.ProtocolError(f"expected a READ frame, got kind {kind}")
        try:
            importer = p.KVLayout(**req["layout"])
            send_s = float(req.get("timeout_s", budget_s))
        except (TypeError, KeyError, ValueError) as e:
            raise p.ProtocolError(f"malformed READ: {e!r}") from e
        send_s = min(send_s, max(self.leases.lease_s, budget_s)) if math.isfinite(send_s) and send_s > 0 else 0.0
        is_local = bool(req.get("local"))
        if is_local and self.cache_region is None:
            raise p.ProtocolError("a local read from an exporter whose cache is not in shared memory")
        return rid, token, self.open_read(rid, token, importer, req.get("first_block", 0)), send_s, is_local


class BlockRead:
    """One importer's read of a lease, in the chunks of the wire protocol (`protocol.chunk_bounds`).

    `chunk(i)` is chunk i's bytes, contiguous: a view of the cache itself when the blocks are one
    run and the importer takes every head (no copy), else gathered into a staging buffer (one per
    read, reused across reads). The blocks stay pinned until `close`, which hands the buffer back:
    call it only once nothing reads the chunks any more (sends completed or cancelled).
    """

    def __init__(self, exporter: KVExporter, lease: Lease, block_ids: list[int], heads: tuple[int, int]):
        self._exporter, self._lease, self.block_ids, self.heads = exporter, lease, block_ids, heads
        kv = exporter.kv
        self.shape = (kv.shape[0], kv.shape[1], len(block_ids), kv.shape[3], heads[1] - heads[0], kv.shape[5])
        slab_bytes = len(block_ids) * kv.shape[3] * (heads[1] - heads[0]) * kv.shape[5] * kv.element_size()
        self.chunks = p.chunk_bounds(kv.shape[0] * kv.shape[1], slab_bytes)
        self._run = block_run(block_ids) if heads == (0, kv.shape[4]) else None
        self._staging: torch.Tensor | None = None
        self._is_closed = False

    def is_in_place(self, i: int) -> bool:
        """Chunk i is a view of the cache (no gather copy)."""
        s0, s1 = self.chunks[i]
        return self._run is not None and s1 - s0 == 1

    def chunk(self, i: int) -> torch.Tensor:
        s0, s1 = self.chunks[i]
        slabs = slab_view(self._exporter.kv)
        if self.is_in_place(i):
            return slabs[s0, 0, self._run:self._run + len(self.block_ids)]
        if self._staging is None:
            self._staging = self._exporter.buffers.take(self.shape, self._exporter.kv.dtype, self._exporter.kv.device)
        return gather_blocks(slabs[s0:s1], self.block_ids, self.heads, slab_view(self._staging)[s0:s1])

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        if self._staging is not None:
            self._exporter.buffers.give(self._staging)
        self._exporter.leases.unhold(self._lease)

    def __enter__(self) -> "BlockRead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KVImporter(ABC):
    num_shared_memory_pulls = 0  # pulls copied out of the exporter's cache on this host (no bytes on the wire)
    num_board_reads = 0  # of those, the ones whose lease the exporter's board vouched for (no message at all)

    def __init__(self, kv: torch.Tensor, layout: p.KVLayout):
        self.kv, self.layout = kv, layout
        self.buffers = BufferPool()
        # Exporters' caches mapped from shared memory (None: not mappable from here), and their lease boards.
        self._sources: OrderedDict[SharedRegion | CudaRegion, np.ndarray | torch.Tensor | None] = OrderedDict()
        self._boards: OrderedDict[SharedRegion, BoardView] = OrderedDict()
        self._swept_at = time.monotonic()

    def pull(self, handle: p.KVHandle, dst_block_ids: list[int], timeout_s: float = 10.0,
             on_failure: Callable[[list[int]], None] | None = None, first_block: int = 0, ack: bool = True) -> None:
        """Fill `dst_block_ids` with the handle's blocks from `first_block` on (this side already
        holds the ones before) and only this rank's heads, then ack. With `ack=False` the lease
        stays (several decode ranks read one prefill rank's lease; the last of them `release`s it).

        Raises a `KVTransferError` within about `timeout_s` on any failure, after calling
        `on_failure(dst_block_ids)` so the caller's blocks go back to its pool.
        """
        try:
            heads = p.head_slice(handle.layout, self.layout)
            if len(dst_block_ids) != len(handle.block_ids) - first_block or not dst_block_ids:
                raise p.ProtocolError(f"{len(dst_block_ids)} destination blocks for {len(handle.block_ids)} "
                                      f"exported from block {first_block}")
            self._fetch(handle, list(dst_block_ids), heads, timeout_s, first_block, ack)
        except BaseException as e:
            if on_failure is not None:
                on_failure(list(dst_block_ids))
            if isinstance(e, p.KVTransferError):
                raise
            raise p.ExporterUnreachableError(
                f"KV pull of {handle.request_id} from {handle.address} failed: {e!r}") from e

    def expected_shape(self, num_blocks: int, heads: tuple[int, int]) -> tuple[int, ...]:
        return (self.kv.shape[0], self.kv.shape[1], num_blocks, self.kv.shape[3], heads[1] - heads[0],
                self.kv.shape[5])

    def store(self, dst: list[int], data: torch.Tensor) -> None:
        scatter_blocks(self.kv, dst, data)

    def mapped_cache(self, handle: p.KVHandle) -> np.ndarray | torch.Tensor | None:
        """The exporter's whole cache, read-only, `[layers, planes, blocks, block_size, heads, head_dim]`,
        when this process can map it: its bits from shared memory on this host (CPU caches), or a
        tensor over CUDA IPC on this GPU (GPU caches). Call from one thread at a time."""
        region = handle.cache_region
        if region is None or isinstance(region, CudaRegion) != self.kv.is_cuda:
            return None
        if region not in self._sources or time.monotonic() - self._swept_at > _SWEEP_S:
            self._let_go_of_exited_exporters()  # a new exporter is often an exited one's replacement
        if region in self._sources:
            self._sources.move_to_end(region)
            return self._sources[region]
        layout, source = handle.layout, None
        block_shape = (layout.num_layers, layout.block_size, layout.local_heads[1] - layout.local_heads[0],
                       layout.head_dim)
        if isinstance(region, CudaRegion):
            per_block = layout.num_planes * math.prod(block_shape) * self.kv.element_size()
            if region.nbytes % per_block == 0:
                layers, block_size, heads, head_dim = block_shape
                source = cuda_ipc.open_region(region, self.kv.dtype, (layers, layout.num_planes,
                                                                      region.nbytes // per_block,
                                                                      block_size, heads, head_dim), self.kv.device)
        else:
            mapping = map_region(region)
            if mapping is not None:
                source = cache_bits(mapping, self.kv.element_size(), block_shape, layout.num_planes)
        self._sources[region] = source
        while len(self._sources) > _MAX_SOURCES:
            self._sources.popitem(last=False)
        return source

    @property
    def num_mapped_caches(self) -> int:
        """Exporters' caches this process maps (at most one per live prefill replica on this host,
        once a pull has come after any that exited)."""
        return sum(source is not None for source in list(self._sources.values()))

    def _let_go_of_exited_exporters(self) -> None:
        """Unmap the caches and lease boards of exporters whose process has exited. A mapping keeps
        what it maps in memory (a memfd is freed with its last mapping): a killed, replaced or
        removed prefill replica's whole cache would otherwise stay for as long as this held it."""
        self._swept_at = time.monotonic()
        for regions in (self._sources, self._boards):
            for region in [r for r in regions
                           if (cuda_ipc.is_gone if isinstance(r, CudaRegion) else shared_memory.is_gone)(r)]:
                del regions[region]

    def forget_cache(self, handle: p.KVHandle) -> None:
        """Unmap the exporter's cache and board (it may be gone)."""
        self._sources.pop(handle.cache_region, None)
        self._boards.pop(handle.lease_board, None)

    def mapped_board(self, handle: p.KVHandle) -> BoardView | None:
        """The exporter's lease board, when the handle names one this process can map. Call from
        one thread at a time."""
        region = handle.lease_board
        if region is None or handle.lease_slot < 0:
            return None
        if region not in self._boards:
            self._boards[region] = BoardView(region)
            while len(self._boards) > _MAX_SOURCES:
                self._boards.popitem(last=False)
        self._boards.move_to_end(region)
        board = self._boards[region]
        return board if board.words is not None else None

    def read_on_board(self, board: BoardView, source: np.ndarray | torch.Tensor, handle: p.KVHandle, dst: list[int],
                      heads: tuple[int, int], first_block: int, in_time: Callable[[], object]) -> bool:
        """The blocks copied out of the exporter's mapped cache `source` with no message at all, when
        its lease board says the lease was live from before the copy to after it (lease_board.py).
        False when it does not (the lease ended, or was never on the board): `dst` then holds
        anything, and the backend's READ decides (and says why). `in_time()` raises once the
        caller's deadline has passed: called after the copy, which is then void."""
        lease = (handle.lease_slot, handle.lease_generation, token_digest(handle.lease_token))
        if not board.is_live(*lease) or not board.exporter_alive():
            return False
        copy_blocks(source, list(handle.block_ids[first_block:]), heads, self.kv, dst)
        if self.kv.is_cuda:
            self.finish_copy()
        if not board.is_live(*lease):  # ended during the copy: the blocks may have been reused
            return False
        in_time()
        self.num_shared_memory_pulls += 1
        self.num_board_reads += 1
        return True

    def finish_copy(self) -> None:
        """Wait for a `copy_blocks` out of a mapped GPU cache."""
        torch.cuda.current_stream(self.kv.device).synchronize()

    def wire_chunks(self, shape: tuple[int, ...]) -> list[tuple[int, int]]:
        """The chunks a transfer of `shape` travels in (`protocol.chunk_bounds`)."""
        return p.chunk_bounds(shape[0] * shape[1], math.prod(shape[2:]) * self.kv.element_size())

    def chunk_targets(self, dst: list[int], heads: tuple[int, int]
                      ) -> tuple[tuple[int, ...], list[tuple[int, int]], list[tuple[torch.Tensor, bool]], torch.Tensor | None]:
        """Where a pull's chunks land: (the transfer's shape, the chunks' slab bounds, per chunk
        (its target, whether it is staged to be scattered into `dst` after), the staging buffer
        or None). A chunk lands in the cache itself when `dst` is one run of blocks and it is one
        slab; give the staging buffer back with `self.buffers.give` once nothing writes into it."""
        shape = self.expected_shape(len(dst), heads)
        chunks = self.wire_chunks(shape)
        run = block_run(dst)
        slabs, staging, targets = slab_view(self.kv), None, []
        for s0, s1 in chunks:
            if run is not None and s1 - s0 == 1:
                targets.append((slabs[s0, 0, run:run + len(dst)], False))
            else:
                if staging is None:
                    staging = self.buffers.take(shape, self.kv.dtype, self.kv.device)
                targets.append((slab_view(staging)[s0:s1], True))
        return shape, chunks, targets, staging

    def release(self, handle: p.KVHandle, timeout_s: float = 5.0) -> None:
        """Tell the exporter to drop the lease without reading (the request ended before its pull).
        Best effort: on failure the lease still expires."""
        try:
            self._release(handle, timeout_s)
        except Exception as e:  # noqa: BLE001
            log.warning("could not release the KV lease of %s at %s (it will expire): %r",
                        handle.request_id, handle.address, e)

    @abstractmethod
    def _fetch(self, handle: p.KVHandle, dst: list[int], heads: tuple[int, int], timeout_s: float,
               first_block: int, ack: bool) -> None:
        """Move the blocks from `first_block` on into `dst` and ack (when `ack`), or raise."""

    @abstractmethod
    def _release(self, handle: p.KVHandle, timeout_s: float) -> None:
        """Ack the handle's lease without reading it."""

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release what the backend holds (threads, endpoints)."""
