"""Request-level failures in the prefill and decode roles (one process, local KV backend, no Ray):
a request that fails, or whose deadline passes, in any phase ends with its `RequestError`, is
never retried as a local prefill, and leaves no KV blocks or leases held on either side; a
replica-level failure of the prefill call still falls back to a local prefill."""

import asyncio
import time

import pytest

from pdserve.decode import server as decode_module
from pdserve.engine import engine as engine_module
from pdserve.engine import sampler
from pdserve.engine.async_engine import EngineDeadError
from pdserve.engine.llm import LLM
from pdserve.engine.request import RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import IncrementalDetokenizer
from pdserve.errors import (DeadlineExceededError, InvalidRequestError, OverloadedError, RequestError,
                            RequestFailedError)
from pdserve.kvtransfer.protocol import ExporterUnreachableError
from pdserve.protocol import GenerateRequest
from tests.fakes.clock import Clock
from tests.harness.fixed_costs import prefill_here

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
LONG_PROMPT = list(range(5, 45))  # 40 tokens: prefilled remotely (the default target is met there)
SHORT_PROMPT = [5, 6, 7, 8]  # prefilled on the decode replica where a test has it so (prefill_here)


@pytest.fixture
def clock(monkeypatch):
    """One moved-by-hand wall clock for both engines and the decode server."""
    clock = Clock()
    monkeypatch.setattr(engine_module, "time", clock)
    monkeypatch.setattr(decode_module, "time", clock)
    return clock


async def _collect(decode, req):
    return [o async for o in decode.generate(req)]


def _outcome(decode, req):
    """The request's tokens, or the `RequestError` it ended with."""
    try:
        return [t for o in asyncio.run(_collect(decode, req)) for t in o.new_token_ids]
    except RequestError as e:
        return e


def _assert_nothing_held(prefill, decode):
    for server in (decode, prefill):  # engine calls run in order: aborts and releases have run
        asyncio.run(server.engine.call(lambda: None))
    assert decode.stats()["num_free_kv_blocks"] == 96 and prefill.stats()["num_free_kv_blocks"] == 96
    assert prefill.stats()["num_kv_leases"] == 0 and prefill.stats()["num_open_kv_reads"] == 0
    assert decode.stats()["num_open_kv_pulls"] == 0 and decode.stats()["num_in_flight_requests"] == 0
    assert decode.engine.is_healthy and prefill.engine.is_healthy


def _expire_when(server, clock, request_id, status):
    """Move the clock past every deadline right before the first step that finds `request_id` in
    its engine's scheduler with `status` (waiting: queued; running: mid-prefill or decoding)."""
    engine = server.engine.engine
    real_step = engine.step

    def step():
        req = engine.scheduler.requests.get(request_id)
        if req is not None and req.status is status and clock.offset_s == 0:
            clock.offset_s = 3600
        return real_step()

    engine.step = step


def test_a_request_failing_on_the_prefill_replica_is_not_retried_locally(pools, monkeypatch, tiny_llama):
    prefill, decode = pools
    real = sampler.apply_penalties

    def apply_penalties(row, r):
        if r.request_id == "bad":
            raise RuntimeError("injected")
        real(row, r)

    monkeypatch.setattr(sampler, "apply_penalties", apply_penalties)
    bad = SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.2, ignore_eos=True)
    expected = LLM(tiny_llama, block_size=8).generate([LONG_PROMPT], GREEDY)[0].token_ids

    async def main():
        return await asyncio.gather(_collect(decode, GenerateRequest("bad", LONG_PROMPT, bad)),
                                    _collect(decode, GenerateRequest("ok", LONG_PROMPT, GREEDY)),
                                    return_exceptions=True)

    failed, ok = asyncio.run(main())
    assert isinstance(failed, RequestFailedError)
    assert [t for o in ok for t in o.new_token_ids] == expected
    assert decode.stats()["num_local_prefills"] == 0 and decode.stats()["num_remote_prefills"] == 1
    _assert_nothing_held(prefill, decode)


def test_a_request_failing_as_the_decode_replica_takes_it_over(pools, monkeypatch):
    """Its first token (from the prefill replica) fails on the decode replica: the request ends
    with `RequestFailedError`, the lease is released and nothing is recomputed."""
    prefill, decode = pools
    real = IncrementalDetokenizer.add

    def add(self, token_id):
        if self.tokenizer is decode.engine.engine.tokenizer:
            raise RuntimeError("injected")
        return real(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add", add)
    error = _outcome(decode, GenerateRequest("r", LONG_PROMPT, GREEDY))
    assert isinstance(error, RequestFailedError) and "injected" not in str(error)
    assert decode.stats()["num_remote_prefills"] == 1  # the prefill replica answered
    assert decode.stats()["num_local_prefills"] == 0 and decode.stats()["num_pulled_blocks"] == 0
    _assert_nothing_held(prefill, decode)


@pytest.mark.parametrize("error", [InvalidRequestError("bad", param="top_k"), RequestFailedError(),
                                   DeadlineExceededError()], ids=lambda e: type(e).__name__)
def test_request_errors_of_the_prefill_call_are_raised_not_retried(pools, error):
    prefill, decode = pools

    async def failing(req):
        raise error

    decode.remote_prefill = failing
    assert _outcome(decode, GenerateRequest("r", LONG_PROMPT, GREEDY)) is error
    assert decode.stats()["num_local_prefills"] == 0
    _assert_nothing_held(prefill, decode)


@pytest.mark.parametrize("error", [EngineDeadError("the engine loop died"), OverloadedError("queue full"),
                                   ExporterUnreachableError("gone")], ids=lambda e: type(e).__name__)
def test_replica_errors_of_the_prefill_call_fall_back_to_a_local_prefill(pools, tiny_llama, error):
    prefill, decode = pools

    async def failing(req):
        raise error

    decode.remote_prefill = failing
    expected = LLM(tiny_llama, block_size=8).generate([LONG_PROMPT], GREEDY)[0].token_ids
    assert _outcome(decode, GenerateRequest("r", LONG_PROMPT, GREEDY)) == expected
    assert decode.stats()["num_local_prefills"] == 1
    _assert_nothing_held(prefill, decode)


def test_deadline_passing_during_a_slow_remote_prefill(pools):
    """The prefill call waits only until the deadline; then it is cancelled (stopping the prefill)
    and the request ends, without a local prefill."""
    prefill, decode = pools
    cancelled = asyncio.Event()

    async def stuck(req):
        try:
            await asyncio.Event().wait()  # a prefill replica that never answers
        except asyncio.CancelledError:
            cancelled.set()
            raise

    decode.remote_prefill = stuck

    async def main():
        with pytest.raises(DeadlineExceededError, match="remote prefill"):
            await _collect(decode, GenerateRequest("r", LONG_PROMPT, GREEDY, deadline_s=time.time() + 0.2))
        return cancelled.is_set()

    assert asyncio.run(main())
    assert decode.stats()["num_local_prefills"] == 0 and decode.remote_queued_tokens == 0
    _assert_nothing_held(prefill, decode)


@pytest.mark.parametrize("status", [RequestStatus.WAITING, RequestStatus.RUNNING])
def test_deadline_passing_on_the_prefill_replica(pools, clock, status):
    """Queued, or between two chunks of its prompt (16 tokens a step): the prefill call raises
    and the decode replica does not prefill it instead."""
    prefill, decode = pools
    prefill.engine.engine.scheduler.max_num_batched_tokens = 16
    _expire_when(prefill, clock, "r", status)
    error = _outcome(decode, GenerateRequest("r", LONG_PROMPT, GREEDY, deadline_s=clock.time() + 60))
    assert isinstance(error, DeadlineExceededError) and status.value in str(error)
    assert decode.stats()["num_local_prefills"] == 0
    _assert_nothing_held(prefill, decode)


@pytest.mark.parametrize("prompt, status", [
    (SHORT_PROMPT, RequestStatus.WAITING), (SHORT_PROMPT, RequestStatus.RUNNING), (LONG_PROMPT, RequestStatus.RUNNING),
], ids=["queued", "local", "remote"])
def test_deadline_passing_on_the_decode_replica(pools, clock, prompt, status):
    """Queued for a local prefill, decoding after one, or decoding after a remote prefill and pull."""
    prefill, decode = pools
    if prompt is SHORT_PROMPT:
        prefill_here(decode)
    _expire_when(decode, clock, "r", status)
    error = _outcome(decode, GenerateRequest("r", prompt, GREEDY, deadline_s=clock.time() + 60))
    assert isinstance(error, DeadlineExceededError) and status.value in str(error)
    _assert_nothing_held(prefill, decode)


def test_deadline_passing_during_the_pull_ends_the_request_instead_of_recomputing(pools, clock):
    """The pull is given no more than the time left, and a pull cut short by the deadline ends
    the request: nothing is recomputed, the lease and the decode blocks are freed."""
    prefill, decode = pools
    timeouts = []

    def pull(handle, dst, timeout_s, *args):
        timeouts.append(timeout_s)
        clock.offset_s = 3600
        raise ExporterUnreachableError("no answer before the timeout")

    decode.importer.pull = pull
    req = GenerateRequest("r", LONG_PROMPT, GREEDY, deadline_s=clock.time() + 3)
    error = _outcome(decode, req)
    assert isinstance(error, DeadlineExceededError) and "pull" in str(error)
    assert 0 < timeouts[0] <= 3 and decode.stats()["num_failed_pulls"] == 0
    _assert_nothing_held(prefill, decode)


def test_deadline_passed_when_the_prefill_returns_frees_its_lease(pools, clock):
    prefill, decode = pools
    real = decode.remote_prefill

    async def late(req):
        result = await real(req)
        clock.offset_s = 3600  # the answer came, but too late
        return result

    decode.remote_prefill = late
    assert isinstance(_outcome(decode, GenerateRequest("r", LONG_PROMPT, GREEDY, deadline_s=clock.time() + 60)),
                      DeadlineExceededError)
    assert decode.stats()["num_pulled_blocks"] == 0
    _assert_nothing_held(prefill, decode)
