"""The scheduler's policy on its own: token budget, chunking, admission limits, preemption."""

from pdserve.engine.kv_cache import BlockPool, KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler


def _sched(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, long_prefill=0, split_to_fill=True,
           clock=lambda: 0.0):
    return Scheduler(KVCacheManager(BlockPool(num_blocks, block_size)), max_num_seqs, budget, long_prefill,
                     split_to_fill, clock)


def _req(rid, n, block_size=4, first=100):
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=100), block_size)


def _run_step(s, sampled_token=7):
    out = s.schedule()
    s.update(out)
    for c in out.chunks:
        if c.samples:
            c.request.append_token(sampled_token)
    return [(c.request.request_id, c.start, c.num_new_tokens) for c in out.chunks], out


def test_long_prompt_is_chunked_to_the_budget_and_decodes_go_first():
    s = _sched(budget=16)
    s.add(_req("long", 40))
    assert _run_step(s)[0] == [("long", 0, 16)]
    s.add(_req("short", 3))
    # The running chunk continues first; the newcomer takes what budget is left.
    assert _run_step(s)[0] == [("long", 16, 16)]
    assert _run_step(s)[0] == [("long", 32, 8), ("short", 0, 3)]
    assert _run_step(s)[0] == [("long", 40, 1), ("short", 3, 1)]


def test_short_prompts_go_past_long_ones_and_one_long_prompt_is_prefilled_at_a_time():
    s = _sched(budget=16, long_prefill=8)
    s.add(_req("long", 20))
    s.add(_req("long2", 12, first=500))  # prompts of their own: no prefix shared
    # At most 8 tokens of a prompt a step; the second long prompt waits for the first.
    assert _run_step(s)[0] == [("long", 0, 8)]
    s.add(_req("short", 3, first=900))
    # The newcomer goes past the waiting long prompt and starts beside the running one's next chunk
    # (without the threshold it would wait for both).
    assert _run_step(s)[0] == [("long", 8, 8), ("short", 0, 3)]
    # The first has 4 tokens left, no longer long: the second starts beside them.
    assert _run_step(s)[0] == [("long", 16, 4), ("short", 3, 1), ("long2", 0, 8)]
    assert _run_step(s)[0] == [("long", 20, 1), ("short", 4, 1), ("long2", 8, 4)]


def test_without_split_to_fill_a_prompt_that_would_not_finish_starts_in_a_step_of_its_own():
    def first_step(split_to_fill):
        s = _sched(budget=16, split_to_fill=split_to_fill)
        s.add(_req("a", 10))
        s.add(_req("c", 3, first=900))
        s.add(_req("b", 12, first=500))
        return s, _run_step(s)[0]

    assert first_step(True)[1] == [("a", 0, 10), ("c", 0, 3), ("b", 0, 3)]  # the budget's rest: b's first chunk
    s, chunks = first_step(False)
    assert chunks == [("a", 0, 10), ("c", 0, 3)]  # whole prompts join; b would not finish, so it waits
    # Decodes are no prefill: b starts beside them.
    assert _run_step(s)[0] == [("a", 10, 1), ("c", 3, 1), ("b", 0, 12)]
    # A prompt longer than the budget still starts, chunked, where nothing else is prefilled.
    s.add(_req("long", 40, first=300))
    assert _run_step(s)[0] == [("a", 11, 1), ("c", 4, 1), ("b", 12, 1), ("long", 0, 13)]


def test_a_prompt_that_yields_to_decodes_prefills_while_nothing_decodes_or_after_its_pause():
    now = [0.0]
    s = _sched(budget=16, long_prefill=8, clock=lambda: now[0])
    s.add(_req("a", 3))
    assert _run_step(s)[0] == [("a", 0, 3)]
    now[0] = 1.0
    overflow = _req("long", 20, first=500)
    overflow.prefill_pause_s = 2.0
    s.add(overflow)
    s.add(_req("c", 3, first=700))  # no pause of its own: it joins beside a's decode
    assert _run_step(s)[0] == [("a", 3, 1), ("c", 0, 3)]  # a decodes: the yielding prompt waits
    s.abort("a")
    s.abort("c")
    assert _run_step(s)[0] == [("long", 0, 8)]  # nothing decodes: it prefills
    s.add(_req("b", 3, first=900))
    assert _run_step(s)[0] == [("long", 8, 8), ("b", 0, 3)]
    # b decodes now: long's next chunk waits, until 2 s after it arrived.
    assert _run_step(s)[0] == [("b", 3, 1)]
    now[0] = 3.0
    assert _run_step(s)[0] == [("long", 16, 4), ("b", 4, 1)]


def test_a_prompt_with_a_chunk_limit_of_its_own_takes_at_most_that_many_tokens_a_step():
    s = _sched(budget=16)
    capped = _req("capped", 20)
    capped.max_chunk_tokens = 6
    s.add(capped)
    s.add(_req("other", 12, first=500))  # no limit: it takes what budget is left
    assert _run_step(s)[0] == [("capped", 0, 6), ("other", 0, 10)]
    assert _run_step(s)[0] == [("capped", 6, 6), ("other", 10, 2)]
    assert _run_step(s)[0] == [("capped", 12, 6), ("other", 12, 1)]
    assert _run_step(s)[0] == [("capped", 18, 2), ("other", 13, 1)]


def test_a_long_prompt_mostly_in_the_prefix_cache_is_short():
    s = _sched(budget=16, long_prefill=8)
    s.add(_req("a", 12))
    while s.requests["a"].num_computed_tokens < 12:
        _run_step(s)
    s.finish(s.requests["a"])  # its three full blocks stay cached
    s.add(_req("long", 20, first=500))
    s.add(_req("b", 20))  # a's prompt and 8 more tokens: only those to compute
    assert _run_step(s)[0] == [("long", 0, 8), ("b", 12, 8)]


def test_max_num_seqs_limits_admission():
    s = _sched(max_num_seqs=2, budget=64)
    for i in range(3):
        s.add(_req(f"r{i}", 4))
    ids = [rid for rid, _, _ in _run_step(s)[0]]
    assert ids == ["r0", "r1"] and len(s.waiting) == 1


def test_out_of_blocks_preempts_the_newest_and_recomputes_it_later():
    s = _sched(num_blocks=4, block_size=4, budget=64)
    s.add(_req("old", 8))  # 2 blocks
    s.add(_req("new", 8))  # 2 blocks: the pool is now full
    _run_step(s)
    # Both now hold 9 tokens and need a third block each: "new" is preempted so "old" can grow.
    chunks, out = _run_step(s)
    assert out.preempted == ["new"] and chunks == [("old", 8, 1)]
    assert s.waiting[0].request_id == "new" and s.waiting[0].num_computed_tokens == 0
    assert s.num_preemptions == 1


def test_abort_frees_blocks_wherever_the_request_is():
    s = _sched(num_blocks=8, block_size=4, budget=8)
    s.add(_req("running", 12))
    s.add(_req("waiting", 12))
    _run_step(s)
    assert s.kv.pool.num_free_blocks < 8
    assert s.abort("running").finish_reason == "abort"
    assert s.abort("waiting").finish_reason == "abort"
    assert s.abort("unknown") is None and s.abort("running") is None
    assert s.kv.pool.num_free_blocks == 8 and s.num_unfinished == 0 and s.num_aborted == 2


def _prefilled(s, rid, n, first=100):
    """A request whose `n`-token prompt another engine prefilled: its KV in its blocks here, its
    first output sampled there."""
    req = _req(rid, n, first=first)
    assert s.kv.allocate(rid, req.num_prefill_tokens)
    req.append_token(7)
    req.num_computed_tokens = req.num_prefill_tokens
    s.add_running(req)
    return req


def test_prefilled_requests_wait_for_a_sequence_slot_holding_their_blocks_and_join_before_prompts():
    s = _sched(max_num_seqs=2)
    s.add(_req("a", 3))
    s.add(_req("b", 3, first=300))
    _run_step(s)
    _prefilled(s, "p1", 5, first=500)
    _prefilled(s, "p2", 5, first=600)
    s.add(_req("c", 3, first=900))
    # Two running of two slots: the prefilled pair waits (a prompt too), their blocks held.
    assert _run_step(s)[0] == [("a", 3, 1), ("b", 3, 1)]
    assert (len(s.running), s.num_waiting, s.num_unfinished) == (2, 3, 5)
    assert s.kv.block_tables["p1"] and s.kv.block_tables["p2"]
    s.abort("a")
    # A slot frees: the first prefilled request decodes from its first output, before the prompt.
    assert _run_step(s)[0] == [("b", 4, 1), ("p1", 5, 1)]
    s.abort("b")
    assert _run_step(s)[0] == [("p1", 6, 1), ("p2", 5, 1)]
    # An abort while it waits frees its blocks.
    _prefilled(s, "p3", 5, first=700)
    s.abort("p3")
    assert "p3" not in s.kv.block_tables and "p3" not in s.requests and not s.ready


def test_prefilled_requests_that_hold_every_block_with_nothing_running_recompute_the_newest():
    """Nothing running will free a block: the first in line cannot take its next token's block
    while the others hold theirs, so the newest gives its blocks back and recomputes later."""
    s = _sched(num_blocks=4, block_size=4, max_num_seqs=1)
    _prefilled(s, "p1", 8)  # 2 full blocks; its next token needs a third
    _prefilled(s, "p2", 8, first=500)
    tokens, out = _run_step(s)
    assert (tokens, out.preempted) == ([], ["p2"])
    assert list(s.waiting) == [s.requests["p2"]] and "p2" not in s.kv.block_tables
    assert _run_step(s)[0] == [("p1", 8, 1)]
