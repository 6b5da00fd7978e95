"""Prefill and decode roles in one process (local KV backend, no Ray): the disaggregated path
gives the offline engine's tokens, reuses decode's prefix cache, recovers from failed legs and
frees every block."""

import asyncio
import threading
import time

import pytest

from pdserve.decode.placement import MIN_ERROR_SAMPLES, CostModel, Target
from pdserve.decode.server import ATTAINMENT_WINDOW_S
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol import GenerateRequest
from tests.harness.fixed_costs import fix_costs
from tests.harness.waiting import until

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _run(decode, requests):
    async def one(r):
        return [o async for o in decode.generate(r)]

    async def main():
        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(main())


def _tokens(outs):
    assert sum(o.finished for o in outs) == 1 and outs[-1].finished
    return [t for o in outs for t in o.new_token_ids]


@pytest.mark.parametrize("pools", ["auto", "bfloat16"], indirect=True)
def test_disaggregated_greedy_and_seeded_match_one_engine(pools, tiny_llama):
    prefill, decode = pools
    prompts = [list(range(5, 5 + n)) for n in (4, 17, 24, 40)]
    seeded = SamplingParams(max_tokens=10, temperature=0.9, seed=7, ignore_eos=True)
    params = [GREEDY, GREEDY, seeded, GREEDY]
    kv_cache_dtype = decode.engine.engine.config.kv_cache_dtype
    expected = [c.token_ids for c in LLM(tiny_llama, block_size=8, kv_cache_dtype=kv_cache_dtype).generate(
        prompts, params)]
    outs = _run(decode, [GenerateRequest(f"r{i}", p, s) for i, (p, s) in enumerate(zip(prompts, params))])
    assert [_tokens(o) for o in outs] == expected
    # The default target (2 s to the first token) is met through the prefill replica: every prompt goes there.
    assert decode.stats()["num_remote_prefills"] == 4 and decode.stats()["num_local_prefills"] == 0
    assert prefill.stats()["num_kv_leases"] == 0
    for server in (decode, prefill):  # engine calls run in order: releases have run
        asyncio.run(server.engine.call(lambda: None))
    assert prefill.stats()["num_free_kv_blocks"] == 96 and decode.stats()["num_free_kv_blocks"] == 96


def test_placement_learns_from_the_prefill_replicas_report_and_its_own_steps(pools):
    prefill, decode = pools
    prefill.stats()  # the load counters' first reading
    _run(decode, [GenerateRequest("r", list(range(5, 45)), GREEDY)])
    load = prefill.stats()  # the second: their rates
    # The pool's load, in tokens and prompts: their ratio is the prompt computed, 40 tokens.
    assert load["prompts_per_s"] > 0 and load["prompt_tokens_per_s"] == pytest.approx(40 * load["prompts_per_s"])
    reported = prefill.stats()["prefill_tokens_per_s"]  # its one prefill step's rate: no step since
    stats = decode.stats()
    assert reported > 0 and stats["placement_remote_tokens_per_s"] == reported
    assert stats["placement_remote_wait_s"] > 0  # the call took longer than computing 40 tokens
    assert stats["placement_decode_step_s"] != CostModel().rates().decode_step_s  # its steps replaced the prior
    assert stats["placement_link_bytes_per_s"] != CostModel().rates().link_bytes_per_s  # and its pull
    assert 0 <= stats["itl_attainment"] <= 1 and stats["ttft_attainment"] in (0.0, 1.0)  # measured, one request


def test_each_first_token_measures_its_paths_prediction_error(pools):
    _, decode = pools
    decode.target = Target(ttft_s=3600.0, itl_s=0.1)  # every prompt remote, however loaded the machine
    started = time.monotonic()
    assert decode.stats()["placement_remote_margin_s"] == 0.0  # no error measured yet
    _run(decode, [GenerateRequest(f"r{i}", list(range(5, 13 + i)), GREEDY) for i in range(MIN_ERROR_SAMPLES)])
    errors = decode.costs.errors
    assert len(errors["remote"]) == MIN_ERROR_SAMPLES and len(errors["local"]) == 0
    # Enough first tokens: the margin is the 99th percentile of their errors (the largest of 20).
    stats = decode.stats()
    assert stats["placement_remote_margin_s"] == errors["remote"].ordered[-1] != 0.0
    assert decode.placed == {}  # nothing kept past a first token
    # The requests taken, how long they were held and how many are held now: the joint policy's
    # Little's law. (The rate needs both readings inside the window: a run slowed past it has none.)
    assert decode.num_arrived == MIN_ERROR_SAMPLES and stats["residence_s"] > 0
    assert stats["num_in_flight_requests"] == 0
    if time.monotonic() - started < ATTAINMENT_WINDOW_S:
        assert stats["requests_per_s"] > 0


def test_decode_reports_the_kv_share_of_what_its_steps_read(pools):
    """The joint policy's `kv_read_share`: the KV held against the weights a decode step streams."""
    _, decode = pools
    engine = decode.engine.engine
    assert decode.decode_weight_bytes == engine.model.num_decode_weight_bytes() > 0  # one rank: all of them
    assert decode.stats()["kv_read_share"] == 0.0  # nothing held
    shares = []

    def read():  # (on the engine's thread, between steps: the figure and the blocks at one instant)
        held = (engine.block_pool.num_blocks - engine.num_free_kv_blocks) * decode.block_bytes
        return decode.stats()["kv_read_share"], held / (held + decode.decode_weight_bytes)

    async def stream():
        async for _ in decode.generate(GenerateRequest("r", list(range(5, 45)), GREEDY)):
            shares.append(await decode.engine.call(read))

    asyncio.run(stream())
    assert all(got == pytest.approx(want) for got, want in shares) and max(shares)[0] > 0
    assert asyncio.run(decode.engine.call(read))[0] == 0.0  # its blocks freed (cached blocks count as free)


def test_decode_pulls_only_blocks_it_lacks(pools, tiny_llama):
    prefill, decode = pools
    system = list(range(100, 140))  # 5 full blocks of 8
    _run(decode, [GenerateRequest("warm", system + [7, 8, 9], GREEDY)])
    pulled = decode.stats()["num_pulled_blocks"]
    prompt = system + list(range(200, 230))  # 40 shared + 30 new tokens: uncached 30 >= 16
    [outs] = _run(decode, [GenerateRequest("turn2", prompt, GREEDY)])
    assert _tokens(outs) == LLM(tiny_llama, block_size=8).generate([prompt], GREEDY)[0].token_ids
    assert decode.stats()["num_pulled_blocks"] - pulled == -(-len(prompt) // 8) - 5


def test_a_resumed_sequence_is_prefilled_remotely_and_continues_exactly(pools, tiny_llama):
    """A sequence another decode replica began (its outputs so far in `output_token_ids`) is placed
    like any other: the prefill replica prefills prompt and outputs and samples the next output,
    and the stream goes on as the uninterrupted run (greedy and seeded)."""
    prefill, decode = pools
    prompt = list(range(7, 47))
    seeded = SamplingParams(max_tokens=10, temperature=0.9, seed=11, ignore_eos=True)
    for i, params in enumerate((GREEDY, seeded)):
        whole = LLM(tiny_llama, block_size=8).generate([prompt], params)[0].token_ids
        before = decode.stats()
        (outs,) = _run(decode, [GenerateRequest(f"resumed-{i}", prompt, params, output_token_ids=whole[:4])])
        assert _tokens(outs) == whole[4:]
        stats = decode.stats()
        assert stats["num_remote_prefills"] == before["num_remote_prefills"] + 1
        assert stats["num_local_prefills"] == before["num_local_prefills"]
        assert stats["num_resumed_requests"] == before["num_resumed_requests"] + 1
    for server in (decode, prefill):
        asyncio.run(server.engine.call(lambda: None))
    assert prefill.stats()["num_kv_leases"] == 0
    assert prefill.stats()["num_free_kv_blocks"] == 96 and decode.stats()["num_free_kv_blocks"] == 96


def test_failed_prefill_or_pull_falls_back_to_local_compute(pools, tiny_llama):
    prefill, decode = pools
    prompt = list(range(3, 40))
    expected = LLM(tiny_llama, block_size=8).generate([prompt], GREEDY)[0].token_ids

    async def broken_prefill(req):
        raise ConnectionError("prefill replica died")

    real = decode.remote_prefill
    decode.remote_prefill = broken_prefill
    assert _tokens(_run(decode, [GenerateRequest("a", prompt, GREEDY)])[0]) == expected

    async def expired_lease(req):  # the handle arrives after its blocks were released
        result = await real(req)
        prefill.exporter.ack(req.request_id, result.kv.lease_token)
        return result

    decode.remote_prefill = expired_lease
    assert _tokens(_run(decode, [GenerateRequest("b", prompt, GREEDY)])[0]) == expected

    decode.remote_prefill = real
    kv = decode.engine.engine.kv_manager
    allocate = kv.allocate
    kv.allocate = lambda *a: setattr(kv, "allocate", allocate) or False  # full once: it queues instead
    assert _tokens(_run(decode, [GenerateRequest("c", prompt, GREEDY)])[0]) == expected
    assert prefill.stats()["num_kv_leases"] == 0
    for server in (decode, prefill):  # engine calls run in order: releases have run
        asyncio.run(server.engine.call(lambda: None))
    assert decode.stats()["num_free_kv_blocks"] == 96 and prefill.stats()["num_free_kv_blocks"] == 96


def test_cancelled_stream_frees_both_pools(pools):
    prefill, decode = pools

    async def main():
        gen = decode.generate(GenerateRequest("c", list(range(50)), SamplingParams(max_tokens=200, ignore_eos=True)))
        await gen.__anext__()  # the first token came from prefill
        await gen.__anext__()  # decoding here
        await gen.aclose()

    asyncio.run(main())
    for server in (decode, prefill):  # engine calls run in order: the abort and the release have run
        asyncio.run(server.engine.call(lambda: None))
    assert decode.stats()["num_free_kv_blocks"] == 96
    assert prefill.stats()["num_free_kv_blocks"] == 96 and prefill.stats()["num_kv_leases"] == 0


def test_leases_pin_and_unpin_without_waiting_for_a_running_step(pools):
    """An export (on the prefill replica's event loop) and an ack (on the exporter's threads) leave
    their pin and unpin to run after the engine's current step instead of waiting it out: a long
    prompt's prefill step held the event loop, and every other request with it, for its length."""
    prefill, _ = pools
    result = asyncio.run(prefill.prefill(GenerateRequest("p", list(range(40)), GREEDY)))
    ids = list(result.kv.block_ids)
    pool = prefill.engine.engine.block_pool
    refs = [pool.ref_counts[b] for b in ids]
    step_running, step_done = threading.Event(), threading.Event()

    def step():  # holds the engine's lock as a step does
        with prefill.engine._lock:
            step_running.set()
            step_done.wait(10)  # a call that waits for the lock returns after this

    holder = threading.Thread(target=step)
    holder.start()
    step_running.wait()
    try:
        q = prefill.exporter.export("q", ids, 40).lease_token  # a second lease on the same blocks
        assert [pool.ref_counts[b] for b in ids] == refs  # its pin waits for the step's end...
        prefill.exporter.leases.release("p", result.kv.lease_token)  # the first one's ack
        assert [pool.ref_counts[b] for b in ids] == refs  # ...and so does this unpin
    finally:
        step_done.set()
        holder.join()
    asyncio.run(prefill.engine.call(lambda: None))  # engine calls run in order: both have run
    assert [pool.ref_counts[b] for b in ids] == refs  # one pin, one unpin
    prefill.exporter.leases.release("q", q)
    asyncio.run(prefill.engine.call(lambda: None))
    assert prefill.stats()["num_free_kv_blocks"] == 96


@pytest.mark.parametrize("early", [False, True])
def test_first_token_leaves_after_the_pull_unless_that_misses_the_target(pools, early):
    """The prefill's first token goes out once the KV is in and the request joins the batch (no
    pull between tokens 1 and 2), unless waiting for that would take it past the TTFT target: then
    before the pull."""
    _, decode = pools
    if early:  # a target no path meets; the prefill pool is the sooner one
        fix_costs(decode, ttft_s=1e-6, remote_tokens_per_s=1e9)
    else:
        fix_costs(decode, ttft_s=10.0)
    events = []
    pull = decode.importer.pull
    decode.importer.pull = lambda *a: events.append("pulled") or pull(*a)

    async def main():
        async for out in decode.generate(GenerateRequest("e", list(range(40)), GREEDY)):
            events.append("output")

    asyncio.run(main())
    assert events[:2] == (["output", "pulled"] if early else ["pulled", "output"])
    stats = decode.stats()
    assert stats["num_remote_prefills"] == 1 and stats["num_pulled_blocks"] == 5
    assert stats["num_early_first_tokens"] == early
    assert stats["ttft_attainment"] == (0.0 if early else 1.0)  # the one first token, against either target


def test_prompts_prefill_here_when_the_prefill_pool_would_miss_the_ttft_target(pools, tiny_llama):
    """A prompt that finds enough of this replica's prompts waiting on the prefill pool that it
    would miss the TTFT target there is prefilled here, when here meets it; once the remote queue
    drains, prompts go remote again. (Rates fixed: 1 ms a prompt token on either side, 20 ms a
    decode step; target 70 ms. Alone, 40 tokens take 60 ms remotely; 24 behind 40 take 84 ms
    there and 24 ms here, where nothing decodes.)"""
    prefill, decode = pools
    fix_costs(decode, ttft_s=0.07)
    prompts = {"first": list(range(5, 45)), "second": list(range(60, 84)), "after": list(range(90, 114))}
    expected = _offline_greedy(tiny_llama, prompts)
    held, seen_queue = _hold_remote_prefills(decode)  # the prefill replica is busy until "second" is in
    asked = _record_local_prefills(decode)

    async def main():
        first = asyncio.ensure_future(_collect(decode, GenerateRequest("first", prompts["first"], GREEDY)))
        await until(lambda: seen_queue, what="the first prompt waiting on the prefill replica")
        second = await _collect(decode, GenerateRequest("second", prompts["second"], GREEDY))
        held.set()
        return {"first": await first, "second": second,
                "after": await _collect(decode, GenerateRequest("after", prompts["after"], GREEDY))}

    outs = asyncio.run(main())
    assert {name: _tokens(o) for name, o in outs.items()} == expected
    assert seen_queue == [40, 24]  # each with its own uncached tokens: "after" found the queue empty
    stats = decode.stats()
    assert stats["num_remote_prefills"] == 2
    assert stats["num_local_prefills"] == stats["num_local_prefills_for_target"] == 1
    assert decode.remote_queued_tokens == 0
    assert asked == {"second": (0.0, 0)}  # nothing decodes here: no pause, no chunk limit
    for server in (decode, prefill):
        asyncio.run(server.engine.call(lambda: None))
    assert decode.stats()["num_free_kv_blocks"] == 96 and prefill.stats()["num_free_kv_blocks"] == 96


def test_placement_waits_behind_the_prefill_pools_queue_as_its_router_sees_it(pools, tiny_llama):
    """Other replicas' prompts queued on the prefill pool count too: this replica reads them from its
    router for the pool (`prefill_queue`). At 1 ms a prompt token, 40 tokens behind 100 queued take
    140 ms there and 40 ms here (nothing decodes): prefilled here for a 70 ms target; with the
    queue gone, remote again."""
    prefill, decode = pools
    fix_costs(decode, ttft_s=0.07)
    queue = [100]
    decode.prefill_queue = lambda: queue[0]
    prompts = {"behind": list(range(5, 45)), "after": list(range(60, 100))}
    expected = _offline_greedy(tiny_llama, prompts)
    got = {"behind": _tokens(_run(decode, [GenerateRequest("behind", prompts["behind"], GREEDY)])[0])}
    assert decode.stats()["num_local_prefills_for_target"] == 1 and decode.stats()["num_remote_prefills"] == 0
    queue[0] = 0
    got["after"] = _tokens(_run(decode, [GenerateRequest("after", prompts["after"], GREEDY)])[0])
    assert got == expected
    assert decode.stats()["num_remote_prefills"] == 1 and decode.stats()["num_local_prefills_for_target"] == 1


def test_a_prompt_prefilled_beside_streams_yields_then_takes_chunks_inside_the_itl_target(pools, tiny_llama):
    """With a stream decoding here, a prompt prefilled here waits for the TTFT target's slack, then
    takes chunks that keep a step inside the ITL target. (Rates fixed: 20 ms a decode step, 1 ms a
    prompt token here, the prefill pool at 500 tokens/s; target 140 ms to the first token, 36 ms
    between tokens: 16-token chunks, 24 tokens in two steps, 64 ms, here against 148 ms behind 40
    remotely; 140 - 64 - 36 ms of slack.)"""
    prefill, decode = pools
    fix_costs(decode, ttft_s=0.14, itl_s=0.036, remote_tokens_per_s=500)
    long_run = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    prompts = {"running": list(range(300, 340)), "queued": list(range(5, 45)), "second": list(range(60, 84))}
    offline = LLM(tiny_llama, block_size=8).generate(list(prompts.values()), [long_run, GREEDY, GREEDY])
    expected = dict(zip(prompts, (c.token_ids for c in offline)))
    prefilled_here = []  # prompt tokens of each step of this engine that prefilled
    decode.engine.engine.on_step = lambda decodes, tokens, seconds: tokens and prefilled_here.append(tokens)
    asked = _record_local_prefills(decode)

    async def main():
        running = decode.generate(GenerateRequest("running", prompts["running"], long_run))
        outs = [await running.__anext__(), await running.__anext__()]  # decoding here now
        rest = asyncio.ensure_future(_collect_rest(running, outs))
        held, seen_queue = _hold_remote_prefills(decode)
        queued = asyncio.ensure_future(_collect(decode, GenerateRequest("queued", prompts["queued"], GREEDY)))
        await until(lambda: seen_queue, what="a prompt waiting on the prefill replica")
        second = await _collect(decode, GenerateRequest("second", prompts["second"], GREEDY))
        held.set()
        return {"running": await rest, "queued": await queued, "second": second}

    outs = asyncio.run(main())
    assert {name: _tokens(o) for name, o in outs.items()} == expected
    [(pause_s, chunk)] = asked.values()
    assert chunk == 16 and pause_s == pytest.approx(0.14 - 0.064 - 0.036)
    assert prefilled_here == [16, 8]  # "second" alone was prefilled here
    for server in (decode, prefill):
        asyncio.run(server.engine.call(lambda: None))
    assert decode.stats()["num_free_kv_blocks"] == 96 and prefill.stats()["num_free_kv_blocks"] == 96


async def _collect_rest(stream, outs):
    return outs + [o async for o in stream]


def _record_local_prefills(decode) -> dict[str, tuple[float, int]]:
    """What `decode`'s engine is asked to prefill: request id -> (prefill_pause_s, max_chunk_tokens)."""
    asked = {}
    add_request = decode.engine.engine.add_request

    def recording_add_request(request_id, prompt, params, prefill_only, prefill_pause_s, deadline_s,
                              output_token_ids, max_chunk_tokens):
        asked[request_id] = (prefill_pause_s, max_chunk_tokens)
        add_request(request_id, prompt, params, prefill_only, prefill_pause_s, deadline_s, output_token_ids,
                    max_chunk_tokens)

    decode.engine.engine.add_request = recording_add_request
    return asked


def _offline_greedy(tiny_llama, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each named prompt's greedy tokens from the offline engine."""
    outs = LLM(tiny_llama, block_size=8).generate(list(prompts.values()), GREEDY)
    return dict(zip(prompts, (c.token_ids for c in outs)))


def _hold_remote_prefills(decode) -> tuple[asyncio.Event, list[int]]:
    """Make `decode`'s remote prefills wait for the returned event; the list gets the uncached
    tokens queued on prefill replicas as each call came in."""
    held, seen_queue, real = asyncio.Event(), [], decode.remote_prefill

    async def held_prefill(req):
        seen_queue.append(decode.remote_queued_tokens)
        await held.wait()
        return await real(req)

    decode.remote_prefill = held_prefill
    return held, seen_queue


async def _collect(decode, req):
    return [o async for o in decode.generate(req)]
