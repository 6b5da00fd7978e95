"""A request's `deadline_s`: past it the engine aborts the request at its next step, queued or
running, its stream raises `DeadlineExceededError`, its blocks are freed and the others go on."""

import asyncio
import time

import pytest

from pdserve.config import EngineConfig
from pdserve.engine import engine as engine_module
from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import DeadlineExceededError
from tests.fakes.clock import Clock

NUM_BLOCKS = 64
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(engine_module, "time", clock)
    return clock


@pytest.fixture
def async_engine(tiny_llama):
    # One sequence at a time: a second request waits in the queue while the first runs.
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=NUM_BLOCKS, max_num_seqs=1,
                                                   max_num_batched_tokens=64)))
    yield engine
    engine.shutdown()


async def _drain(stream) -> list:
    return [o async for o in stream]


def test_deadline_passing_while_running_aborts_it(async_engine, clock):
    async def main():
        stream = await async_engine.generate("r", list(range(10, 40)), LONG, deadline_s=clock.time() + 60)
        first = await stream.__anext__()  # it runs
        clock.offset_s += 120
        with pytest.raises(DeadlineExceededError, match="running"):
            await _drain(stream)
        return first

    assert not asyncio.run(main()).finished
    asyncio.run(async_engine.call(lambda: None))
    assert async_engine.engine.num_free_kv_blocks == NUM_BLOCKS and async_engine.is_healthy


def test_deadline_passing_while_queued_aborts_it_and_spares_the_running_one(async_engine, clock):
    async def main():
        running = await async_engine.generate("first", list(range(10, 40)), LONG)
        await running.__anext__()  # it holds the only sequence slot for 400 tokens
        queued = await async_engine.generate("queued", list(range(50, 70)), GREEDY, deadline_s=clock.time() + 60)
        clock.offset_s += 120
        with pytest.raises(DeadlineExceededError, match="waiting"):
            await _drain(queued)
        assert async_engine.engine.scheduler.requests.keys() == {"first"}
        outs = await _drain(running)  # the request without a deadline runs to its end
        return outs

    assert asyncio.run(main())[-1].finish_reason == "length"
    asyncio.run(async_engine.call(lambda: None))
    assert async_engine.engine.num_free_kv_blocks == NUM_BLOCKS


def test_a_deadline_already_past_is_refused_at_once(async_engine):
    async def main():
        with pytest.raises(DeadlineExceededError):
            await async_engine.generate("late", [5, 6, 7], GREEDY, deadline_s=time.time() - 1)

    asyncio.run(main())
    assert not async_engine.engine.has_unfinished_requests()


def test_a_far_deadline_changes_nothing(async_engine):
    async def main():
        return (await _drain(await async_engine.generate("a", [5, 6, 7], GREEDY, deadline_s=time.time() + 3600)),
                await _drain(await async_engine.generate("b", [5, 6, 7], GREEDY)))

    with_deadline, without = asyncio.run(main())
    assert [t for o in with_deadline for t in o.new_token_ids] == [t for o in without for t in o.new_token_ids]
    assert async_engine.engine._deadlines == {}  # forgotten once finished
