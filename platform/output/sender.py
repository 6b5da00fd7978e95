"""The engine replica's side of the output connections (see `pdserve.output`): a listener
(`OutputChannelServer`) and one `OutputSink` per connected gateway, which batches what is sent
during one event-loop turn into one frame.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable

from pdserve.engine.outputs import RequestOutput
from pdserve.output.frames import VERSION, ChannelOffer, OutputChannelError, encode_output, frame, read_frame

log = logging.getLogger(__name__)


class OutputSink:
    """One gateway's connection on a replica. `send` queues an output; what is queued during one
    event-loop turn leaves as one frame. Once closed, `send` raises and `on_close` is told the
    requests still attached (to abort them)."""

    def __init__(self, conn_id: int, writer: asyncio.StreamWriter,
                 on_close: Callable[[Iterable[str]], None]):
        self.conn_id, self._writer, self._on_close = conn_id, writer, on_close
        self._pending: list = []
        self.request_ids: set[str] = set()
        self.is_closed = False

    def send(self, request_id: str, out: RequestOutput) -> None:
        if self.is_closed:
            raise OutputChannelError("the gateway's output connection closed")
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append([request_id, encode_output(out)])

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if batch and not self.is_closed:
            self._writer.write(frame([VERSION, batch]))

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

    def __init__(self, host: str, on_close: Callable[[Iterable[str]], None], bind_host: str | None = None):
        self.host, self.bind_host, self._on_close = host, bind_host or host, on_close
        self._sinks: dict[str, OutputSink] = {}
        self._server: asyncio.AbstractServer | None = None
        self._starting: asyncio.Future | None = None
        self.port: int | None = None

    async def offer(self) -> ChannelOffer:
        """Start listening (first call) and say where."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)
        return ChannelOffer(self.host, self.port)

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.bind_host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def sink(self, gateway_id: str | None) -> OutputSink | None:
        s = self._sinks.get(gateway_id) if gateway_id is not None else None
        return s if s is not None and not s.is_closed else None

    @property
    def num_connections(self) -> int:
        return sum(not s.is_closed for s in self._sinks.values())

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sink = None
        try:
            hello = await asyncio.wait_for(read_frame(reader), 10)
            if not isinstance(hello, dict) or hello.get("v") != VERSION or not isinstance(hello.get("gateway"), str):
                raise OutputChannelError(f"unexpected hello {hello!r:.200}")
            gateway = hello["gateway"]
            sink = OutputSink(int(hello["conn"]), writer, self._on_close)
            old = self._sinks.get(gateway)
            self._sinks[gateway] = sink
            if old is not None:
                old.close()
            await reader.read()  # nothing more comes this way: wait for the gateway to go
        except Exception as e:  # noqa: BLE001 - a bad or dropped connection ends only itself
            log.info("output connection ended: %r", e)
        finally:
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
