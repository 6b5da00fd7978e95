"""KV transfer over UCX (the `ucxx` package): TCP or shared memory on CPU, CUDA-aware on GPU.

`UCXExporter` (prefill side) listens on a free port from the process's UCX event-loop thread
(`ucx_loop`, shared with any importer there), so engine steps never wait on it. `UCXImporter`
(decode side) pulls with a deadline on every wait. Leases, checks and failure handling are the
base classes' (base.py).

One pull, one connection, in UCX tag messages (protocol version 2, protocol.py):

    importer                                   exporter
    READ {request_id, layout, first_block,  ->
          timeout_s}
    (posts receives for the reply and           checks lease and layout
     every chunk at once)                  <-   ERROR {code, message}            (and closes), or
                                           <-   DATA {shape, num_chunks}, then chunk 0, 1, ... raw
    scatters chunk i while i+1 arrives          gathers chunk i+1 while chunk i is on the wire
    ACK {request_id} (or DONE: keep lease)  ->  releases the lease on ACK

On one host, where the handle names the exporter's cache in shared memory and this process can
map it (`pdserve.engine.shared_memory`), or on one GPU, where the cache is shared over CUDA IPC
(`pdserve.engine.cuda_ipc`), the READ asks for a local read: DATA comes with `local` and no
chunks, the importer copies the blocks straight out of the exporter's cache (`copy_blocks`; on a
GPU one kernel, launched with the READ and finished before ACK/DONE) and sends ACK/DONE. The
exporter holds the blocks until then, or past the importer's deadline; a copy that ends after the
deadline is void. UCX's own shared-memory transports were not used: they only
run on endpoints without error handling, where a peer dying mid-transfer can abort this process.

Each control frame is one message. A chunk is sent from and received into the cache itself when
that side's blocks are one run (and, for the exporter, the importer takes every head); otherwise it
goes through a staging buffer. The exporter bounds its sends by the importer's `timeout_s` and its
wait for the ACK by `ack_timeout_s`; on any failure it aborts the endpoint (cancelling sends)
before the blocks can return to the pool.

Connections are kept: after a pull that ended in ACK or DONE the importer keeps the endpoint (one
pull at a time on each) for the next pull from the same exporter, and the exporter waits on it for
the next READ. Opening an endpoint costs a few round trips between the two processes' UCX progress
threads: ~2 ms idle, 15-60 ms on a loaded two-core machine, where it was the largest part of a
short prompt's pull and so of its decode's first inter-token gap. An endpoint is reused only after
a pull that completed; any failure aborts it. A kept endpoint the exporter has meanwhile dropped
(its `idle_timeout_s`, a restart) fails before any byte of the pull moves: the pull then opens a
fresh one, within the same deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import asdict
from typing import Callable

import numpy as np
import torch

from pdserve.kvtransfer import protocol as p
from pdserve.kvtransfer.base import BlockRead, KVImporter, NetworkExporter
from pdserve.kvtransfer.blocks import copy_blocks, scatter_blocks, slab_view

log = logging.getLogger(__name__)

_PROGRESS_WAIT_MS = 100  # the longest UCX's progress thread sleeps with nothing to do (_start_progress_thread)


class _LoopThread:
    """An asyncio loop on a daemon thread; `run(coro, timeout)` from any other thread."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)


_ucx_loop: _LoopThread | None = None
_ucx_loop_lock = threading.Lock()


def ucx_loop() -> _LoopThread:
    """The process's one UCX event loop, shared by its exporters and importers.

    ucxx waits for a request by polling it from the event loop (`asyncio.sleep(0)` until done)
    unless its requests complete through Python futures. Polling, a receive that waits (an
    exporter's kept connection between reads) kept a core busy for as long as it waited. With
    futures (on unless UCXPY_ENABLE_PYTHON_FUTURE=0), ucxx's notifier thread completes them on
    the loop that started UCX: hence one loop per process. A message's round trip costs a few
    hundred microseconds more than polling."""
    global _ucx_loop
    with _ucx_loop_lock:
        if _ucx_loop is None:
            loop = _LoopThread("pdserve-ucx")
            loop.run(_init_ucx(), 30)
            _ucx_loop = loop
        return _ucx_loop


async def _init_ucx() -> None:
    import ucxx

    try:
        ucxx.init(enable_python_future=os.environ.get("UCXPY_ENABLE_PYTHON_FUTURE", "1") != "0")
    except RuntimeError as e:  # started before, by someone else: its settings stay
        log.warning("UCX was already initialized in this process (%s); KV transfers wait by polling", e)
        return
    _start_progress_thread(ucxx)


def _start_progress_thread(ucxx) -> None:
    """Restart the UCX worker's progress thread, which `ucxx.init` starts, with a wait of
    _PROGRESS_WAIT_MS for the worker's events instead of ucxx's 1 ms.

    At 1 ms the thread woke ~920 times a second in every process with UCX, busy or idle: in a
    replica, a thread that takes the core from the engine step (or the way to the client) almost
    every step. Everything that needs the thread wakes it at once: a message (the worker's event
    fd), a send or receive posted from another thread (ucxx signals the worker). The bound only
    paces UCX's own housekeeping. ucxx has no setting for it: this reaches into its context; on a
    version where that fails, UCX keeps a progress thread with ucxx's own wait."""
    try:
        worker = ucxx.core._get_ctx().worker
    except AttributeError as e:
        log.warning("UCX's progress thread wakes every millisecond (%r): this ucxx version is not the one "
                    "pdserve knows", e)
        return
    worker.stop_progress_thread()  # nothing is connected yet; the thread keeps its start callback
    try:
        worker.start_progress_thread(polling_mode=False, epoll_timeout=_PROGRESS_WAIT_MS)
    except TypeError as e:  # another signature: never leave UCX without its progress thread
        log.warning("UCX's progress thread keeps ucxx's defaults (%r): this ucxx version is not the one "
                    "pdserve knows", e)
        worker.start_progress_thread()


def _buffer(t: torch.Tensor):
    """What ucxx sends from or receives into: the tensor's own memory as bytes, no copy (contiguous;
    viewed as bytes before numpy sees it, which has no bfloat16)."""
    return t if t.is_cuda else t.reshape(-1).view(torch.uint8).numpy()


async def _send_frame(ep, kind: int, payload: dict) -> None:
    await ep.send(np.frombuffer(p.encode_frame(kind, payload), dtype=np.uint8))


async def _recv_frame(ep) -> tuple[int, dict]:
    import ucxx

    frame = np.zeros(p.CONTROL_FRAME_BYTES, dtype=np.uint8)
    try:
        await ep.recv(frame)
    except ucxx.exceptions.UCXMessageTruncatedError as e:
        raise p.ProtocolError(f"control frame over {p.CONTROL_FRAME_BYTES} bytes") from e
    return p.decode_frame(frame.tobytes())


async def _settle(tasks: list[asyncio.Future], timeout_s: float = 1.0) -> bool:
    """Cancel what is still pending and wait (bounded) until it ended; True when all did."""
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)
    return all(t.done() for t in tasks)


# Open importer connections one exporter keeps: each decode replica (rank) keeps a few idle ones
# (`max_idle_per_exporter`), so this is room for dozens of decode replicas, and a bound on what a
# peer flooding the listener (which listens on every interface: ucxx cannot bind one) can hold.
MAX_CONNECTIONS = 512


class UCXExporter(NetworkExporter):
    def __init__(self, exporter_id: str, kv: torch.Tensor, layout: p.KVLayout,
                 pin: Callable[[list[int]], None], unpin: Callable[[list[int]], None],
                 lease_s: float = 30.0, host: str = "127.0.0.1", port: int = 0, ack_timeout_s: float = 10.0,
                 idle_timeout_s: float = 300.0, shared_memory: bool = True,
                 max_connections: int = MAX_CONNECTIONS):
        import ucxx

        super().__init__(exporter_id, kv, layout, pin, unpin, lease_s, host, ack_timeout_s, idle_timeout_s,
                         shared_memory, max_connections)
        self._loop = ucx_loop()

        async def start():
            self._listener = ucxx.create_listener(self._serve, port=port)
            return self._listener.port

        self.port = self._loop.run(start(), 30)
        log.info("KV exporter %s listening on %s", exporter_id, self.address)

    @property
    def is_healthy(self) -> bool:
        return super().is_healthy and self._loop.thread.is_alive()

    def close(self) -> None:
        async def stop():
            self._listener.close()

        self._loop.run(stop(), 10)
        super().close()

    async def _serve(self, ep) -> None:
        """One connection: reads, one after another, until the importer closes it, a read fails,
        or it stays idle for `idle_timeout_s`. Past `max_connections` open ones, refused at once."""
        if self.num_open_connections >= self.max_connections:
            log.warning("KV connection refused: %d open already", self.num_open_connections)
            await self._close(ep)
            return
        self.num_connections += 1
        self.num_open_connections += 1
        try:
            first_wait_s = self.ack_timeout_s
            while True:
                try:
                    kind, req = await asyncio.wait_for(_recv_frame(ep), first_wait_s)
                except p.ProtocolError as e:
                    kind, req = None, e
                except Exception:  # noqa: BLE001 - closed by the importer, or idle too long
                    await self._close(ep)
                    return
                first_wait_s = self.idle_timeout_s
                if not await self._serve_one(ep, kind, req):
                    return
        finally:
            self.num_open_connections -= 1

    @staticmethod
    async def _close(ep) -> None:
        try:
            await asyncio.wait_for(ep.close(), 5)
        except Exception:  # noqa: BLE001
            pass

    async def _serve_one(self, ep, kind: int | None, req) -> bool:
        """One frame from the importer and what follows it; True when the connection may carry
        another read (this one ended in ACK or DONE). Closes or aborts `ep` otherwise."""
        rid, read, is_reusable = None, None, False
        try:
            if isinstance(req, p.ProtocolError):
                raise req
            opened = self.open_wire_read(kind, req, self.ack_timeout_s)
            if isinstance(opened, bool):  # an ACK, and nothing follows it
                return False
            rid, token, read, send_s, is_local = opened
            if is_local:
                # The importer copies the blocks out of the cache itself: they stay held until its
                # ACK/DONE, or until its own deadline has passed (it then discards what it copied).
                await asyncio.wait_for(_send_frame(ep, p.DATA, {"shape": list(read.shape), "num_chunks": 0,
                                                                "local": True}), send_s)
                kind, _ = await asyncio.wait_for(_recv_frame(ep), send_s)
                read.close()
                read = None
            else:
                await asyncio.wait_for(self._send_blocks(ep, read), send_s)
                read.close()  # every send completed: the blocks may go back once acked
                read = None
                kind, _ = await asyncio.wait_for(_recv_frame(ep), self.ack_timeout_s)
            if kind == p.ACK:
                self.ack(rid, token)
            is_reusable = kind in (p.ACK, p.DONE)
        except p.KVTransferError as e:
            try:
                await asyncio.wait_for(_send_frame(ep, p.ERROR, p.error_frame(e)), 5)
            except Exception:  # noqa: BLE001 - the importer may be gone already
                pass
        except Exception as e:  # noqa: BLE001 - one bad peer must not take the listener down
            log.warning("KV read for %s failed: %r (the lease stays until ack or expiry)", rid, e)
        finally:
            if read is not None:  # sends may be in flight: cancel them before the blocks can go back
                try:
                    ep.abort()
                finally:
                    read.close()
            elif not is_reusable:
                await self._close(ep)
        return is_reusable

    @staticmethod
    async def _send_blocks(ep, read: BlockRead) -> None:
        """DATA, then every chunk; a chunk to gather is gathered while the one before is on the
        wire; chunks sent from the cache itself are all posted at once."""
        sends = [asyncio.ensure_future(_send_frame(ep, p.DATA, {"shape": list(read.shape),
                                                                "num_chunks": len(read.chunks)}))]
        try:
            for i in range(len(read.chunks)):
                if not read.is_in_place(i):
                    await asyncio.sleep(0)  # the sends before are posted (in order) before this copy
                sends.append(asyncio.ensure_future(ep.send(_buffer(read.chunk(i)))))
            await asyncio.gather(*sends)
        finally:
            await _settle([t for t in sends if not t.done()], 0.1)


class _StaleEndpoint(Exception):
    """A kept endpoint failed before the pull's first reply: the exporter had dropped it."""


class UCXImporter(KVImporter):
    def __init__(self, kv: torch.Tensor, layout: p.KVLayout, idle_s: float = 60.0, max_idle_per_exporter: int = 8):
        # idle_s: how long a kept endpoint stays usable (under the exporter's idle_timeout_s);
        # max_idle_per_exporter: endpoints kept per exporter address (one pull at a time on each).
        super().__init__(kv, layout)
        self.idle_s, self.max_idle_per_exporter = idle_s, max_idle_per_exporter
        self._idle: dict[str, list[tuple[object, float]]] = {}  # address -> [(endpoint, idle since)]; loop thread only
        self.num_endpoints_created = 0
        self._loop = ucx_loop()

    def close(self) -> None:
        async def close_idle():
            for eps in self._idle.values():
                for ep, _ in eps:
                    ep.abort()
            self._idle.clear()
            self._sources.clear()

        self._loop.run(close_idle(), 5)

    def _fetch(self, handle: p.KVHandle, dst: list[int], heads: tuple[int, int], timeout_s: float,
               first_block: int, ack: bool) -> None:
        self._loop.run(self._pull(handle, dst, heads, timeout_s, first_block, ack), timeout_s + 5)

    def _release(self, handle: p.KVHandle, timeout_s: float) -> None:
        import ucxx

        async def ack():
            host, port = handle.address.rsplit(":", 1)
            ep = await ucxx.create_endpoint(host, int(port))
            try:
                await _send_frame(ep, p.ACK, {"request_id": handle.request_id, "lease_token": handle.lease_token})
            finally:
                await ep.close()

        self._loop.run(asyncio.wait_for(ack(), timeout_s), timeout_s + 1)

    async def _pull(self, handle: p.KVHandle, dst: list[int], heads: tuple[int, int], timeout_s: float,
                    first_block: int, ack: bool) -> None:
        deadline = time.monotonic() + timeout_s

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError
            return remaining

        try:
            ep, is_kept = await self._endpoint(handle.address, left)
            try:
                await self._read(ep, is_kept, handle, dst, heads, first_block, ack, left)
            except _StaleEndpoint:
                ep, is_kept = await self._endpoint(handle.address, left, kept=False)
                await self._read(ep, is_kept, handle, dst, heads, first_block, ack, left)
        except asyncio.TimeoutError:
            self.forget_cache(handle)  # the exporter may be gone: unmap its cache
            raise p.ExporterUnreachableError(
                f"KV pull of {handle.request_id} from {handle.address}: no answer within {timeout_s:.1f}s") from None
        except p.KVTransferError:
            raise
        except Exception as e:  # UCX errors: connection refused or reset
            self.forget_cache(handle)
            raise p.ExporterUnreachableError(f"KV pull of {handle.request_id} from {handle.address}: {e!r}") from e
        self._keep(handle.address, ep)

    async def _endpoint(self, address: str, left: Callable[[], float], kept: bool = True) -> tuple[object, bool]:
        """An endpoint to `address`: a kept one (True) when `kept` and one is fresh enough, else a new one."""
        import ucxx

        idle = self._idle.get(address, [])
        while kept and idle:
            ep, since = idle.pop()
            if not ep.closed and time.monotonic() - since < self.idle_s:
                return ep, True
            ep.abort()
        host, port = address.rsplit(":", 1)
        ep = await asyncio.wait_for(ucxx.create_endpoint(host, int(port)), left())
        self.num_endpoints_created += 1
        return ep, False

    def _keep(self, address: str, ep) -> None:
        idle = self._idle.setdefault(address, [])
        if len(idle) < self.max_idle_per_exporter:
            idle.append((ep, time.monotonic()))
        else:
            ep.abort()

    async def _read(self, ep, is_kept: bool, handle: p.KVHandle, dst: list[int], heads: tuple[int, int],
                    first_block: int, ack: bool, left: Callable[[], float]) -> None:
        """One READ on `ep`, the blocks scattered into `dst`, then ACK/DONE; `ep` stays open on
        success and is aborted on any failure. On a kept endpoint, a UCX error before the
        exporter's reply raises `_StaleEndpoint` (nothing was written into `dst`)."""
        source = self.mapped_cache(handle)
        if source is None:
            shape, chunks, targets, staging = self.chunk_targets(dst, heads)
        else:  # local: no chunks
            shape, chunks, targets, staging = self.expected_shape(len(dst), heads), [], [], None
        slabs = slab_view(self.kv)

        tasks, is_done, is_copying = [], False, False
        try:
            # Every receive is posted now, in the order the exporter sends, so no chunk waits on us.
            tasks.append(asyncio.ensure_future(_send_frame(ep, p.READ, {
                "request_id": handle.request_id, "lease_token": handle.lease_token, "layout": asdict(self.layout),
                "first_block": first_block,
                "timeout_s": left(), "local": source is not None})))
            tasks.append(asyncio.ensure_future(_recv_frame(ep)))
            tasks.extend(asyncio.ensure_future(ep.recv(_buffer(t))) for t, _ in targets)
            if isinstance(source, torch.Tensor):
                # On a GPU the copy runs while the exporter answers: the lease has pinned the blocks
                # since the export, so when DATA confirms it was live at the READ, they were held all
                # along (and stay held until our ACK/DONE). On an ERROR the copy is void.
                copy_blocks(source, list(handle.block_ids[first_block:]), heads, self.kv, dst)
                is_copying = True
            try:
                await asyncio.wait_for(asyncio.shield(tasks[0]), left())
                kind, reply = await asyncio.wait_for(asyncio.shield(tasks[1]), left())
            except (asyncio.TimeoutError, p.KVTransferError):
                raise
            except Exception as e:
                if is_kept:
                    raise _StaleEndpoint() from e
                raise
            if kind == p.ERROR:
                raise p.error_of(reply)
            if kind != p.DATA:
                raise p.ProtocolError(f"expected a DATA frame, got kind {kind}")
            if (tuple(reply.get("shape", ())) != shape or reply.get("num_chunks") != len(chunks)
                    or bool(reply.get("local")) != (source is not None)):
                raise p.ProtocolError(f"exporter sends blocks of shape {reply.get('shape')} in "
                                      f"{reply.get('num_chunks')} chunks, expected {shape} in {len(chunks)}")
            if source is not None:  # the exporter holds the blocks until our ACK/DONE, or our deadline
                if is_copying:
                    self.finish_copy()
                    is_copying = False
                else:
                    copy_blocks(source, list(handle.block_ids[first_block:]), heads, self.kv, dst)
                left()  # past it, they may have gone back to its pool meanwhile: the copy is void
                self.num_shared_memory_pulls += 1
            in_place = []
            for (s0, s1), (target, is_staged), recv in zip(chunks, targets, tasks[2:]):
                if is_staged:  # scattered while the next chunks arrive
                    await asyncio.wait_for(asyncio.shield(recv), left())
                    scatter_blocks(slabs[s0:s1], dst, target)
                else:
                    in_place.append(recv)
            if in_place:  # one wait for them all: a wake-up of this loop per chunk cost ~0.1 ms each
                done, pending = await asyncio.wait(in_place, timeout=left(), return_when=asyncio.FIRST_EXCEPTION)
                for recv in done:
                    recv.result()  # a failed receive raises here
                if pending:
                    raise asyncio.TimeoutError
            await asyncio.wait_for(_send_frame(ep, p.ACK if ack else p.DONE, {"request_id": handle.request_id,
                                                                            "lease_token": handle.lease_token}),
                                   left())
            is_done = True
        finally:
            if is_copying:  # a failed pull's blocks go back to the pool: not while the copy writes them
                self.finish_copy()
            if not is_done:  # cancels the receives still posted, before their buffers go back
                try:
                    ep.abort()
                except Exception:  # noqa: BLE001
                    pass
            is_settled = await _settle([t for t in tasks if not t.done()])
            for t in tasks:  # retrieved, so asyncio does not log them as lost
                if t.done() and not t.cancelled():
                    t.exception()
            if staging is not None and is_settled:  # else a receive may still write into it: not reused
                self.buffers.give(staging)
