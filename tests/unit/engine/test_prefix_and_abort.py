"""Prefix reuse computes only the suffix; aborts and finishes never leak KV blocks."""

import random

import pytest

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from tests.harness.prefilled import prefill_first

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def test_shared_prefix_computes_only_the_suffix(tiny_llama):
    rng = random.Random(0)
    prefix = [rng.randrange(5, 500) for _ in range(200)]
    first = prefix + [rng.randrange(5, 500) for _ in range(30)]
    second = prefix + [rng.randrange(5, 500) for _ in range(40)]

    llm = LLM(tiny_llama)
    llm.generate([first], GREEDY)
    sched = llm.engine.scheduler
    computed_before = sched.num_computed_prompt_tokens
    [out] = llm.generate([second], GREEDY)
    computed = sched.num_computed_prompt_tokens - computed_before

    reused = (200 // 16) * 16  # full blocks of the shared prefix
    assert out.num_cached_tokens == reused
    assert computed == len(second) - reused

    [expected] = LLM(tiny_llama, enable_prefix_caching=False).generate([second], GREEDY)
    assert out.token_ids == expected.token_ids


def test_identical_prompt_recomputes_only_the_last_block(tiny_llama):
    prompt = list(range(5, 5 + 64))  # exactly 4 blocks
    llm = LLM(tiny_llama)
    [a] = llm.generate([prompt], GREEDY)
    [b] = llm.generate([prompt], GREEDY)
    # The last token's logits are needed, so its block is computed again, never written shared.
    assert b.num_cached_tokens == 48
    assert a.token_ids == b.token_ids


def _assert_pool_empty(engine):
    pool = engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(rc == 0 for rc in pool.ref_counts)
    assert engine.kv_manager.block_tables == {}
    assert not engine.has_unfinished_requests()


def test_abort_mid_run_returns_every_block(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    engine = llm.engine
    for i in range(6):
        engine.add_request(f"r{i}", list(range(5, 5 + 40 * (i + 1))), SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    engine.step()
    assert engine.block_pool.num_free_blocks < 64
    for i in range(6):
        assert engine.abort_request(f"r{i}")
    assert not engine.abort_request("r0")  # already gone
    _assert_pool_empty(engine)


def test_no_block_leak_after_500_mixed_requests(tiny_llama):
    rng = random.Random(1)
    llm = LLM(tiny_llama, num_kv_blocks=48, max_num_seqs=16, max_num_batched_tokens=128)
    engine = llm.engine
    shared = [rng.randrange(5, 500) for _ in range(48)]
    live: list[str] = []
    finished = aborted = 0
    next_id = 0
    while next_id < 500 or engine.has_unfinished_requests():
        while next_id < 500 and len(live) < 24:
            n = rng.randint(1, 120)
            prompt = (shared[: rng.randint(0, 48)] + [rng.randrange(5, 500) for _ in range(n)])[:200] or [7]
            params = SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 0.8]),
                                    seed=rng.choice([None, 3]), ignore_eos=rng.random() < 0.5)
            rid = f"m{next_id}"
            engine.add_request(rid, prompt, params)
            live.append(rid)
            next_id += 1
        if live and rng.random() < 0.15:
            victim = live.pop(rng.randrange(len(live)))
            aborted += engine.abort_request(victim)
        for out in engine.step():
            if out.finished:
                live.remove(out.request_id)
                finished += 1
    assert finished + aborted == 500
    assert aborted > 20 and engine.scheduler.num_preemptions > 0
    _assert_pool_empty(engine)


def test_a_prefilled_request_without_room_decodes_only_after_recomputing(tiny_llama):
    """add_prefilled_request finds no free blocks: starting it as if its KV had been pulled is
    refused (it would decode on whatever its table's slots held), and with recompute it prefills
    here and gives the tokens a colocated run gives."""
    prompt = list(range(5, 5 + 64))  # 4 blocks
    [expected] = LLM(tiny_llama).generate([prompt], GREEDY)
    prefill = LLM(tiny_llama).engine
    first = prefill_first(prefill, "x", prompt, GREEDY)
    prefill.release_kv("x")

    decode = LLM(tiny_llama, num_kv_blocks=8).engine
    hog = decode.block_pool.allocate(6)  # 2 free blocks: the prompt needs 4
    assert decode.add_prefilled_request("x", prompt, GREEDY, first) == (0, None)
    with pytest.raises(ValueError, match="recompute"):
        decode.start_prefilled_request("x")
    decode.block_pool.free(hog)
    decode.start_prefilled_request("x", recompute=True)
    tokens = list(first.new_token_ids)
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens += out.new_token_ids
    assert tokens == expected.token_ids
    assert decode.block_pool.num_free_blocks == 8


def test_prefilled_requests_beyond_max_num_seqs_wait_their_turn_and_decode_as_a_colocated_run(tiny_llama):
    """A decode engine of 2 sequence slots takes over 4 prompts another engine prefilled: at most 2
    run in any step, the others wait holding their KV, and each gives a colocated run's tokens."""
    prompts = [list(range(5 + 40 * i, 45 + 40 * i)) for i in range(4)]
    expected = [c.token_ids for c in LLM(tiny_llama).generate(prompts, GREEDY)]
    prefill, decode = LLM(tiny_llama).engine, LLM(tiny_llama, max_num_seqs=2).engine
    tokens = {}
    for i, prompt in enumerate(prompts):
        first = prefill_first(prefill, f"r{i}", prompt, GREEDY)
        num_local, dst = decode.add_prefilled_request(f"r{i}", prompt, GREEDY, first)
        decode.kv_cache.kv[:, :, dst] = prefill.kv_cache.kv[:, :, first.kv_block_ids[num_local:]]
        prefill.release_kv(f"r{i}")
        decode.start_prefilled_request(f"r{i}")
        tokens[f"r{i}"] = list(first.new_token_ids)
    most_running = 0
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
        most_running = max(most_running, len(decode.scheduler.running))
    assert most_running == 2
    assert [tokens[f"r{i}"] for i in range(4)] == expected
    assert decode.block_pool.num_free_blocks == decode.block_pool.num_blocks
