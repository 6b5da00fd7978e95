"""One request's failure inside a step is that request's alone: it ends with `RequestFailedError`,
its blocks are freed, and the requests beside it in the same batches finish with exactly the
tokens they give alone, on an engine that stays healthy."""

import asyncio
import logging

import pytest

from pdserve.config import EngineConfig
from pdserve.engine import runner, sampler
from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.engine.engine import LLMEngine
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import IncrementalDetokenizer
from pdserve.errors import RequestFailedError

NUM_BLOCKS = 128
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True)
OTHERS = {f"ok{i}": (list(range(10 + 7 * i, 30 + 9 * i)), SEEDED if i == 1 else GREEDY) for i in range(4)}


class Injected(RuntimeError):
    pass


def _fail_in_penalties(monkeypatch):
    """Its third token's penalties raise (inside the batched sampler: the batch is sampled again
    row by row)."""
    real = sampler.apply_penalties

    def apply_penalties(row, r):
        if r.request_id == "bad" and r.num_output_tokens >= 2:
            raise Injected("penalties blew up at shape [512]")
        real(row, r)

    monkeypatch.setattr(sampler, "apply_penalties", apply_penalties)
    return SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.1, ignore_eos=True)


def _fail_in_detokenizer(monkeypatch):
    """Its third token's detokenizing raises (the engine's post-processing of that request)."""
    real = IncrementalDetokenizer.add

    def add(self, token_id):
        if "BOOM" in self.stop:
            self.num_added = getattr(self, "num_added", 0) + 1
            if self.num_added == 3:
                raise Injected("detokenizer blew up")
        return real(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add", add)
    return SamplingParams(max_tokens=12, temperature=0, stop=("BOOM",), ignore_eos=True)


def _fail_in_prompt_logprobs(monkeypatch):
    """Its prompt logprobs raise (computed in the runner after the forward pass)."""
    real = runner.token_logprob

    def token_logprob(row, token_id, num_top):
        if num_top == 7:
            raise Injected("prompt logprobs blew up")
        return real(row, token_id, num_top)

    monkeypatch.setattr(runner, "token_logprob", token_logprob)
    return SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=7, ignore_eos=True)


@pytest.fixture
def async_engine(tiny_llama):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=NUM_BLOCKS)))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("inject", [_fail_in_penalties, _fail_in_detokenizer, _fail_in_prompt_logprobs])
def test_a_failing_request_ends_alone(async_engine, tiny_llama, monkeypatch, caplog, inject):
    alone = {rid: c.token_ids for rid, c in zip(OTHERS, LLM(tiny_llama).generate(
        [p for p, _ in OTHERS.values()], [s for _, s in OTHERS.values()]))}
    bad_params = inject(monkeypatch)

    async def one(rid, prompt, params):
        tokens = []
        try:
            async for out in await async_engine.generate(rid, prompt, params):
                tokens += out.new_token_ids
        except RequestFailedError as e:
            return e
        return tokens

    async def main():
        requests = {"bad": (list(range(40, 70)), bad_params), **OTHERS}
        return dict(zip(requests, await asyncio.gather(*(one(rid, p, s) for rid, (p, s) in requests.items()))))

    with caplog.at_level(logging.ERROR, logger="pdserve.engine.engine"):
        got = asyncio.run(main())
    error = got.pop("bad")
    assert isinstance(error, RequestFailedError) and isinstance(error.__cause__, Injected)
    assert "blew up" not in str(error)  # the client sees no internal text...
    assert any("bad" in r.getMessage() and r.exc_info for r in caplog.records)  # ...the log has it all
    assert got == alone
    assert async_engine.is_healthy
    asyncio.run(async_engine.call(lambda: None))  # queued calls (the streams' ends) have run
    assert async_engine.engine.num_free_kv_blocks == NUM_BLOCKS and not async_engine.engine.has_unfinished_requests()

    async def after():  # and it serves the next request
        return [o async for o in await async_engine.generate("after", [5, 6, 7], GREEDY)]

    assert asyncio.run(after())[-1].finished


def test_the_offline_engine_reports_a_failed_request(tiny_llama, monkeypatch):
    """`LLMEngine` hands the failure to its reader with `take_failed_requests`; `LLM` raises it."""
    llm = LLM(tiny_llama, num_kv_blocks=NUM_BLOCKS)
    params = _fail_in_detokenizer(monkeypatch)
    engine = llm.engine
    engine.add_request("bad", [5, 6, 7], params)
    engine.add_request("ok", [8, 9, 10], GREEDY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    [(rid, error)] = engine.take_failed_requests()
    assert rid == "bad" and isinstance(error, RequestFailedError) and engine.take_failed_requests() == []
    assert sum(o.new_token_ids != [] for o in outputs if o.request_id == "bad") == 2
    assert [o for o in outputs if o.request_id == "ok"][-1].finished
    assert engine.num_free_kv_blocks == NUM_BLOCKS
    with pytest.raises(RequestFailedError):
        llm.generate([[5, 6, 7]], params)
    assert engine.num_free_kv_blocks == NUM_BLOCKS
