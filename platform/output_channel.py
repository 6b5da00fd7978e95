"""Token outputs from engine replicas to gateways: one TCP stream per (engine replica, gateway)
pair carrying every sequence's new outputs of an engine step as one frame, instead of one Ray
Serve streaming item per token per request (each item a Ray message, a wake-up and a GIL
hand-off on both sides: at concurrency 8 that cost a third of the engine's step time).

The request itself still goes through Ray Serve: the gateway calls the engine replica's
`generate` through the deployment handle (the pool's request router picks the replica; Serve
counts the request as ongoing, queues and rejects it, and cancelling the call aborts it). Only
where the outputs travel changes:

- The call names the gateway (`reply_to`: `OutputChannels.gateway_id`). A replica with no
  connection from that gateway yields the outputs on the call itself (as before), after a
  `ChannelOffer` with its listener's address; the gateway connects in the background.
- Once the gateway is connected, the replica's `OutputSink` for it takes the request's outputs:
  everything sent during one event-loop turn (an engine step's outputs) leaves as one frame,
  `[version, [[request_id, output], ...]]` (msgpack, `encode_output`). The call then yields one
  item, `ChannelDone(conn_id, num_outputs)`, when the request ends. A request never switches
  paths midway, so its outputs stay in order.
- The gateway demultiplexes frames into each request's queue (`Pending`). A request ends at its
  finished output; `ChannelDone` tells how many outputs to expect, so a connection that breaks
  before they arrived fails exactly the requests still waiting on it.
- Failures: a replica that dies fails its calls (Ray Serve's error, per request) and its
  connections. A connection that closes on the replica side (gateway gone or restarted) aborts
  every request still sending on it (`on_close`), so their KV is freed.

Pure asyncio and msgpack, no Ray: the deployments wire it in (decode/deployment.py,
gateway/deployment.py). Wire format (version 1), each frame a 4-byte big-endian length then
msgpack: gateway -> replica `{"v": 1, "gateway": id, "conn": n}` once; replica -> gateway
`[1, [[request_id, output], ...]]` per flush. The gateway id is a random 128-bit value that only
travels inside Ray calls: it is what lets a connection receive a gateway's outputs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable

import msgpack

from pdserve.engine.engine import RequestOutput
from pdserve.engine.request import TokenLogprob

log = logging.getLogger(__name__)

VERSION = 1
_LEN = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20
RETRY_CONNECT_S = 30.0  # an address the gateway could not reach is tried again after this long
CONNECT_TIMEOUT_S = 10.0  # meanwhile that replica's outputs keep coming on the calls themselves


class OutputChannelError(Exception):
    """The connection that carried a request's outputs broke before they all arrived."""


@dataclass(frozen=True)
class ChannelOffer:
    """First item of a call whose gateway has no connection to this replica yet: where to connect."""
    host: str
    port: int


@dataclass(frozen=True)
class ChannelDone:
    """Last (and only) item of a call whose outputs went over connection `conn_id`: how many."""
    conn_id: int
    num_outputs: int


# -- wire format ------------------------------------------------------------------------------
def _logprob(lp: TokenLogprob) -> list:
    return [lp.token_id, lp.logprob, lp.rank, [list(t) for t in lp.top]]


def _from_logprob(x: list) -> TokenLogprob:
    return TokenLogprob(x[0], x[1], x[2], tuple((t, v) for t, v in x[3]))


def encode_output(out: RequestOutput) -> list:
    """A decode-side output as plain msgpack types (no KV ids or RNG state: those stay in prefill)."""
    assert out.kv_block_ids is None and out.generator_state is None, "prefill-only fields on the output channel"
    prompt = None if out.prompt_logprobs is None else [None if lp is None else _logprob(lp)
                                                       for lp in out.prompt_logprobs]
    return [out.new_token_ids, out.new_text, out.finished, out.finish_reason, out.stop_reason,
            [_logprob(lp) for lp in out.new_logprobs], prompt, out.num_prompt_tokens, out.num_output_tokens,
            out.num_cached_tokens]


def decode_output(request_id: str, x: list) -> RequestOutput:
    prompt = None if x[6] is None else [None if lp is None else _from_logprob(lp) for lp in x[6]]
    return RequestOutput(request_id, x[0], x[1], x[2], x[3], x[4], [_from_logprob(lp) for lp in x[5]], prompt,
                         x[7], x[8], x[9])


def _frame(payload) -> bytes:
    body = msgpack.packb(payload, use_bin_type=True)
    return _LEN.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader):
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_FRAME_BYTES:
        raise OutputChannelError(f"frame of {n} bytes over the {MAX_FRAME_BYTES}-byte limit")
    return msgpack.unpackb(await reader.readexactly(n), raw=False)


# -- engine replica side ----------------------------------------------------------------------
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
            self._writer.write(_frame([VERSION, batch]))

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
            hello = await asyncio.wait_for(_read_frame(reader), 10)
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


# -- gateway side -----------------------------------------------------------------------------
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

    def offer(self, offer: ChannelOffer) -> None:
        """Connect to a replica in the background (once; a failed address waits RETRY_CONNECT_S)."""
        address = (offer.host, offer.port)
        if address in self._by_address or time.monotonic() - self._failed_at.get(address, -1e9) < RETRY_CONNECT_S:
            return
        conn = _Connection(next(self._conn_ids), address)
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
            writer.write(_frame({"v": VERSION, "gateway": self.gateway_id, "conn": conn.conn_id}))
            while True:
                version, batch = await _read_frame(reader)
                if version != VERSION:
                    raise OutputChannelError(f"output frame version {version}, expected {VERSION}")
                for request_id, out in batch:
                    p = self._requests.get(request_id)
                    if p is None:
                        continue  # the request was dropped (client gone)
                    if p.conn is None:
                        p.conn = conn
                        conn.pending.add(p)
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
