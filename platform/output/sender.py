"""The engine replica's side of the output connections (see `pdserve.output`): a listener
(`OutputChannelServer`) and one `OutputSink` per connected gateway, which batches what is sent
during one event-loop turn into frames of at most `MAX_FRAME_BYTES`.

The listener is reachable from the network, so it trusts nothing it reads (DESIGN section 8):
- a connection must send its hello within `HELLO_TIMEOUT_S`; a length prefix over
  `HELLO_MAX_BYTES` closes it before anything is read, and the hello unpacks with msgpack limits
  of its own size;
- the hello must carry this replica's secret (128 random bits, handed to gateways only inside the
  Ray call that offers the connection), compared in constant time;
- a gateway id already connected is refused: the connection it has keeps its requests;
- after the hello nothing may come from the gateway: a byte closes the connection;
- at most `MAX_CONNECTIONS` connections at once (hello or not); one with no request attached for
  `IDLE_TIMEOUT_S` is closed (the gateway connects again when it needs to).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from typing import Callable, Iterable

from pdserve.engine.outputs import RequestOutput
from pdserve.output.frames import (FRAME_OVERHEAD_BYTES, HELLO_MAX_BYTES, MAX_FRAME_BYTES, VERSION, ChannelOffer,
                                   OutputChannelError, entries_frame, pack_entry, pack_error_entry, read_frame)

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 300.0
# Gateway replicas one engine replica serves at once; each holds one connection.
MAX_CONNECTIONS = 256


class OutputSink:
    """One gateway's connection on a replica. `send` queues an output; what is queued during one
    event-loop turn leaves as frames of at most `max_frame_bytes`. An output too large for a
    frame fails its own request (an error entry, and `on_close` aborts it). Once closed, `send`
    raises and `on_close` is told the requests still attached (to abort them)."""

    def __init__(self, conn_id: int, writer: asyncio.StreamWriter,
                 on_close: Callable[[Iterable[str]], None], max_frame_bytes: int = MAX_FRAME_BYTES):
        self.conn_id, self._writer, self._on_close = conn_id, writer, on_close
        self.max_frame_bytes = max_frame_bytes
        self._pending: list[bytes] = []
        self.request_ids: set[str] = set()
        self.is_closed = False
        self.last_used_s = time.monotonic()

    def send(self, request_id: str, out: RequestOutput) -> None:
        if self.is_closed:
            raise OutputChannelError("the gateway's output connection closed")
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        entry = pack_entry(request_id, out)
        if len(entry) + FRAME_OVERHEAD_BYTES > self.max_frame_bytes:
            log.warning("an output of %s is %d bytes, over the output connection's %d-byte frames: failing it",
                        request_id, len(entry), self.max_frame_bytes)
            entry = pack_error_entry(request_id, f"an output of {len(entry)} bytes is larger than a frame "
                                                 f"({self.max_frame_bytes} bytes): ask for fewer logprobs")
            self._on_close([request_id])
        self._pending.append(entry)
        self.last_used_s = time.monotonic()

    def _flush(self) -> None:
        entries, self._pending = self._pending, []
        if self.is_closed:
            return
        batch, size = [], FRAME_OVERHEAD_BYTES
        for entry in entries:
            if batch and size + len(entry) > self.max_frame_bytes:
                self._writer.write(entries_frame(batch))
                batch, size = [], FRAME_OVERHEAD_BYTES
            batch.append(entry)
            size += len(entry)
        if batch:
            self._writer.write(entries_frame(batch))

    def close(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        self._writer.close()
        attached, self.request_ids = self.request_ids, set()
        if attached:
            self._on_close(attached)


class OutputChannelServer:
    """A replica's listener; `sink(gateway_id)` is that gateway's open connection, if any.
    `on_close(request_ids)` aborts requests whose gateway connection closed under them."""

    def __init__(self, host: str, on_close: Callable[[Iterable[str]], None], bind_host: str | None = None,
                 max_connections: int = MAX_CONNECTIONS, idle_timeout_s: float = IDLE_TIMEOUT_S):
        self.host, self.bind_host, self._on_close = host, bind_host or host, on_close
        self.max_connections, self.idle_timeout_s = max_connections, idle_timeout_s
        self.secret = secrets.token_hex(16)
        self._sinks: dict[str, OutputSink] = {}
        self._num_open = 0  # connections accepted and not yet closed, with a hello or not
        self._server: asyncio.AbstractServer | None = None
        self._starting: asyncio.Future | None = None
        self.port: int | None = None

    async def offer(self) -> ChannelOffer:
        """Start listening (first call) and say where, with the secret a hello must carry."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)
        return ChannelOffer(self.host, self.port, self.secret)

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.bind_host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def sink(self, gateway_id: str | None) -> OutputSink | None:
        s = self._sinks.get(gateway_id) if gateway_id is not None else None
        return s if s is not None and not s.is_closed else None

    @property
    def num_connections(self) -> int:
        return sum(not s.is_closed for s in self._sinks.values())

    def _check_hello(self, hello) -> tuple[str, int]:
        if not isinstance(hello, dict) or hello.get("v") != VERSION:
            raise OutputChannelError("not a hello of this version")
        gateway, conn, secret = hello.get("gateway"), hello.get("conn"), hello.get("secret")
        if not isinstance(secret, str) or not hmac.compare_digest(secret.encode(), self.secret.encode()):
            raise OutputChannelError("a hello without this replica's secret")
        if not isinstance(gateway, str) or not isinstance(conn, int) or isinstance(conn, bool):
            raise OutputChannelError("a hello without a gateway id and connection number")
        if self.sink(gateway) is not None:
            raise OutputChannelError(f"gateway {gateway[:40]!r} is connected already")
        return gateway, conn

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._num_open >= self.max_connections:
            log.warning("output connection refused: %d connections open already", self._num_open)
            writer.close()
            return
        self._num_open += 1
        sink = gateway = None
        try:
            hello = await asyncio.wait_for(read_frame(reader, HELLO_MAX_BYTES), HELLO_TIMEOUT_S)
            gateway, conn = self._check_hello(hello)
            sink = self._sinks[gateway] = OutputSink(conn, writer, self._on_close)
            while True:  # nothing comes this way after the hello: wait for the gateway to go
                try:
                    data = await asyncio.wait_for(reader.read(1), self.idle_timeout_s)
                except asyncio.TimeoutError:
                    if not sink.request_ids and time.monotonic() - sink.last_used_s >= self.idle_timeout_s:
                        log.info("output connection of gateway %s closed: idle for %.0f s", gateway, self.idle_timeout_s)
                        return
                    continue
                if data:
                    raise OutputChannelError("the gateway sent bytes after its hello")
                return  # the gateway closed it
        except Exception as e:  # noqa: BLE001 - a bad or dropped connection ends only itself
            log.info("output connection ended: %r", e)
        finally:
            self._num_open -= 1
            if sink is not None:
                sink.close()
                if self._sinks.get(gateway) is sink:
                    del self._sinks[gateway]
            writer.close()

    def close(self) -> None:
        for s in list(self._sinks.values()):
            s.close()
        if self._server is not None:
            self._server.close()
