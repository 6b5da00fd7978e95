"""KV transfer over UCX (the `ucxx` package): TCP or shared memory on CPU, CUDA-aware on GPU.

`UCXExporter` (prefill side) listens on a free port from an event-loop thread of its own, so
engine steps never wait on it. A read is: READ frame (request id + importer layout) -> checks ->
DATA frame + one contiguous buffer of the requested blocks (only the importer's heads) -> ACK,
which releases the lease. `UCXImporter` (decode side) pulls into blocks of its own cache, with a
deadline on every wait; on any failure it raises a typed `KVTransferError` and frees the blocks it
was given through `on_failure`. Lease expiry runs on the exporter's loop.
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
from pdserve.kvtransfer.blocks import BufferPool, LeaseTable, gather_blocks, scatter_blocks

log = logging.getLogger(__name__)

_ERRORS = {"unknown": p.UnknownRequestError, "expired": p.LeaseExpiredError, "layout": p.LayoutMismatchError,
           "protocol": p.ProtocolError}


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


async def _send_frame(ep, kind: int, payload: dict) -> None:
    frame = p.encode_frame(kind, payload)
    await ep.send(np.frombuffer(frame[:p.HEADER_SIZE], dtype=np.uint8).copy())
    await ep.send(np.frombuffer(frame[p.HEADER_SIZE:], dtype=np.uint8).copy())


async def _recv_frame(ep) -> tuple[int, dict]:
    header = np.empty(p.HEADER_SIZE, dtype=np.uint8)
    await ep.recv(header)
    kind, length = p.decode_header(header.tobytes())
    body = np.empty(length, dtype=np.uint8)
    await ep.recv(body)
    return kind, p.decode_payload(body.tobytes())


class UCXExporter:
    def __init__(self, exporter_id: str, kv: torch.Tensor, layout: p.KVLayout,
                 pin: Callable[[list[int]], None], unpin: Callable[[list[int]], None],
                 lease_s: float = 30.0, host: str = "127.0.0.1", port: int = 0, ack_timeout_s: float = 10.0):
        import ucxx

        self.exporter_id, self.kv, self.layout, self.host = exporter_id, kv, layout, host
        self.leases = LeaseTable(pin, unpin, lease_s)
        self.ack_timeout_s = ack_timeout_s
        self._buffers = BufferPool()
        self._loop = _LoopThread(f"kv-exporter-{exporter_id}")

        async def start():
            self._listener = ucxx.create_listener(self._serve, port=port)
            self._expiry_task = asyncio.ensure_future(self._expire_leases())
            return self._listener.port

        self.port = self._loop.run(start(), 30)
        log.info("KV exporter %s listening on %s", exporter_id, self.address)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def export(self, request_id: str, block_ids: list[int], num_tokens: int) -> p.KVHandle:
        """Pin a finished prefill's blocks under a lease and describe them for the importer."""
        self.leases.add(request_id, block_ids)
        return p.KVHandle(self.exporter_id, self.address, request_id, tuple(block_ids), num_tokens, self.layout,
                          time.time() + self.leases.lease_s)

    def close(self) -> None:
        async def stop():
            self._expiry_task.cancel()
            self._listener.close()

        self._loop.run(stop(), 10)
        self._loop.stop()

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            for rid in self.leases.expire():
                log.warning("KV lease for %s expired; its blocks return to the pool", rid)

    async def _serve(self, ep) -> None:
        rid = None
        try:
            kind, req = await asyncio.wait_for(_recv_frame(ep), self.ack_timeout_s)
            if kind != p.READ:
                raise p.ProtocolError(f"expected a READ frame, got kind {kind}")
            rid = req.get("request_id")
            try:
                importer = p.KVLayout(**req["layout"])
            except (TypeError, KeyError) as e:
                raise p.ProtocolError(f"malformed layout: {e}") from e
            lease = self.leases.get(rid)
            if lease is None:
                code = "expired" if self.leases.was_expired(rid) else "unknown"
                await _send_frame(ep, p.ERROR, {"code": code, "message": f"no KV blocks held for request {rid!r} "
                                                f"({'lease expired' if code == 'expired' else 'unknown request'})"})
                return
            heads = p.head_slice(self.layout, importer)
            shape = (*self.kv.shape[:2], len(lease.block_ids), self.kv.shape[3], heads[1] - heads[0], self.kv.shape[5])
            data = gather_blocks(self.kv, lease.block_ids, heads, self._buffers.take(shape, self.kv.dtype))
            try:
                await _send_frame(ep, p.DATA, {"shape": list(data.shape)})
                await ep.send(data.numpy().reshape(-1).view(np.uint8))
            finally:
                self._buffers.give(data)
            kind, _ = await asyncio.wait_for(_recv_frame(ep), self.ack_timeout_s)
            if kind == p.ACK:
                self.leases.release(rid)
        except p.KVTransferError as e:
            code = "layout" if isinstance(e, p.LayoutMismatchError) else "protocol"
            try:
                await _send_frame(ep, p.ERROR, {"code": code, "message": str(e)})
            except Exception:  # noqa: BLE001 - the importer may be gone already
                pass
        except Exception as e:  # noqa: BLE001 - one bad peer must not take the listener down
            log.warning("KV read for %s failed: %r (the lease stays until ack or expiry)", rid, e)
        finally:
            try:
                await ep.close()
            except Exception:  # noqa: BLE001
                pass


class UCXImporter:
    def __init__(self, kv: torch.Tensor, layout: p.KVLayout):
        self.kv, self.layout = kv, layout
        self._buffers = BufferPool()
        self._loop = _LoopThread("kv-importer")

    def close(self) -> None:
        self._loop.stop()

    def pull(self, handle: p.KVHandle, dst_block_ids: list[int], timeout_s: float = 10.0,
             on_failure: Callable[[list[int]], None] | None = None) -> None:
        """Fill `dst_block_ids` with the handle's blocks (only this rank's heads), then ack.

        Raises a `KVTransferError` within about `timeout_s` on any failure, after calling
        `on_failure(dst_block_ids)` so the caller's blocks go back to its pool.
        """
        try:
            heads = p.head_slice(handle.layout, self.layout)
            if len(dst_block_ids) != len(handle.block_ids):
                raise p.ProtocolError(f"{len(dst_block_ids)} destination blocks for {len(handle.block_ids)} exported")
            self._loop.run(self._pull(handle, dst_block_ids, heads, timeout_s), timeout_s + 5)
        except BaseException as e:
            if on_failure is not None:
                on_failure(list(dst_block_ids))
            if isinstance(e, p.KVTransferError):
                raise
            raise p.ExporterUnreachableError(f"KV pull of {handle.request_id} from {handle.address} failed: {e!r}") from e

    async def _pull(self, handle: p.KVHandle, dst: list[int], heads: tuple[int, int], timeout_s: float) -> None:
        import ucxx

        deadline = time.monotonic() + timeout_s

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError
            return remaining

        host, port = handle.address.rsplit(":", 1)
        ep = None
        try:
            ep = await asyncio.wait_for(ucxx.create_endpoint(host, int(port)), left())
            await asyncio.wait_for(_send_frame(ep, p.READ, {"request_id": handle.request_id,
                                                            "layout": asdict(self.layout)}), left())
            kind, reply = await asyncio.wait_for(_recv_frame(ep), left())
            if kind == p.ERROR:
                raise _ERRORS.get(reply.get("code"), p.ProtocolError)(reply.get("message", "exporter error"))
            if kind != p.DATA:
                raise p.ProtocolError(f"expected a DATA frame, got kind {kind}")
            shape = tuple(reply["shape"])
            expected = (self.kv.shape[0], 2, len(dst), self.kv.shape[3], heads[1] - heads[0], self.kv.shape[5])
            if shape != expected:
                raise p.ProtocolError(f"exporter sent blocks of shape {shape}, expected {expected}")
            buf = self._buffers.take(shape, self.kv.dtype)
            try:
                await asyncio.wait_for(ep.recv(buf.numpy().reshape(-1).view(np.uint8)), left())
                scatter_blocks(self.kv, dst, buf)
            finally:
                self._buffers.give(buf)
            await asyncio.wait_for(_send_frame(ep, p.ACK, {"request_id": handle.request_id}), left())
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
            if ep is not None:
                try:
                    ep.abort()
                except Exception:  # noqa: BLE001
                    pass
