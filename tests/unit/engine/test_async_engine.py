"""The asyncio front: concurrent streams, cancellation frees blocks, bad input and dead loops."""

import asyncio

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pdserve.engine.engine import LLMEngine
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError
from tests.harness.prefilled import prefill_first
from tests.harness.waiting import until

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)


@pytest.fixture
def async_engine(tiny_llama):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=128)))
    yield engine
    engine.shutdown()


def _prompts(n):
    return [list(range(10 + i, 30 + 3 * i)) for i in range(n)]


def test_concurrent_streams_match_offline_generation(async_engine, tiny_llama):
    prompts = _prompts(20)
    expected = [o.token_ids for o in LLM(tiny_llama).generate(prompts, GREEDY)]

    async def one(i, prompt):
        outs = [o async for o in await async_engine.generate(f"r{i}", prompt, GREEDY)]
        assert sum(o.finished for o in outs) == 1 and outs[-1].finished
        return [t for o in outs for t in o.new_token_ids]

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    assert asyncio.run(main()) == expected
    assert async_engine.engine.block_pool.num_free_blocks == 128


def test_forwarded_streams_keep_every_token_in_order(async_engine, tiny_llama):
    """With `forward`, outputs go to it as steps deliver them, the finished one to the iterator;
    together they are the same tokens in the same order, for concurrent streams."""
    prompts = _prompts(8)
    expected = [o.token_ids for o in LLM(tiny_llama).generate(prompts, GREEDY)]

    async def one(i, prompt):
        got = []  # (path, output) in arrival order
        stream = await async_engine.generate(f"f{i}", prompt, GREEDY, forward=lambda o: got.append(("fwd", o)))
        async for o in stream:
            got.append(("iter", o))
        assert [p for p, _ in got].count("iter") >= 1 and got[-1][0] == "iter" and got[-1][1].finished
        assert all(not o.finished for p, o in got if p == "fwd")
        return [p for p, _ in got], [t for _, o in got for t in o.new_token_ids]

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    assert [tokens for _, tokens in results] == expected
    assert sum(paths.count("fwd") for paths, _ in results) >= 8 * 8  # most tokens went around the queue
    assert async_engine.engine.block_pool.num_free_blocks == 128


def test_a_forward_that_fails_ends_the_stream_with_its_error_and_frees_blocks(async_engine):
    class Closed(Exception):
        pass

    def forward(out):
        raise Closed("connection closed")

    async def main():
        stream = await async_engine.generate("x", list(range(10, 50)), SamplingParams(max_tokens=500, ignore_eos=True),
                                             forward=forward)
        with pytest.raises(Closed):
            async for _ in stream:
                pass
        outs = [o async for o in await async_engine.generate("after", [5, 6, 7], GREEDY)]
        assert outs[-1].finished

    asyncio.run(main())
    assert not async_engine.engine.has_unfinished_requests()
    assert async_engine.engine.block_pool.num_free_blocks == 128


def test_cancelled_consumer_aborts_and_frees_blocks(async_engine):
    long = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)

    async def consume(stream, seen):
        async for out in stream:
            seen.append(out)

    async def main():
        seen = []
        task = asyncio.create_task(consume(await async_engine.generate("c", list(range(10, 50)), long), seen))
        await until(lambda: len(seen) >= 3, what="three outputs of the long request")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The next request runs normally afterwards.
        outs = [o async for o in await async_engine.generate("after", [5, 6, 7], GREEDY)]
        assert outs[-1].finished

    asyncio.run(main())
    assert not async_engine.engine.has_unfinished_requests()
    assert async_engine.engine.block_pool.num_free_blocks == 128


def test_abort_from_outside_ends_the_stream(async_engine):
    async def main():
        stream = await async_engine.generate("a", list(range(10, 50)), SamplingParams(max_tokens=500, ignore_eos=True))
        outs = []
        async for out in stream:
            outs.append(out)
            if len(outs) == 2:
                assert async_engine.abort("a")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert async_engine.engine.block_pool.num_free_blocks == 128


def test_bad_request_raises_before_queueing(async_engine):
    async def main():
        with pytest.raises(InvalidRequestError):
            await async_engine.generate("bad", [], GREEDY)

    asyncio.run(main())
    assert not async_engine.engine.has_unfinished_requests()


def test_dead_loop_fails_open_streams_and_reports_unhealthy(async_engine):
    def broken_step():
        raise RuntimeError("simulated kernel failure")

    async_engine.engine.step = broken_step  # before any request, so the first step fails

    async def main():
        stream = await async_engine.generate("x", [5, 6, 7], GREEDY)
        with pytest.raises(EngineDeadError) as dead:
            async for _ in stream:
                pass
        # The failure is its cause (and in the log), never in a message a client may see.
        assert "simulated" in str(dead.value.__cause__) and "simulated" not in str(dead.value)
        with pytest.raises(EngineDeadError):
            await async_engine.generate("y", [5, 6, 7], GREEDY)
        # Nor does a dead engine take calls: a decode replica would reserve blocks for a pull.
        with pytest.raises(EngineDeadError):
            await async_engine.call(async_engine.engine.add_prefilled_request, "z", [5, 6, 7], GREEDY, None, None)

    asyncio.run(main())
    assert not async_engine.is_healthy
    assert async_engine.engine.block_pool.num_free_blocks == 128


def test_event_loop_calls_do_not_wait_for_a_running_step(async_engine):
    """While a step runs, a request added from the event loop is queued instead of blocking the loop:
    another stream's outputs keep being handled, and the request joins right after that step."""
    import threading

    engine = async_engine.engine
    in_step, release = threading.Event(), threading.Event()
    real_step = engine.step
    steps: list[int] = []

    def step():
        if len(steps) == 1:  # the second step holds until the test lets it go
            in_step.set()
            release.wait()
        steps.append(engine.scheduler.num_unfinished)
        return real_step()

    engine.step = step

    async def main():
        first = await async_engine.generate("a", list(range(10, 30)), GREEDY)
        await first.__anext__()  # step 1 ran; step 2 is about to run and hold
        await asyncio.get_running_loop().run_in_executor(None, in_step.wait)
        opening = asyncio.create_task(async_engine.generate("b", list(range(40, 60)), GREEDY))
        for _ in range(5):  # the event loop keeps running other work meanwhile
            await asyncio.sleep(0)
        assert not opening.done() and len(steps) == 1
        release.set()
        second = await opening
        outs_a = [o async for o in first]
        outs_b = [o async for o in second]
        return outs_a, outs_b

    outs_a, outs_b = asyncio.run(main())
    assert outs_a[-1].finished and outs_b[-1].finished
    # Request b was added between step 2 and step 3, by the loop thread: step 3 is the first with both.
    assert steps[:3] == [1, 1, 2]


def test_a_stream_whose_event_loop_closed_is_dropped_and_the_engine_keeps_serving(async_engine):
    """A caller's event loop may close while its request still runs (the stream neither read to
    the end nor closed): the engine must not die delivering to it; it aborts that request and
    frees its blocks."""
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    loop = asyncio.new_event_loop()
    stream = loop.run_until_complete(async_engine.generate("orphan", list(range(10, 50)), long))
    loop.run_until_complete(stream.__anext__())  # it runs
    loop.close()  # without closing the stream: no abort is queued

    async def after():
        return [o async for o in await async_engine.generate("after", [5, 6, 7], GREEDY)]

    outs = asyncio.run(after())
    assert outs[-1].finished and async_engine.is_healthy
    asyncio.run(async_engine.call(lambda: None))  # queued calls (the drop) have run
    assert "orphan" not in async_engine._streams
    assert async_engine.engine.block_pool.num_free_blocks == 128


def test_a_prefilled_request_waiting_for_a_slot_streams_its_first_token_as_it_joins(tiny_llama, monkeypatch):
    """A decode engine of one sequence slot, running a request: a request prefilled elsewhere
    waits for the slot, and its first token (the prefill's) is handed to its stream as it joins
    the batch, after the running request ended, not before, so its stream runs at the batch's
    pace from token one; its tokens are a colocated run's. One aborted while it waits ends with
    nothing but the abort, its blocks freed."""
    from pdserve.engine import async_engine

    handed = []  # (request id, tokens, finished) in the order the engine hands outputs to streams
    deliver = async_engine._deliver

    def recording(items):
        handed.extend((out.request_id, list(out.new_token_ids), out.finished) for _, _, out in items)  # (merged later)
        deliver(items)

    monkeypatch.setattr(async_engine, "_deliver", recording)
    decode = AsyncLLMEngine(LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=128, max_num_seqs=1)))
    prefill = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=128))
    prompt_a, prompt_b = _prompts(2)
    [expected_b] = [o.token_ids for o in LLM(tiny_llama).generate([prompt_b], GREEDY)]

    def prefilled_elsewhere(rid, prompt):
        return rid, prompt, prefill_first(prefill, rid, prompt, GREEDY)

    async def resumed(rid, prompt, first):  # (quick: a's 300 tokens take far longer)
        num_local, dst = await decode.call(decode.engine.add_prefilled_request, rid, prompt, GREEDY, first)
        decode.engine.kv_cache.kv[:, :, dst] = prefill.kv_cache.kv[:, :, first.kv_block_ids[num_local:]]
        prefill.release_kv(rid)
        first.finished, first.kv_block_ids = False, None  # as the prefill replica sends it on
        return await decode.resume(rid, first=first)

    async def tokens(stream):
        return [t async for out in stream for t in out.new_token_ids]

    b, c = prefilled_elsewhere("b", prompt_b), prefilled_elsewhere("c", prompt_b[:12])
    marks = []

    async def main():
        stream_a = await decode.generate("a", prompt_a, LONG)
        first_a = await anext(stream_a)
        stream_b, stream_c = await resumed(*b), await resumed(*c)
        decode.abort("c")
        marks.append(len(handed))  # what had been handed out when b began to wait
        return first_a.new_token_ids + await tokens(stream_a), *await asyncio.gather(tokens(stream_b),
                                                                                    tokens(stream_c))

    try:
        tokens_a, tokens_b, tokens_c = asyncio.run(main())
        assert len(tokens_a) == LONG.max_tokens and tokens_b == expected_b and tokens_c == []
        a_ended = next(i for i, (rid, _, finished) in enumerate(handed) if rid == "a" and finished)
        b_first = next(i for i, (rid, _, _) in enumerate(handed) if rid == "b")
        assert marks[0] <= a_ended < b_first and handed[b_first][1] == expected_b[:1]
        assert decode.engine.block_pool.num_free_blocks == 128
    finally:
        decode.shutdown()
