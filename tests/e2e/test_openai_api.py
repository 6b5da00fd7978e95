"""The OpenAI API of both apps, driven with the official `openai` client: outputs equal the
offline engine's, streams equal non-streamed responses, and sampling options behave."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from tests.e2e.conftest import ENGINE

SHORT = "The quick brown fox"  # a few tokens
LONG = ("In a distant land, the old lighthouse keeper wrote letters to the sea every evening, "
        "and the sea, patient as ever, answered with the tide")  # > 24 tokens: prefilled remotely


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(tiny_llama, block_size=ENGINE["block_size"], num_kv_blocks=256)


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_greedy_completions_match_the_offline_engine(app, offline):
    before = app.stats(app.pools[-1])
    fresh_long = "Orchards of copper and rain. " + LONG  # no block of it cached by earlier tests
    for prompt in (SHORT, fresh_long):
        r = app.client.completions.create(model=app.model, prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        expected = offline.generate([prompt], _greedy(12))[0]
        assert r.choices[0].text == expected.text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(expected.prompt_token_ids) and r.usage.completion_tokens == 12
    if app.name == "disagg":  # the app's target is met through the prefill pool: both are prefilled there
        after = app.stats("Decode")
        assert after["num_remote_prefills"] - before["num_remote_prefills"] == 2
        assert after["num_local_prefills"] - before["num_local_prefills"] == 0


def test_greedy_chat_matches_the_offline_engine(app, offline, tiny_llama):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": LONG}]
    r = app.client.chat.completions.create(model=app.model, messages=messages, max_completion_tokens=10,
                                           temperature=0, extra_body={"ignore_eos": True})
    ids = Tokenizer(tiny_llama).encode_chat(messages)
    assert r.choices[0].message.content == offline.generate([ids], _greedy(10))[0].text
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(ids)


def test_streams_concatenate_to_the_whole_response(app):
    args = dict(model=app.model, prompt=LONG, max_tokens=14, temperature=0, extra_body={"ignore_eos": True})
    whole = app.client.completions.create(**args)
    chunks = list(app.client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 14
    assert all(c.usage is None for c in chunks[:-1])

    chat = dict(model=app.model, messages=[{"role": "user", "content": LONG}], max_tokens=9, temperature=0)
    whole = app.client.chat.completions.create(**chat)
    chunks = list(app.client.chat.completions.create(**chat, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert sum(1 for c in chunks if c.choices[0].finish_reason) == 1


def test_n_stop_seed_and_logprobs(app, offline):
    r = app.client.completions.create(model=app.model, prompt=LONG, max_tokens=6, temperature=0, n=2,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text
    assert r.usage.completion_tokens == 12

    text = offline.generate([LONG], _greedy(16))[0].text
    stop = text[5:8]
    r = app.client.completions.create(model=app.model, prompt=LONG, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"

    seeded = dict(model=app.model, prompt=LONG, max_tokens=12, temperature=1.0, seed=1234)
    first, second = (app.client.completions.create(**seeded).choices[0].text for _ in range(2))
    assert first == second
    two = app.client.completions.create(**seeded, n=2)
    assert two.choices[0].text == first  # choice i samples with seed + i

    r = app.client.chat.completions.create(model=app.model, messages=[{"role": "user", "content": SHORT}],
                                           max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4) for t in content)  # greedy


def test_echo_logprobs_score_the_prompt_like_the_offline_engine(app, offline, tiny_llama):
    ids = Tokenizer(tiny_llama).encode(LONG)
    r = app.client.completions.create(model=app.model, prompt=ids, max_tokens=1, temperature=0, echo=True,
                                      logprobs=1)
    lp = r.choices[0].logprobs
    expected = offline.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 1
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([p.logprob for p in expected.prompt_logprobs[1:]],
                                                          abs=1e-4)
    assert r.choices[0].text.startswith(LONG[:20])


def test_twenty_concurrent_streams(app, offline):
    prompts = [f"{LONG} {i}" if i % 2 else f"{SHORT} {i}" for i in range(20)]
    expected = [c.text for c in offline.generate(prompts, _greedy(10))]

    async def one(prompt):
        stream = await app.aclient.completions.create(model=app.model, prompt=prompt, max_tokens=10,
                                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        assert sum(1 for c in chunks if c.choices[0].finish_reason) == 1
        return "".join(c.choices[0].text for c in chunks)

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(main()) == expected
    stats = app.wait_for_idle()
    assert all(s["num_free_kv_blocks"] == s["num_kv_blocks"] for s in stats.values()), stats


def test_decode_reuses_its_prefix_cache_and_pulls_only_new_blocks(serve_apps, offline):
    app = serve_apps["disagg"]
    block = ENGINE["block_size"]
    turn1 = list(range(300, 300 + 5 * block))  # 5 full blocks
    turn2 = turn1 + list(range(400, 400 + 4 * block + 3))  # the same 5 blocks, then 35 new tokens

    def pulled(prompt):
        before = app.stats("Decode")
        r = app.client.completions.create(model=app.model, prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
        after = app.stats("Decode")
        assert after["num_remote_prefills"] - before["num_remote_prefills"] == 1
        assert r.choices[0].text == offline.generate([prompt], _greedy(4))[0].text
        return after["num_pulled_blocks"] - before["num_pulled_blocks"]

    assert pulled(turn1) == 5
    assert pulled(turn2) == -(-len(turn2) // block) - 5  # only the blocks decode did not hold
