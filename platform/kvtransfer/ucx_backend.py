"""KV transfer over UCX (the `ucxx` package): TCP or shared memory on CPU, CUDA-aware on GPU.

`UCXExporter` (prefill side) listens on a free port from an event-loop thread of its own, so
engine steps never wait on it. `UCXImporter` (decode side) pulls with a deadline on every wait.
Leases, checks and failure handling are the base classes' (base.py).

One pull, one connection, in UCX tag messages (protocol version 2, protocol.py):

    importer                                   exporter
    READ {request_id, layout, first_block,  ->
          timeout_s}
    (posts receives for the reply and           checks lease and layout
     every chunk at once)                  <-   ERROR {code, message}            (and closes), or
                                           <-   DATA {shape, num_chunks}, then chunk 0, 1, ... raw
    scatters chunk i while i+1 arrives          gathers chunk i+1 while chunk i is on the wire
    ACK {request_id} (or DONE: keep lease)  ->  releases the lease on ACK

Each control frame is one message. A chunk is sent from and received into the cache itself when
that side's blocks are one run (and, for the exporter, the importer takes every head); otherwise it
goes through a staging buffer. The exporter bounds its sends by the importer's `timeout_s` and its
wait for the ACK by `ack_timeout_s`; on any failure it aborts the endpoint (cancelling sends)
before the blocks can return to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import asdict
from typing import Callable

import numpy as np
import torch

from pdserve.kvtransfer import protocol as p
from pdserve.kvtransfer.base import BlockRead, KVExporter, KVImporter
from pdserve.kvtransfer.blocks import block_run, scatter_blocks, slab_view

log = logging.getLogger(__name__)

_ERRORS = {"unknown": p.UnknownRequestError, "expired": p.LeaseExpiredError, "layout": p.LayoutMismatchError,
           "protocol": p.ProtocolError}
_MAX_SEND_S = 3600.0  # the most an importer may ask the exporter to keep sending


class _LoopThread:
    """An asyncio loop on a daemon thread; `run(coro, timeout)` from any other thread."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _buffer(t: torch.Tensor):
    """What ucxx sends from or receives into: the tensor's own memory, no copy (contiguous)."""
    return t if t.is_cuda else t.numpy().reshape(-1).view(np.uint8)


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


class UCXExporter(KVExporter):
    def __init__(self, exporter_id: str, kv: torch.Tensor, layout: p.KVLayout,
                 pin: Callable[[list[int]], None], unpin: Callable[[list[int]], None],
                 lease_s: float = 30.0, host: str = "127.0.0.1", port: int = 0, ack_timeout_s: float = 10.0):
        import ucxx

        super().__init__(exporter_id, kv, layout, pin, unpin, lease_s)
        self.host, self.ack_timeout_s = host, ack_timeout_s
        self._loop = _LoopThread(f"kv-exporter-{exporter_id}")

        async def start():
            self._listener = ucxx.create_listener(self._serve, port=port)
            return self._listener.port

        self.port = self._loop.run(start(), 30)
        log.info("KV exporter %s listening on %s", exporter_id, self.address)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def is_healthy(self) -> bool:
        return super().is_healthy and self._loop.thread.is_alive()

    def close(self) -> None:
        async def stop():
            self._listener.close()

        self._loop.run(stop(), 10)
        self._loop.stop()
        super().close()

    async def _serve(self, ep) -> None:
        rid, read = None, None
        try:
            kind, req = await asyncio.wait_for(_recv_frame(ep), self.ack_timeout_s)
            rid = req.get("request_id")
            if kind == p.ACK:  # an importer dropping a lease it will not read
                self.ack(rid)
                return
            if kind != p.READ:
                raise p.ProtocolError(f"expected a READ frame, got kind {kind}")
            try:
                importer = p.KVLayout(**req["layout"])
                send_s = min(max(float(req.get("timeout_s", self.ack_timeout_s)), 0.0), _MAX_SEND_S)
            except (TypeError, KeyError, ValueError) as e:
                raise p.ProtocolError(f"malformed READ: {e!r}") from e
            read = self.open_read(rid, importer, req.get("first_block", 0))
            await asyncio.wait_for(self._send_blocks(ep, read), send_s)
            read.close()  # every send completed: the blocks may go back once acked
            read = None
            kind, _ = await asyncio.wait_for(_recv_frame(ep), self.ack_timeout_s)
            if kind == p.ACK:
                self.ack(rid)
        except p.KVTransferError as e:
            code = next((c for c, cls in _ERRORS.items() if type(e) is cls), "protocol")
            try:
                await asyncio.wait_for(_send_frame(ep, p.ERROR, {"code": code, "message": str(e)}), 5)
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
            else:
                try:
                    await asyncio.wait_for(ep.close(), 5)
                except Exception:  # noqa: BLE001
                    pass

    @staticmethod
    async def _send_blocks(ep, read: BlockRead) -> None:
        """DATA, then every chunk; chunk i+1 is gathered while chunk i is on the wire."""
        sends = [asyncio.ensure_future(_send_frame(ep, p.DATA, {"shape": list(read.shape),
                                                                "num_chunks": len(read.chunks)}))]
        try:
            for i in range(len(read.chunks)):
                await asyncio.sleep(0)  # the previous send is posted (in order) before the next copy
                sends.append(asyncio.ensure_future(ep.send(_buffer(read.chunk(i)))))
            await asyncio.gather(*sends)
        finally:
            await _settle([t for t in sends if not t.done()], 0.1)


class UCXImporter(KVImporter):
    def __init__(self, kv: torch.Tensor, layout: p.KVLayout):
        super().__init__(kv, layout)
        self._loop = _LoopThread("kv-importer")

    def close(self) -> None:
        self._loop.stop()

    def _fetch(self, handle: p.KVHandle, dst: list[int], heads: tuple[int, int], timeout_s: float,
               first_block: int, ack: bool) -> None:
        self._loop.run(self._pull(handle, dst, heads, timeout_s, first_block, ack), timeout_s + 5)

    def _release(self, handle: p.KVHandle, timeout_s: float) -> None:
        import ucxx

        async def ack():
            host, port = handle.address.rsplit(":", 1)
            ep = await ucxx.create_endpoint(host, int(port))
            try:
                await _send_frame(ep, p.ACK, {"request_id": handle.request_id})
            finally:
                await ep.close()

        self._loop.run(asyncio.wait_for(ack(), timeout_s), timeout_s + 1)

    async def _pull(self, handle: p.KVHandle, dst: list[int], heads: tuple[int, int], timeout_s: float,
                    first_block: int, ack: bool) -> None:
        import ucxx

        deadline = time.monotonic() + timeout_s

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError
            return remaining

        shape = self.expected_shape(len(dst), heads)
        slab_bytes = len(dst) * shape[3] * shape[4] * shape[5] * self.kv.element_size()
        chunks = p.chunk_bounds(shape[0] * 2, slab_bytes)
        run = block_run(dst)
        slabs, staging, targets = slab_view(self.kv), None, []
        for s0, s1 in chunks:  # where each chunk lands: in place, or staging to scatter from
            if run is not None and s1 - s0 == 1:
                targets.append((slabs[s0, 0, run:run + len(dst)], False))
            else:
                if staging is None:
                    staging = self.buffers.take(shape, self.kv.dtype)
                targets.append((slab_view(staging)[s0:s1], True))

        host, port = handle.address.rsplit(":", 1)
        ep, tasks = None, []
        try:
            ep = await asyncio.wait_for(ucxx.create_endpoint(host, int(port)), left())
            # Every receive is posted now, in the order the exporter sends, so no chunk waits on us.
            tasks.append(asyncio.ensure_future(_send_frame(ep, p.READ, {
                "request_id": handle.request_id, "layout": asdict(self.layout), "first_block": first_block,
                "timeout_s": left()})))
            tasks.append(asyncio.ensure_future(_recv_frame(ep)))
            tasks.extend(asyncio.ensure_future(ep.recv(_buffer(t))) for t, _ in targets)
            await asyncio.wait_for(asyncio.shield(tasks[0]), left())
            kind, reply = await asyncio.wait_for(asyncio.shield(tasks[1]), left())
            if kind == p.ERROR:
                raise _ERRORS.get(reply.get("code"), p.ProtocolError)(reply.get("message", "exporter error"))
            if kind != p.DATA:
                raise p.ProtocolError(f"expected a DATA frame, got kind {kind}")
            if tuple(reply.get("shape", ())) != shape or reply.get("num_chunks") != len(chunks):
                raise p.ProtocolError(f"exporter sends blocks of shape {reply.get('shape')} in "
                                      f"{reply.get('num_chunks')} chunks, expected {shape} in {len(chunks)}")
            for (s0, s1), (target, is_staged), recv in zip(chunks, targets, tasks[2:]):
                await asyncio.wait_for(asyncio.shield(recv), left())
                if is_staged:  # while the next chunks arrive
                    scatter_blocks(slabs[s0:s1], dst, target)
            await asyncio.wait_for(_send_frame(ep, p.ACK if ack else p.DONE, {"request_id": handle.request_id}),
                                   left())
            await asyncio.wait_for(ep.close(), left())
            ep = None
        except asyncio.TimeoutError:
            raise p.ExporterUnreachableError(
                f"KV pull of {handle.request_id} from {handle.address}: no answer within {timeout_s:.1f}s") from None
        except p.KVTransferError:
            raise
        except Exception as e:  # UCX errors: connection refused or reset
            raise p.ExporterUnreachableError(f"KV pull of {handle.request_id} from {handle.address}: {e!r}") from e
        finally:
            if ep is not None:  # cancels the receives still posted, before their buffers go back
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
