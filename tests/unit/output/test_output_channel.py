"""The output connection between an engine replica and a gateway, both ends in one event loop
(no Ray): outputs round-trip exactly, each request's arrive in order and end once, everything
sent in one loop turn leaves as one frame, and a connection that closes on either side fails or
aborts exactly the requests it carried."""

import asyncio
import socket

import pytest

from pdserve.engine.outputs import RequestOutput, TokenLogprob
from pdserve.output.frames import ChannelDone, ChannelOffer, OutputChannelError, decode_output, encode_output
from pdserve.output.receiver import END, OutputChannels
from pdserve.output.sender import OutputChannelServer
from tests.harness.waiting import until


def out(rid: str, i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [i], f"t{i} ", finished, "length" if finished else None, None,
                         num_prompt_tokens=3, num_output_tokens=i + 1)


def test_outputs_round_trip_exactly():
    lp = TokenLogprob(7, -0.25, 2, ((7, -0.25), (9, -1.5)))
    full = RequestOutput("r", [7, 8], "ab\u00e9", True, "stop", "</s>", [lp, lp], [None, lp], 5, 2, 4)
    assert decode_output("r", encode_output(full)) == full
    assert decode_output("r", encode_output(out("r", 3))) == out("r", 3)


async def _connected(on_close=lambda ids: None):
    """A replica's server and a gateway's channels, connected."""
    server = OutputChannelServer("127.0.0.1", on_close)
    channels = OutputChannels()
    channels.offer(await server.offer())
    await until(lambda: server.sink(channels.gateway_id) is not None, what="the gateway's connection")
    return server, channels


async def _drain(p) -> list:
    items = []
    while True:
        item = await p.queue.get()
        items.append(item)
        if item is END or isinstance(item, BaseException) or item.finished:
            return items


def test_many_requests_arrive_in_order_one_frame_per_turn():
    async def main():
        server, channels = await _connected()
        sink = server.sink(channels.gateway_id)
        frames = []
        write = sink._writer.write
        sink._writer.write = lambda data: (frames.append(data), write(data))
        rids = [f"req-{i}" for i in range(40)]
        pending = {r: channels.register(r) for r in rids}
        steps = 12
        for step in range(steps):  # one "engine step": every request's output in one loop turn
            for r in rids:
                sink.send(r, out(r, step, finished=step == steps - 1))
            await asyncio.sleep(0)
        for r in rids:
            channels.done(pending[r], ChannelDone(sink.conn_id, steps))
        got = await asyncio.gather(*(_drain(pending[r]) for r in rids))
        for r, items in zip(rids, got):
            assert [o.new_token_ids[0] for o in items] == list(range(steps))
            assert [o.finished for o in items].count(True) == 1 and items[-1].finished
            assert all(o.request_id == r for o in items)
        assert len(frames) == steps
        channels.close()
        server.close()

    asyncio.run(main())


def test_outputs_complete_without_a_finished_one_end_at_the_count():
    async def main():
        server, channels = await _connected()
        sink = server.sink(channels.gateway_id)
        p = channels.register("r")
        channels.done(p, ChannelDone(sink.conn_id, 2))  # the count may come before the outputs
        sink.send("r", out("r", 0))
        sink.send("r", out("r", 1))
        items = await _drain(p)
        assert [type(i) for i in items[:2]] == [RequestOutput, RequestOutput] and items[2] is END
        channels.close()
        server.close()

    asyncio.run(main())


def test_a_gateway_that_goes_aborts_its_requests_on_the_replica():
    aborted = []

    async def main():
        server, channels = await _connected(aborted.extend)
        sink = server.sink(channels.gateway_id)
        sink.request_ids.update({"a", "b"})
        channels.close()
        await until(lambda: sink.is_closed, what="the replica's side closing")
        with pytest.raises(OutputChannelError):
            sink.send("a", out("a", 0))
        assert server.sink(channels.gateway_id) is None and server.num_connections == 0
        server.close()

    asyncio.run(main())
    assert sorted(aborted) == ["a", "b"]


def test_a_replica_that_goes_fails_only_the_requests_waiting_on_it():
    async def main():
        server, channels = await _connected()
        other, _ = await _connected()  # another replica, same kind of gateway: unaffected
        sink = server.sink(channels.gateway_id)
        waiting, done, elsewhere = channels.register("w"), channels.register("d"), channels.register("e")
        sink.send("w", out("w", 0))
        sink.send("d", out("d", 0, finished=True))
        await until(lambda: waiting.num_delivered == done.num_delivered == 1, what="both outputs arriving")
        channels.done(waiting, ChannelDone(sink.conn_id, 5))  # four more were sent but never arrive
        server.close()
        items = await _drain(waiting)
        assert isinstance(items[-1], OutputChannelError)
        assert (await _drain(done))[-1].finished
        assert elsewhere.queue.empty()
        # A count naming a connection that is gone, with outputs missing, fails at once.
        late = channels.register("late")
        channels.done(late, ChannelDone(sink.conn_id, 1))
        assert isinstance(await late.queue.get(), OutputChannelError)
        channels.close()
        other.close()

    asyncio.run(main())


def test_an_unreachable_replica_is_not_retried_at_once():

    async def main():
        channels = OutputChannels()
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        channels.offer(ChannelOffer("127.0.0.1", port, "s"))
        assert channels.num_connections == 1  # connecting
        await until(lambda: not channels.num_connections, what="the refused connection given up")
        channels.offer(ChannelOffer("127.0.0.1", port, "s"))  # refused a moment ago: requests stay on their calls
        assert channels.num_connections == 0

    asyncio.run(main())
