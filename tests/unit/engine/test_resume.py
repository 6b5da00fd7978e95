"""Resumed requests (mid-stream migration): an engine given a prompt and the outputs another engine
already streamed continues exactly where that engine stopped: the same tokens and the same text
deltas as the uninterrupted run, for greedy and for seeded sampling with penalties and a stop
string, split anywhere (inside a character's bytes too); usage and `max_tokens` count every output.
Disaggregated too: one engine prefills the prompt and the outputs and samples the next, another
takes the KV over and decodes the rest, as the uninterrupted run."""

from __future__ import annotations

import pytest

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import IncrementalDetokenizer
from pdserve.errors import InvalidRequestError
from tests.harness.prefilled import prefill_first

PROMPT_TEXT = "the quick brown fox jumps over"
GREEDY = SamplingParams(max_tokens=30, temperature=0.0)
SEEDED = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.95, seed=7, presence_penalty=0.5,
                        frequency_penalty=0.3, repetition_penalty=1.2)


@pytest.fixture(scope="module")
def replicas(tiny_llama):
    """Two engines of one model: the one a stream began on, and the one it moves to."""
    return LLM(tiny_llama).engine, LLM(tiny_llama).engine


def _run(engine, request_id, prompt, params, resumed=()):
    engine.add_request(request_id, prompt, params, output_token_ids=resumed)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        assert not engine.take_failed_requests()
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks  # nothing held after the end
    return outs


def _steps(outs):
    return [(o.new_token_ids, o.new_text, o.finished, o.finish_reason, o.stop_reason) for o in outs]


def _pending_splits(engine, params, token_ids):
    """Split points k where the first k tokens end inside a character (bytes waiting for the next)."""
    detok = IncrementalDetokenizer(engine.tokenizer, params.stop, params.skip_special_tokens)
    splits = []
    for k, t in enumerate(token_ids[:-1], 1):
        detok.add(t)
        if detok.pending:
            splits.append(k)
    return splits


def _check_resumes(replicas, params, name):
    first, second = replicas
    prompt = first.tokenizer.encode(PROMPT_TEXT)
    whole = _run(first, f"{name}-whole", prompt, params)
    token_ids = [o.new_token_ids[0] for o in whole]
    inside_a_character = _pending_splits(first, params, token_ids)
    assert inside_a_character, "the run has no split inside a character to test"
    for k in sorted({1, 5, 11, inside_a_character[0], inside_a_character[-1], len(whole) - 1}):
        rest = _run(second, f"{name}-from-{k}", prompt, params, resumed=token_ids[:k])
        assert _steps(rest) == _steps(whole[k:]), f"split after {k} tokens"
        assert "".join(o.new_text for o in whole[:k] + rest) == "".join(o.new_text for o in whole)
        # Usage: the prompt is the original's; every output counts, so max_tokens holds across the split.
        assert all(o.num_prompt_tokens == len(prompt) for o in rest)
        assert [o.num_output_tokens for o in rest] == list(range(k + 1, len(whole) + 1))
        assert all(o.num_cached_tokens <= len(prompt) for o in rest)
        assert all(o.prompt_logprobs is None for o in rest)
    return whole


def test_a_greedy_run_resumed_anywhere_continues_exactly(replicas):
    whole = _check_resumes(replicas, GREEDY, "greedy")
    assert len(whole) == GREEDY.max_tokens and whole[-1].finish_reason == "length"


def test_a_seeded_run_with_penalties_and_a_stop_string_resumed_anywhere_continues_exactly(replicas):
    first, _ = replicas
    prompt = first.tokenizer.encode(PROMPT_TEXT)
    free = _run(first, "seeded-free", prompt, SEEDED)
    text = "".join(o.new_text for o in free)
    # A stop string that first appears late in the run (a few characters of output 20 on).
    start = len("".join(o.new_text for o in free[:20]))
    stop = next(text[i:i + 3] for i in range(start, len(text) - 3)
                if "\ufffd" not in text[i:i + 3] and text.find(text[i:i + 3]) == i)
    params = SamplingParams(**{**SEEDED.__dict__, "stop": (stop,)})
    whole = _check_resumes(replicas, params, "seeded")
    assert whole[-1].finish_reason == "stop" and whole[-1].stop_reason == stop
    assert [o.new_token_ids for o in whole] == [o.new_token_ids for o in free[:len(whole)]]


def test_a_resumed_request_hits_the_prefix_cache_of_its_prompt_and_outputs(replicas):
    first, _ = replicas
    prompt = first.tokenizer.encode(PROMPT_TEXT * 4)
    whole = _run(first, "cached-whole", prompt, GREEDY)
    token_ids = [o.new_token_ids[0] for o in whole]
    computed = first.scheduler.num_computed_prompt_tokens
    rest = _run(first, "cached-rest", prompt, GREEDY, resumed=token_ids[:20])
    assert _steps(rest) == _steps(whole[20:])
    # The prompt was served from the cache (usage counts prompt tokens only): none of it was
    # computed again, only the outputs' last block.
    assert rest[-1].num_cached_tokens == len(prompt)
    assert first.scheduler.num_computed_prompt_tokens == computed


@pytest.mark.parametrize("case", ["max_tokens", "stop token", "outside the vocabulary"])
def test_resumed_outputs_that_end_the_request_or_are_invalid_are_refused(replicas, case):
    engine, _ = replicas
    prompt = engine.tokenizer.encode(PROMPT_TEXT)
    params, outputs = SamplingParams(max_tokens=3, temperature=0.0), [5, 6, 7]
    if case == "stop token":
        params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(6,))
    elif case == "outside the vocabulary":
        params, outputs = SamplingParams(max_tokens=8), [5, 10**6]
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(f"refused-{case}", prompt, params, output_token_ids=outputs)
    assert e.value.param == "output_token_ids"
    assert not engine.has_unfinished_requests() and f"refused-{case}" not in engine._detokenizers
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_a_resumed_request_prefilled_by_one_engine_continues_exactly_on_another(replicas):
    """A prefill replica given the outputs with the prompt (`prefill_only`) samples the output
    after them from the same state; the decode engine takes over its KV (only the blocks its own
    cache lacks) and the rest is the uninterrupted run's, tokens and text."""
    prefill, decode = replicas
    prompt = prefill.tokenizer.encode(PROMPT_TEXT * 3)
    whole = _run(prefill, "pd-whole", prompt, SEEDED)
    token_ids = [o.new_token_ids[0] for o in whole]
    block_size = prefill.kv_cache.block_size
    for k in (1, 11, len(whole) - 2):
        rid = f"pd-from-{k}"
        first = prefill_first(prefill, rid, prompt, SEEDED, output_token_ids=token_ids[:k])
        assert (first.new_token_ids, first.new_text) == (whole[k].new_token_ids, whole[k].new_text)
        assert first.num_output_tokens == k + 1
        assert len(first.kv_block_ids) == -(-(len(prompt) + k) // block_size)  # the prompt's and outputs' KV
        num_local, dst = decode.add_prefilled_request(rid, prompt, SEEDED, first, output_token_ids=token_ids[:k])
        assert num_local + len(dst) == len(first.kv_block_ids)
        decode.kv_cache.kv[:, :, dst] = prefill.kv_cache.kv[:, :, first.kv_block_ids[num_local:]]
        prefill.release_kv(rid)
        decode.start_prefilled_request(rid)
        rest = []
        while decode.has_unfinished_requests():
            rest += decode.step()
        assert _steps(rest) == _steps(whole[k + 1:]), f"split after {k} tokens"
        for engine in (prefill, decode):
            assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
