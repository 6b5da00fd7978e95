"""The gateway's side of the output connections (see `pdserve.output`): `OutputChannels` connects
to the replicas that offer a connection and demultiplexes their frames into each waiting
request's `Pending` queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

from pdserve.engine.outputs import RequestOutput
from pdserve.errors import InvalidRequestError
from pdserve.output.frames import (VERSION, ChannelDone, ChannelOffer, OutputChannelError, decode_output, frame,
                                   read_frame)

log = logging.getLogger(__name__)


class OutputTooLargeError(InvalidRequestError):
    """The replica could not send one of the request's outputs: larger than a frame (what makes
    one that large is a long echoed prompt with many logprobs)."""

    def __init__(self, message: str, param: str | None = "logprobs"):
        super().__init__(message, param)

RETRY_CONNECT_S = 30.0  # an address the gateway could not reach is tried again after this long
CONNECT_TIMEOUT_S = 10.0  # meanwhile that replica's outputs keep coming on the calls themselves


END = object()  # queued when a request's outputs are complete without a finished one


@dataclass(eq=False)
class Pending:
    """One request's outputs on their way to its consumer (`queue`: outputs, exceptions, END)."""
    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_delivered: int = 0
    num_expected: int | None = None
    conn: "_Connection | None" = None

    def deliver(self, out: RequestOutput) -> None:
        self.num_delivered += 1
        self.queue.put_nowait(out)
        self._check()

    def expect(self, num_outputs: int) -> None:
        self.num_expected = num_outputs
        self._check()

    def fail(self, error: BaseException) -> None:
        self.queue.put_nowait(error)

    def _check(self) -> None:
        if self.num_expected is not None and self.num_delivered >= self.num_expected:
            self.queue.put_nowait(END)


@dataclass(eq=False)
class _Connection:
    conn_id: int
    address: tuple[str, int]
    secret: str
    pending: set = field(default_factory=set)
    is_open: bool = True
    task: asyncio.Task | None = None


class OutputChannels:
    """A gateway's end: connections to the replicas that offered one, and the requests waiting
    for outputs. All methods run on the gateway's event loop."""

    def __init__(self):
        self.gateway_id = uuid.uuid4().hex
        self._requests: dict[str, Pending] = {}
        self._by_id: dict[int, _Connection] = {}
        self._by_address: dict[tuple[str, int], _Connection] = {}
        self._failed_at: dict[tuple[str, int], float] = {}
        self._conn_ids = itertools.count(1)

    def register(self, request_id: str) -> Pending:
        p = Pending(request_id)
        self._requests[request_id] = p
        return p

    def unregister(self, p: Pending) -> None:
        if self._requests.get(p.request_id) is p:
            del self._requests[p.request_id]
        if p.conn is not None:
            p.conn.pending.discard(p)

    @property
    def num_connections(self) -> int:
        return len(self._by_id)

    @property
    def num_pending(self) -> int:
        return len(self._requests)

    def offer(self, offer: ChannelOffer) -> None:
        """Connect to a replica in the background (once; a failed address waits RETRY_CONNECT_S)."""
        address = (offer.host, offer.port)
        if address in self._by_address or time.monotonic() - self._failed_at.get(address, -1e9) < RETRY_CONNECT_S:
            return
        conn = _Connection(next(self._conn_ids), address, offer.secret)
        self._by_address[address] = self._by_id[conn.conn_id] = conn
        conn.task = asyncio.ensure_future(self._run(conn))

    def done(self, p: Pending, msg: ChannelDone) -> None:
        """The replica sent `msg.num_outputs` outputs for `p` on connection `msg.conn_id`."""
        if self._requests.get(p.request_id) is not p:
            return  # the consumer has left already
        conn = self._by_id.get(msg.conn_id)
        if conn is None and p.num_delivered < msg.num_outputs:
            p.fail(OutputChannelError("the connection carrying this request's outputs closed"))
            return
        if conn is not None and p.conn is None:
            p.conn = conn
            conn.pending.add(p)
        p.expect(msg.num_outputs)

    async def _run(self, conn: _Connection) -> None:
        writer = None
        error: BaseException = OutputChannelError(f"the output connection to {conn.address} closed")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*conn.address), CONNECT_TIMEOUT_S)
            writer.write(frame({"v": VERSION, "gateway": self.gateway_id, "conn": conn.conn_id, "secret": conn.secret}))
            while True:
                version, batch = await read_frame(reader)
                if version != VERSION:
                    raise OutputChannelError(f"output frame version {version}, expected {VERSION}")
                for request_id, out in batch:
                    p = self._requests.get(request_id)
                    if p is None:
                        continue  # the request was dropped (client gone)
                    if p.conn is None:
                        p.conn = conn
                        conn.pending.add(p)
                    if isinstance(out, dict):  # this request's output could not travel: it alone fails
                        p.fail(OutputTooLargeError(str(out.get("error"))[:300]))
                    else:
                        p.deliver(decode_output(request_id, out))
        except asyncio.IncompleteReadError:
            pass
        except (OSError, OutputChannelError, ValueError, asyncio.TimeoutError) as e:
            log.warning("output connection to %s failed: %r", conn.address, e)
            error = OutputChannelError(f"the output connection to {conn.address} failed: {e!r}")
            self._failed_at[conn.address] = time.monotonic()
        finally:
            conn.is_open = False
            self._by_id.pop(conn.conn_id, None)
            if self._by_address.get(conn.address) is conn:
                del self._by_address[conn.address]
            for p in list(conn.pending):
                p.fail(error)
            if writer is not None:
                writer.close()

    def close(self) -> None:
        for conn in list(self._by_id.values()):
            if conn.task is not None:
                conn.task.cancel()
