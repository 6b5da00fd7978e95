"""Hostile peers against a replica's output listener, on loopback: whatever they send, the
listener reads no more than it allows, unpacks nothing it has not bounded, keeps the honest
gateway's connection and requests, and holds no connection it should have closed."""

import asyncio
import struct

import msgpack
import pytest

from pdserve.engine.outputs import RequestOutput, TokenLogprob
from pdserve.output.frames import HELLO_MAX_BYTES, VERSION, OutputChannelError, frame
from pdserve.output.receiver import OutputChannels, OutputTooLargeError
from pdserve.output.sender import OutputChannelServer, OutputSink
from tests.harness.waiting import until


def _out(rid: str, i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [i], f"t{i}", finished, "length" if finished else None)


async def _listening(**options) -> tuple[OutputChannelServer, list]:
    aborted = []
    server = OutputChannelServer("127.0.0.1", aborted.extend, **options)
    await server.offer()
    return server, aborted


async def _open(server):
    return await asyncio.open_connection("127.0.0.1", server.port)


async def _closed_by_server(reader, timeout_s: float = 5.0) -> bool:
    """Whether the server closes the connection (EOF) within `timeout_s`."""
    try:
        return await asyncio.wait_for(reader.read(), timeout_s) == b""
    except (ConnectionResetError, asyncio.TimeoutError):
        return False


def _hello(server, gateway="g" * 32, conn=1, **fields) -> dict:
    return {"v": VERSION, "gateway": gateway, "conn": conn, "secret": server.secret, **fields}


def test_an_oversized_hello_is_refused_before_it_is_read():
    async def main():
        server, _ = await _listening()
        reader, writer = await _open(server)
        writer.write(struct.pack(">I", 16 << 20))  # says 16 MiB are coming
        writer.write(b"\x91" * 65536)  # one-byte arrays: a bomb if unpacked
        assert await _closed_by_server(reader)
        assert server._num_open == 0 and server.num_connections == 0
        reader, writer = await _open(server)  # exactly the limit is read, then judged
        writer.write(struct.pack(">I", HELLO_MAX_BYTES) + b"\x91" * HELLO_MAX_BYTES)
        assert await _closed_by_server(reader)
        server.close()

    asyncio.run(main())


@pytest.mark.parametrize("bad", [
    {"secret": "0" * 32}, {"secret": None}, {"v": 1}, {"gateway": 7}, {"conn": "1"}, {"conn": True},
])
def test_a_hello_without_the_secret_or_shape_is_refused(bad):
    async def main():
        server, _ = await _listening()
        reader, writer = await _open(server)
        writer.write(frame({**_hello(server), **bad}))
        assert await _closed_by_server(reader)
        assert server.num_connections == 0
        server.close()

    asyncio.run(main())


def test_a_malformed_or_non_map_hello_is_refused():
    async def main():
        server, _ = await _listening()
        for payload in (b"\xc1", msgpack.packb([1, 2, 3]), b"\xdf\xff\xff\xff\xff"):
            reader, writer = await _open(server)
            writer.write(struct.pack(">I", len(payload)) + payload)
            assert await _closed_by_server(reader)
        assert server.num_connections == 0 and server._num_open == 0
        server.close()

    asyncio.run(main())


def test_a_byte_after_the_hello_closes_the_connection_and_aborts_its_requests():
    async def main():
        server, aborted = await _listening()
        reader, writer = await _open(server)
        writer.write(frame(_hello(server)))
        await until(lambda: server.sink("g" * 32) is not None)
        server.sink("g" * 32).request_ids.add("r1")
        writer.write(b"x")
        assert await _closed_by_server(reader)
        assert aborted == ["r1"] and server.num_connections == 0
        server.close()

    asyncio.run(main())


def test_a_duplicate_gateway_id_is_refused_and_the_first_connection_kept():
    async def main():
        server, aborted = await _listening()
        channels = OutputChannels()
        channels.offer(await server.offer())
        await until(lambda: server.sink(channels.gateway_id) is not None)
        honest = server.sink(channels.gateway_id)
        p = channels.register("r1")
        honest.request_ids.add("r1")
        reader, writer = await _open(server)  # an impostor who knows the gateway id and the secret
        writer.write(frame(_hello(server, gateway=channels.gateway_id, conn=99)))
        assert await _closed_by_server(reader)
        assert server.sink(channels.gateway_id) is honest and not aborted
        honest.send("r1", _out("r1", 0, finished=True))
        assert (await asyncio.wait_for(p.queue.get(), 5)).new_token_ids == [0]
        channels.close()
        server.close()

    asyncio.run(main())


def test_the_connection_cap_refuses_the_next_connection_and_a_silent_one_times_out(monkeypatch):
    from pdserve.output import sender

    monkeypatch.setattr(sender, "HELLO_TIMEOUT_S", 0.3)

    async def main():
        server, _ = await _listening(max_connections=3)
        silent = [await _open(server) for _ in range(3)]  # slow senders: no hello at all
        await until(lambda: server._num_open == 3)
        reader, _ = await _open(server)
        assert await _closed_by_server(reader, 2)  # the fourth: refused at once
        for r, _ in silent:  # each closed once its hello is late
            assert await _closed_by_server(r)
        await until(lambda: server._num_open == 0)
        server.close()

    asyncio.run(main())


def test_an_idle_connection_is_closed_and_a_busy_one_kept():
    async def main():
        server, _ = await _listening(idle_timeout_s=0.3)
        busy, idle = OutputChannels(), OutputChannels()
        for channels in (busy, idle):
            channels.offer(await server.offer())
        await until(lambda: server.num_connections == 2)
        server.sink(busy.gateway_id).request_ids.add("r1")  # a request still streaming
        await until(lambda: server.sink(idle.gateway_id) is None, 3)
        await asyncio.sleep(0.5)
        assert server.sink(busy.gateway_id) is not None
        for channels in (busy, idle):
            channels.close()
        server.close()

    asyncio.run(main())


def test_flushes_split_at_the_frame_budget_and_an_output_too_large_fails_alone():
    async def main():
        server, aborted = await _listening()
        channels = OutputChannels()
        channels.offer(await server.offer())
        await until(lambda: server.sink(channels.gateway_id) is not None)
        sink: OutputSink = server.sink(channels.gateway_id)
        sink.max_frame_bytes = 4096
        frames = []
        write = sink._writer.write
        sink._writer.write = lambda data: (frames.append(len(data)), write(data))
        rids = [f"r{i}" for i in range(50)]
        pending = {r: channels.register(r) for r in rids}
        big = channels.register("big")
        lp = TokenLogprob(1, -0.5, 1, tuple((t, -1.0) for t in range(20)))
        for r in rids:  # one turn: 50 outputs, more than one frame's worth
            sink.send(r, RequestOutput(r, [1], "x" * 60, True, "length", new_logprobs=[lp]))
        sink.send("big", RequestOutput("big", [1], "y", True, "length", new_logprobs=[lp] * 40))
        for r in rids:
            assert (await asyncio.wait_for(pending[r].queue.get(), 5)).finished
        assert isinstance(await asyncio.wait_for(big.queue.get(), 5), OutputTooLargeError)
        assert len(frames) > 1 and max(frames) <= 4096 and aborted == ["big"]
        channels.close()
        server.close()

    asyncio.run(main())


def test_the_gateway_refuses_frames_over_its_limit():
    async def main():
        async def replica(reader, writer):  # a listener that answers the hello with a bomb's header
            writer.write(struct.pack(">I", (64 << 20) + 1))
            await writer.drain()
            await asyncio.sleep(1)
            writer.close()

        srv = await asyncio.start_server(replica, "127.0.0.1", 0)
        from pdserve.output.frames import ChannelOffer

        channels = OutputChannels()
        channels.offer(ChannelOffer("127.0.0.1", srv.sockets[0].getsockname()[1], "s"))
        p = channels.register("r1")
        conn = next(iter(channels._by_id.values()))
        conn.pending.add(p)
        p.conn = conn
        error = await asyncio.wait_for(p.queue.get(), 5)
        assert isinstance(error, OutputChannelError) and "limit" in str(error)
        srv.close()

    asyncio.run(main())
