"""Structured output in the engine (#45): the grammar mask only on the rows that have one, the
matcher advanced with every output and kept across preemption, a prefill hand-over and a resume
(rebuilt by replaying the outputs), compiled once per spec in a bounded cache; and `logit_bias`."""

from __future__ import annotations

import asyncio
import json
import threading

import jsonschema
import pytest
import torch

from pdserve.engine import sampler as sampler_module
from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.engine.grammar import GrammarCompiler, GrammarError, allowed_token_bitmask
from pdserve.engine.llm import LLM
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, needs_only_argmax
from pdserve.engine.sampling_params import SamplingParams, StructuredOutput
from pdserve.errors import InvalidRequestError
from tests.harness.prefilled import prefill_first

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
JSON = StructuredOutput("json", json.dumps(SCHEMA))
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLM(tiny_llama).engine


def _run(engine, request_id, params, prompt=PROMPT, resumed=()):
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    engine.add_request(request_id, ids, params, output_token_ids=resumed)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        assert not engine.take_failed_requests()
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    return outs


def _tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def _text(outs):
    return "".join(o.new_text for o in outs)


def test_sampled_json_follows_its_schema_at_temperature_1(engine):
    for seed in range(6):
        outs = _run(engine, f"json-{seed}", SamplingParams(max_tokens=128, temperature=1.0, seed=seed, structured=JSON))
        assert outs[-1].finish_reason == "stop", _text(outs)
        jsonschema.validate(json.loads(_text(outs)), SCHEMA)
        assert " " not in _text(outs).replace('"', "")[:1]  # no free whitespace by default


def test_regex_choice_and_a_grammar_hold(engine):
    cases = [(StructuredOutput("regex", "[0-9]{3}-[a-z]{2,4}"), r"^[0-9]{3}-[a-z]{2,4}$"),
             (StructuredOutput("choice", json.dumps(["yes", "no", "maybe so"])), r"^(yes|no|maybe so)$"),
             (StructuredOutput("grammar", 'root ::= "ab" [0-9] [0-9]?'), r"^ab[0-9][0-9]?$"),
             (StructuredOutput("json_object"), None)]
    import re

    for i, (spec, pattern) in enumerate(cases):
        for seed in range(3):
            outs = _run(engine, f"c{i}-{seed}", SamplingParams(max_tokens=64, seed=seed, structured=spec))
            assert outs[-1].finish_reason == "stop"
            if pattern is None:
                assert isinstance(json.loads(_text(outs)), dict)
            else:
                assert re.match(pattern, _text(outs)), _text(outs)


def test_cut_by_max_tokens_the_output_is_a_prefix_the_grammar_accepts(engine):
    outs = _run(engine, "cut", SamplingParams(max_tokens=5, seed=1, structured=JSON))
    assert outs[-1].finish_reason == "length" and len(_tokens(outs)) == 5
    m = engine.grammars.matcher(JSON)
    assert all(m.advance(t) for t in _tokens(outs)) and m.error is None


def test_greedy_constrained_output_survives_preemption(tiny_llama, engine):
    params = SamplingParams(max_tokens=60, temperature=0.0, structured=JSON)
    expected = _tokens(_run(engine, "roomy", params))
    small = LLM(tiny_llama, num_kv_blocks=24, block_size=4).engine
    prompts = [engine.tokenizer.encode(f"{PROMPT} {i}") for i in range(4)]
    alone = [_tokens(_run(engine, f"alone-{i}", params, p)) for i, p in enumerate(prompts)]
    for i, p in enumerate(prompts):
        small.add_request(f"p{i}", p, params)
    got: dict[str, list[int]] = {}
    while small.has_unfinished_requests():
        for o in small.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert not small.take_failed_requests()
    assert small.scheduler.num_preemptions > 0
    assert [got[f"p{i}"] for i in range(4)] == alone
    assert expected  # the roomy run finished too


def test_the_matcher_crosses_from_prefill_to_decode_with_the_first_token(tiny_llama, engine):
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=3, structured=JSON)
    whole = _run(engine, "whole", params)
    prefill, decode = LLM(tiny_llama).engine, LLM(tiny_llama).engine
    ids = engine.tokenizer.encode(PROMPT)
    first = prefill_first(prefill, "x", ids, params)
    prefill.release_kv("x")
    _, blocks = decode.add_prefilled_request("x", ids, params, first)
    decode.start_prefilled_request("x", recompute=True)  # no KV copy here: the decode engine recomputes
    outs = [first]
    while decode.has_unfinished_requests():
        outs += decode.step()
    assert _tokens(outs) == _tokens(whole)
    jsonschema.validate(json.loads(_text(whole)), SCHEMA)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=60, temperature=0.0, structured=JSON),
                                    SamplingParams(max_tokens=60, seed=5, structured=JSON)],
                         ids=["greedy", "seeded"])
def test_a_resumed_request_rebuilds_its_matcher_by_replaying_the_outputs(tiny_llama, engine, params):
    whole = _run(engine, "r-whole", params)
    other = LLM(tiny_llama).engine
    tokens = _tokens(whole)
    for k in (1, 3, len(tokens) // 2, len(tokens) - 1):
        rest = _run(other, f"r-{k}", params, resumed=tokens[:k])
        assert _tokens(rest) == tokens[k:]
        assert _text(whole[:k]) + _text(rest) == _text(whole)


def test_resumed_outputs_the_grammar_refuses_are_a_400(engine):
    bad = engine.tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("bad", engine.tokenizer.encode(PROMPT), SamplingParams(max_tokens=30, structured=JSON),
                           output_token_ids=bad)
    assert e.value.param == "output_token_ids"
    assert not engine.has_unfinished_requests()


def test_an_invalid_schema_is_refused_at_admission(engine):
    for spec in (StructuredOutput("json", '{"type": "nope"}'), StructuredOutput("regex", "[0-9"),
                 StructuredOutput("choice", "[]"), StructuredOutput("grammar", "root ::= (")):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("x", [1, 2, 3], SamplingParams(structured=spec))
        assert e.value.param == "structured_outputs"
    assert not engine.has_unfinished_requests()


def test_specs_compile_once_into_a_bounded_cache(engine):
    c = GrammarCompiler(engine.tokenizer.tok.to_str(), engine.arch.vocab_size, engine.eos_token_ids, cache_size=2)
    specs = [StructuredOutput("regex", f"[a-z]{{{i}}}") for i in range(1, 4)]
    for _ in range(3):
        c.matcher(specs[0])
    assert c.num_compiled == 1
    for s in specs:
        c.matcher(s)
    assert c.num_compiled == 3 and not c.is_cached(specs[0]) and c.is_cached(specs[2])
    with pytest.raises(GrammarError):
        c.compile(StructuredOutput("json", "not json"))


def test_prepare_compiles_off_the_event_loop_and_the_step_loop(tiny_llama):
    async_engine = AsyncLLMEngine(LLM(tiny_llama).engine)
    threads = []
    compile_ = async_engine.engine.grammars.compile
    async_engine.engine.grammars.compile = lambda spec: (threads.append(threading.current_thread()), compile_(spec))
    spec = StructuredOutput("regex", "[xyz]{5}")

    async def main():
        stream = await async_engine.generate("g", [1, 2, 3], SamplingParams(max_tokens=10, structured=spec))
        return [o async for o in stream]

    try:
        outs = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert outs[-1].finish_reason == "stop"
    assert threads and all(t is not threading.main_thread() and t.name != "pdserve-engine-loop" for t in threads)


# -- the sampler ---------------------------------------------------------------------------------

def _req(params, engine=None, rid="r"):
    r = Request(rid, [1, 2, 3], params, block_size=16)
    if params.structured is not None:
        r.grammar = engine.grammars.matcher(params.structured)
    return r


def test_the_mask_is_computed_only_for_constrained_rows(engine, monkeypatch):
    vocab = engine.arch.vocab_size
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    spec = StructuredOutput("regex", "[0-9]+")
    reqs = [_req(SamplingParams(temperature=0)), _req(SamplingParams(temperature=0, structured=spec), engine),
            _req(SamplingParams(seed=1)), _req(SamplingParams(seed=2, structured=spec), engine)]
    seen = []

    def spy(rows, num_rows, vocab_size):
        seen.append([i for i, _ in rows])
        return allowed_token_bitmask(rows, num_rows, vocab_size)

    monkeypatch.setattr(sampler_module, "allowed_token_bitmask", spy)
    tokens, _ = Sampler()(logits, reqs)
    assert seen == [[1, 3]]  # one fill for the batch's two constrained rows
    digits = set(engine.tokenizer.encode("0123456789", add_special_tokens=False))
    bitmask = allowed_token_bitmask([(0, engine.grammars.matcher(spec))], 1, vocab)[0]
    allowed = {t for t in range(vocab) if bitmask[t // 32] >> (t % 32) & 1}
    assert tokens[1] in allowed and tokens[3] in allowed
    assert allowed and all(engine.tokenizer.decode([t]).isdigit() for t in allowed)
    unconstrained, _ = Sampler()(logits[[0, 2]], [reqs[0], reqs[2]])
    assert [tokens[0], tokens[2]] == unconstrained  # rows without a grammar are untouched
    assert digits  # the vocabulary has digit tokens for the grammar to allow
    assert not needs_only_argmax([reqs[1]]) and needs_only_argmax([reqs[0]])
    assert logits.isfinite().all()  # the caller's logits are not written


def test_logit_bias_steers_greedy_and_sampled_rows_in_one_batch():
    logits = torch.zeros(3, 50)
    logits[:, 7] = 5.0
    reqs = [_req(SamplingParams(temperature=0, logit_bias={3: 10.0})),
            _req(SamplingParams(temperature=0, logit_bias={7: -100.0})),
            _req(SamplingParams(seed=0, logit_bias={11: 100.0, 12: -100.0}))]
    tokens, _ = Sampler()(logits, reqs)
    assert tokens[0] == 3 and tokens[1] != 7 and tokens[2] == 11
    assert not needs_only_argmax([reqs[0]])
    # Without a bias, the same rows pick token 7.
    assert Sampler()(logits, [_req(SamplingParams(temperature=0))] * 3)[0] == [7, 7, 7]


def test_logit_bias_is_bounded_and_checked_against_the_vocabulary(engine):
    for bias in ({1: 100.5}, {1: float("nan")}, {-1: 1.0}, {True: 1.0}, [(1, 1.0), (1, 2.0)]):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(logit_bias=bias)
        assert e.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("b", [1, 2], SamplingParams(logit_bias={engine.arch.vocab_size: 1.0}))
    assert e.value.param == "logit_bias"
    # Through the engine: a +100 bias makes a greedy run emit the token at every step.
    token = engine.tokenizer.encode("fox", add_special_tokens=False)[0]
    outs = _run(engine, "biased", SamplingParams(max_tokens=4, temperature=0, logit_bias={token: 100.0}))
    assert _tokens(outs) == [token] * 4


def test_masks_are_filled_on_their_own_thread_during_the_forward_pass(engine, monkeypatch):
    threads = []

    def spy(rows, num_rows, vocab_size):
        threads.append(threading.current_thread().name)
        return allowed_token_bitmask(rows, num_rows, vocab_size)

    monkeypatch.setattr(sampler_module, "allowed_token_bitmask", spy)
    outs = _run(engine, "overlap", SamplingParams(max_tokens=40, seed=2, structured=JSON))
    jsonschema.validate(json.loads(_text(outs)), SCHEMA)
    assert len(threads) == len(outs)  # one fill a step
    assert all(name.startswith("pdserve-grammar-masks") for name in threads)
