"""KV transfer over plain TCP sockets: the backend for links UCX would cross over TCP anyway (CPU
pools, pods without RDMA), and the default.

Why not UCX there: on a TCP link UCX moves fewer bytes a second than a socket does (its
per-message completion path: RESULTS.md, #42), and every process that starts UCX opens TCP
ports on every interface whose PUT messages write wherever a peer says, with no key
(docs/security.md). Here the only listener is the exporter's, bound to the one address it
advertises, and nothing it reads is trusted: frames are bounded (`protocol.CONTROL_FRAME_BYTES`),
a READ moves blocks only with its lease's token (which travels only inside Ray calls), and no
byte from the network ever lands anywhere but the importer's own buffers.

The frames and the same-host local read are the UCX backend's (protocol.py, ucx_backend.py); on
a stream a frame is its 16-byte header then its payload, then the blocks' bytes in the wire's
order. On CPU they go out of the exporter's cache and into the importer's blocks in vectored calls
(`sendmsg` / `recvmsg_into`, one piece per run of blocks per slab, `blocks.block_pieces`): no
gather, no staging, no scatter, one system call per 1,024 pieces. Where the exporter must gather
(the importer takes a slice of its heads) or a cache is on a GPU, the chunks of `chunk_bounds`
go one by one, each gathered (scattered) on a copy thread while the one before (after) is on the
wire. Blocking sockets, each call bounded by the kernel (`SO_SNDTIMEO` / `SO_RCVTIMEO`, set to what
is left of the deadline), on threads, not an event loop: one call moves a whole transfer with the
GIL released, where polling pays a wake-up per socket-buffer's worth.

    exporter: one accept thread; one thread per connection (at most `max_connections`), which
              waits `ack_timeout_s` for the first frame, then `idle_timeout_s` between reads
    importer: the pulling thread itself, each wait bounded by the pull's deadline; connections
              kept per exporter (one pull at a time on each), as the UCX backend keeps endpoints

A GPU cache goes through host memory (on GPUs, links with RDMA are UCX's).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Callable

import torch

from pdserve.kvtransfer import protocol as p
from pdserve.kvtransfer.base import BlockRead, KVImporter, NetworkExporter
from pdserve.kvtransfer.blocks import block_pieces, copy_blocks, scatter_blocks, slab_view
from pdserve.kvtransfer.lease_board import LeaseBoard

log = logging.getLogger(__name__)

# Open importer connections one exporter serves at once (each is a thread): each decode rank keeps
# a few idle ones, so room for dozens of decode replicas, and a bound on a flood of connections.
MAX_CONNECTIONS = 256
ERROR_SEND_S = 5.0  # how long an ERROR frame may take to leave before the connection is dropped

# Gathers and scatters overlapped with the wire, for every exporter and importer of the process.
_copies = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-copy")


def _settled(job: Future | None) -> None:
    """Wait for a copy still running (its buffer must not be reused or given back meanwhile);
    its error, if any, is the caller's failure's, not a new one."""
    if job is not None:
        job.exception()


class _Deadline:
    """What is left of a pull's (or a send's) time; `socket.timeout` once it has passed."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        remaining = self.at - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("deadline passed")
        return remaining


def _bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's own memory, as bytes (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _host_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes: its own memory on CPU, a host copy of a GPU one."""
    return _bytes(t.cpu() if t.is_cuda else t)


_TIMEVAL = struct.Struct("@ll")
_IOV_MAX = 1024  # pieces one sendmsg/recvmsg takes (Linux's UIO_MAXIOV)


def _arm(conn: socket.socket, option: int, deadline: _Deadline) -> None:
    """Bound the socket's next blocking call by what is left of `deadline` (a kernel timeout:
    Python's own would make the socket non-blocking and poll before every socket-buffer's worth,
    72-90% of a bare socket's rate on the namespace link where this keeps 83-92%)."""
    left = deadline.left()
    seconds = int(left)
    conn.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(seconds, max(1, int((left - seconds) * 1e6))))


def _vectored(conn: socket.socket, buffers, option: int, deadline: _Deadline, move) -> None:
    """Move every byte of `buffers` with `move(pieces) -> bytes moved`, up to _IOV_MAX pieces a call."""
    views, i = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)], 0  # an empty one moves nothing
    while i < len(views):
        _arm(conn, option, deadline)
        try:
            n = move(views[i:i + _IOV_MAX])
        except BlockingIOError:  # the kernel's timeout: the deadline says whether that is the end
            deadline.left()
            continue
        if n == 0:
            raise ConnectionResetError("the peer closed the connection")
        while n:
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i], n = views[i][n:], 0


def _send(conn: socket.socket, *buffers, deadline: _Deadline) -> None:
    _vectored(conn, buffers, socket.SO_SNDTIMEO, deadline, conn.sendmsg)


def _recv_into(conn: socket.socket, *buffers, deadline: _Deadline) -> None:
    _vectored(conn, buffers, socket.SO_RCVTIMEO, deadline,
              lambda pieces: conn.recvmsg_into(pieces, 0, socket.MSG_WAITALL)[0])


def _send_frame(conn: socket.socket, kind: int, payload: dict, deadline: _Deadline) -> None:
    _send(conn, p.encode_frame(kind, payload), deadline=deadline)


def _recv_frame(conn: socket.socket, deadline: _Deadline) -> tuple[int, dict]:
    header = bytearray(p.HEADER_SIZE)
    _recv_into(conn, header, deadline=deadline)
    kind, length = p.decode_header(bytes(header))  # bounded before the payload is read
    body = bytearray(length)
    _recv_into(conn, body, deadline=deadline)
    return kind, p.decode_payload(bytes(body))


def _recv_tensor(conn: socket.socket, t: torch.Tensor, deadline: _Deadline) -> None:
    """Fill a contiguous tensor, a GPU one through host memory."""
    host = torch.empty(t.shape, dtype=t.dtype) if t.is_cuda else t
    _recv_into(conn, _bytes(host), deadline=deadline)
    if host is not t:
        t.copy_(host)


def _abort(conn: socket.socket) -> None:
    """Close at once, unsent bytes dropped (a reset, not an orderly close the peer could mistake
    for a complete reply)."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
    except OSError:
        pass
    conn.close()


class TCPExporter(NetworkExporter):
    def __init__(self, exporter_id: str, kv: torch.Tensor, layout: p.KVLayout,
                 pin: Callable[[list[int]], None], unpin: Callable[[list[int]], None],
                 lease_s: float = 30.0, host: str = "127.0.0.1", port: int = 0, ack_timeout_s: float = 10.0,
                 idle_timeout_s: float = 300.0, shared_memory: bool = True,
                 max_connections: int = MAX_CONNECTIONS):
        super().__init__(exporter_id, kv, layout, pin, unpin, lease_s, host, ack_timeout_s, idle_timeout_s,
                         shared_memory, max_connections)
        if self.cache_region is not None:  # importers that can copy out of it ask the board, not us
            self.leases.board = LeaseBoard()
        self._count_lock = threading.Lock()
        self._open: set[socket.socket] = set()  # shut down at `close`, which their threads then see
        self._listener = socket.create_server((host, port), backlog=128)
        self._listener.settimeout(0.5)  # the accept loop sees `close` within this
        self.port = self._listener.getsockname()[1]
        self._accepting = threading.Thread(target=self._accept_loop, name=f"kv-accept-{exporter_id}", daemon=True)
        self._accepting.start()
        log.info("KV exporter %s listening on %s (tcp)", exporter_id, self.address)

    @property
    def is_healthy(self) -> bool:
        return super().is_healthy and self._accepting.is_alive()

    def close(self) -> None:
        super().close()  # sets _closed: the accept loop ends within its wait
        with self._count_lock:
            for conn in self._open:
                try:
                    conn.shutdown(socket.SHUT_RDWR)  # wakes its thread out of recv/send
                except OSError:
                    pass
        self._accepting.join(5)
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if not self._closed.is_set():
                    log.warning("KV exporter %s: accept failed: %r", self.exporter_id, e)
                    time.sleep(0.1)
                continue
            with self._count_lock:
                if self.num_open_connections >= self.max_connections:
                    log.warning("KV connection refused: %d open already", self.num_open_connections)
                    _abort(conn)
                    continue
                self.num_connections += 1
                self.num_open_connections += 1
                self._open.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name=f"kv-conn-{self.exporter_id}",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """One connection: reads, one after another, until the importer closes it, a read fails,
        it stays idle for `idle_timeout_s`, or the exporter closes."""
        try:
            conn.settimeout(None)  # blocking: `_arm` bounds each call
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wait_s = self.ack_timeout_s  # for the first frame: a peer that says nothing is dropped soon
            while not self._closed.is_set():
                try:
                    kind, req = _recv_frame(conn, _Deadline(wait_s))
                except p.ProtocolError as e:
                    kind, req = None, e
                except (OSError, EOFError):  # closed by the importer, reset, or idle too long
                    return
                wait_s = self.idle_timeout_s
                if not self._serve_one(conn, kind, req):
                    return
        finally:
            with self._count_lock:
                self.num_open_connections -= 1
                self._open.discard(conn)
            conn.close()  # an orderly close: an ERROR frame still queued reaches the importer

    def _serve_one(self, conn: socket.socket, kind: int | None, req) -> bool:
        """One frame from the importer and what follows it; True when the connection may carry
        another read (this one ended in ACK or DONE)."""
        rid, read = None, None
        try:
            if isinstance(req, p.ProtocolError):
                raise req
            opened = self.open_wire_read(kind, req, self.ack_timeout_s)
            if isinstance(opened, bool):
                # An ACK. One that released a lease (after a read the lease board vouched for) may
                # be followed by the importer's next frame; one that released nothing ends the
                # connection, as an unknown READ does, so a peer cannot spin this thread on it.
                return opened
            rid, token, read, send_s, is_local = opened
            deadline = _Deadline(send_s)
            if is_local:
                # The importer copies the blocks out of the cache itself: they stay held until its
                # ACK/DONE, or until its own deadline has passed (it then discards what it copied).
                _send_frame(conn, p.DATA, {"shape": list(read.shape), "num_chunks": 0, "local": True}, deadline)
                kind, _ = _recv_frame(conn, deadline)
            else:
                self._send_blocks(conn, read, deadline)
                read.close()  # the kernel holds its own copy of whatever is still unsent
                read = None
                kind, _ = _recv_frame(conn, _Deadline(self.ack_timeout_s))
            if kind == p.ACK:
                self.ack(rid, token)
            return kind in (p.ACK, p.DONE)
        except p.KVTransferError as e:
            try:
                _send_frame(conn, p.ERROR, p.error_frame(e), _Deadline(ERROR_SEND_S))
            except OSError:  # the importer may be gone already
                pass
        except Exception as e:  # noqa: BLE001 - one bad peer must not take the listener down
            log.warning("KV read for %s failed: %r (the lease stays until ack or expiry)", rid, e)
        finally:
            if read is not None:
                read.close()
        return False

    def _send_blocks(self, conn: socket.socket, read: BlockRead, deadline: _Deadline) -> None:
        """DATA, then the blocks: on CPU, when the importer takes every head, straight out of the
        cache in vectored sends (no copy, however scattered the blocks); else chunk by chunk, each
        gathered while the one before is on the wire."""
        n = len(read.chunks)
        data = p.encode_frame(p.DATA, {"shape": list(read.shape), "num_chunks": n})
        if read.heads == (0, self.kv.shape[4]) and not self.kv.is_cuda:
            return _send(conn, data, *block_pieces(self.kv, read.block_ids), deadline=deadline)
        _send(conn, data, deadline=deadline)
        gather = _copies.submit(read.chunk, 0)
        try:
            for i in range(n):
                chunk = gather.result()
                gather = _copies.submit(read.chunk, i + 1) if i + 1 < n else None
                _send(conn, _host_bytes(chunk), deadline=deadline)
        finally:
            _settled(gather)  # before the read's staging buffer can go back


class _StaleConnection(Exception):
    """A kept connection failed before the pull's first reply: the exporter had dropped it."""


class TCPImporter(KVImporter):
    def __init__(self, kv: torch.Tensor, layout: p.KVLayout, idle_s: float = 60.0, max_idle_per_exporter: int = 8):
        # idle_s: how long a kept connection stays usable (under the exporter's idle_timeout_s);
        # max_idle_per_exporter: connections kept per exporter address (one pull at a time on each).
        super().__init__(kv, layout)
        self.idle_s, self.max_idle_per_exporter = idle_s, max_idle_per_exporter
        self._idle: dict[str, list[tuple[socket.socket, float]]] = {}  # address -> [(connection, idle since)]
        self._lock = threading.Lock()  # pulls run on several threads: the kept connections and mapped caches
        self.num_connections_created = 0

    def close(self) -> None:
        with self._lock:
            for conns in self._idle.values():
                for conn, _ in conns:
                    _abort(conn)
            self._idle.clear()
            self._sources.clear()

    def _fetch(self, handle: p.KVHandle, dst: list[int], heads: tuple[int, int], timeout_s: float,
               first_block: int, ack: bool) -> None:
        deadline = _Deadline(timeout_s)
        with self._lock:
            source = self.mapped_cache(handle)
            board = self.mapped_board(handle) if source is not None else None
        try:
            # As a READ's copy, one that ends past the caller's deadline is void (`deadline.left`).
            if board is not None and self.read_on_board(board, source, handle, dst, heads, first_block, deadline.left):
                if ack:
                    self._ack(handle, deadline)
                return
            conn, is_kept = self._connection(handle.address, deadline)
            try:
                self._read(conn, is_kept, source, handle, dst, heads, first_block, ack, deadline)
            except _StaleConnection:
                conn, _ = self._connection(handle.address, deadline, kept=False)
                self._read(conn, False, source, handle, dst, heads, first_block, ack, deadline)
        except socket.timeout:
            self._forget(handle)
            raise p.ExporterUnreachableError(
                f"KV pull of {handle.request_id} from {handle.address}: no answer within {timeout_s:.1f}s") from None
        except p.KVTransferError:
            raise
        except (OSError, EOFError) as e:  # refused, reset, unreachable
            self._forget(handle)
            raise p.ExporterUnreachableError(f"KV pull of {handle.request_id} from {handle.address}: {e!r}") from e
        self._keep(handle.address, conn)

    def _ack(self, handle: p.KVHandle, deadline: _Deadline) -> None:
        """Release the lease of a read the board vouched for, waiting for nothing (an ACK has no
        answer): on a kept connection, kept again after, else a new one. Should it fail, the lease
        expires as one whose importer died would."""
        conn = None
        try:
            conn, _ = self._connection(handle.address, deadline)
            _send_frame(conn, p.ACK, {"request_id": handle.request_id, "lease_token": handle.lease_token}, deadline)
        except OSError as e:  # socket.timeout too
            if conn is not None:
                _abort(conn)
            log.info("KV ack of %s not sent (%r): its lease expires instead", handle.request_id, e)
            return
        self._keep(handle.address, conn)

    def _release(self, handle: p.KVHandle, timeout_s: float) -> None:
        deadline = _Deadline(timeout_s)
        conn = self._connect(handle.address, deadline)
        try:
            _send_frame(conn, p.ACK, {"request_id": handle.request_id, "lease_token": handle.lease_token}, deadline)
        finally:
            conn.close()

    def _forget(self, handle: p.KVHandle) -> None:
        with self._lock:
            self.forget_cache(handle)

    def _connect(self, address: str, deadline: _Deadline) -> socket.socket:
        host, port = address.rsplit(":", 1)
        conn = socket.create_connection((host, int(port)), timeout=deadline.left())
        conn.settimeout(None)  # blocking: `_arm` bounds each call
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _connection(self, address: str, deadline: _Deadline, kept: bool = True) -> tuple[socket.socket, bool]:
        """A connection to `address`: a kept one (True) when `kept` and one is fresh enough, else a new one."""
        with self._lock:
            idle = self._idle.get(address, [])
            while kept and idle:
                conn, since = idle.pop()
                if time.monotonic() - since < self.idle_s:
                    return conn, True
                _abort(conn)
        conn = self._connect(address, deadline)
        with self._lock:
            self.num_connections_created += 1
        return conn, False

    def _keep(self, address: str, conn: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if len(idle) < self.max_idle_per_exporter:
                idle.append((conn, time.monotonic()))
                return
        _abort(conn)

    def _read(self, conn: socket.socket, is_kept: bool, source, handle: p.KVHandle, dst: list[int],
              heads: tuple[int, int], first_block: int, ack: bool, deadline: _Deadline) -> None:
        """One READ on `conn`, the blocks in `dst`, then ACK/DONE; `conn` stays open on success and
        is aborted on any failure. On a kept connection, a failure before the exporter's reply
        raises `_StaleConnection` (nothing was written into `dst`)."""
        shape = self.expected_shape(len(dst), heads)
        num_chunks = 0 if source is not None else len(self.wire_chunks(shape))  # local: no chunks
        # A GPU cache receives through host memory, chunk by chunk; a CPU cache straight into its blocks.
        chunks, targets, staging = self.chunk_targets(dst, heads)[1:] if source is None and self.kv.is_cuda \
            else ([], [], None)
        is_done, is_copying, scatter = False, False, None
        src_ids = list(handle.block_ids[first_block:])
        try:
            try:
                _send_frame(conn, p.READ, {
                    "request_id": handle.request_id, "lease_token": handle.lease_token,
                    "layout": asdict(self.layout), "first_block": first_block, "timeout_s": deadline.left(),
                    "local": source is not None}, deadline)
                if isinstance(source, torch.Tensor):
                    # On a GPU the copy runs while the exporter answers: the lease has pinned the
                    # blocks since the export, so when DATA confirms it was live at the READ, they
                    # were held all along (and stay held until our ACK/DONE). On an ERROR it is void.
                    copy_blocks(source, src_ids, heads, self.kv, dst)
                    is_copying = True
                kind, reply = _recv_frame(conn, deadline)
            except (socket.timeout, p.KVTransferError):
                raise
            except (OSError, EOFError) as e:
                if is_kept:
                    raise _StaleConnection() from e
                raise
            if kind == p.ERROR:
                raise p.error_of(reply)
            if kind != p.DATA:
                raise p.ProtocolError(f"expected a DATA frame, got kind {kind}")
            if (tuple(reply.get("shape", ())) != shape or reply.get("num_chunks") != num_chunks
                    or bool(reply.get("local")) != (source is not None)):
                raise p.ProtocolError(f"exporter sends blocks of shape {reply.get('shape')} in "
                                      f"{reply.get('num_chunks')} chunks, expected {shape} in {num_chunks}")
            if source is not None:  # the exporter holds the blocks until our ACK/DONE, or our deadline
                if is_copying:
                    self.finish_copy()
                    is_copying = False
                else:
                    copy_blocks(source, src_ids, heads, self.kv, dst)
                deadline.left()  # past it, they may have gone back to its pool meanwhile: the copy is void
                self.num_shared_memory_pulls += 1
            if source is None and not self.kv.is_cuda:
                _recv_into(conn, *block_pieces(self.kv, dst), deadline=deadline)
            slabs = slab_view(self.kv)
            for (s0, s1), (target, is_staged) in zip(chunks, targets):
                _recv_tensor(conn, target, deadline)
                if is_staged:  # scattered while the next chunk arrives
                    if scatter is not None:
                        scatter.result()
                    scatter = _copies.submit(scatter_blocks, slabs[s0:s1], dst, target)
            if scatter is not None:
                scatter.result()
            _send_frame(conn, p.ACK if ack else p.DONE,
                        {"request_id": handle.request_id, "lease_token": handle.lease_token}, deadline)
            is_done = True
        finally:
            if is_copying:  # a failed pull's blocks go back to the pool: not while the copy writes them
                self.finish_copy()
            _settled(scatter)  # likewise
            if not is_done:
                _abort(conn)
            if staging is not None:  # nothing writes into it once the scatters and this thread's recv_into ended
                self.buffers.give(staging)
