"""KV transfer over UCX (the `ucxx` package): TCP or shared memory on CPU, CUDA-aware on GPU.

`UCXExporter` (prefill side) listens on a free port from an event-loop thread of its own, so
engine steps never wait on it. A read is: READ frame (request id + importer layout) -> the
exporter's checks -> DATA frame + one contiguous buffer of the requested blocks (only the
importer's heads) -> ACK, which releases the lease. `UCXImporter` (decode side) pulls with a
deadline on every wait. Leases, checks and failure handling are the base classes' (base.py).
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
from pdserve.kvtransfer.base import KVExporter, KVImporter

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
        rid = None
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
            except (TypeError, KeyError) as e:
                raise p.ProtocolError(f"malformed layout: {e}") from e
            data = self.read(rid, importer, req.get("first_block", 0))
            try:
                await _send_frame(ep, p.DATA, {"shape": list(data.shape)})
                await ep.send(data.numpy().reshape(-1).view(np.uint8))
            finally:
                self.release_buffer(data)
            kind, _ = await asyncio.wait_for(_recv_frame(ep), self.ack_timeout_s)
            if kind == p.ACK:
                self.ack(rid)
        except p.KVTransferError as e:
            code = next((c for c, cls in _ERRORS.items() if type(e) is cls), "protocol")
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

        host, port = handle.address.rsplit(":", 1)
        ep = None
        try:
            ep = await asyncio.wait_for(ucxx.create_endpoint(host, int(port)), left())
            await asyncio.wait_for(_send_frame(ep, p.READ, {"request_id": handle.request_id,
                                                            "layout": asdict(self.layout),
                                                            "first_block": first_block}), left())
            kind, reply = await asyncio.wait_for(_recv_frame(ep), left())
            if kind == p.ERROR:
                raise _ERRORS.get(reply.get("code"), p.ProtocolError)(reply.get("message", "exporter error"))
            if kind != p.DATA:
                raise p.ProtocolError(f"expected a DATA frame, got kind {kind}")
            shape = tuple(reply["shape"])
            expected = self.expected_shape(len(dst), heads)
            if shape != expected:
                raise p.ProtocolError(f"exporter sent blocks of shape {shape}, expected {expected}")
            buf = self.buffers.take(shape, self.kv.dtype)
            try:
                await asyncio.wait_for(ep.recv(buf.numpy().reshape(-1).view(np.uint8)), left())
                self.store(dst, buf)
            finally:
                self.buffers.give(buf)
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
            if ep is not None:
                try:
                    ep.abort()
                except Exception:  # noqa: BLE001
                    pass
