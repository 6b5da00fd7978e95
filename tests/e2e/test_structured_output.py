"""Structured output over the OpenAI API (#45), on the disaggregated and the colocated app, with the
official `openai` client: 20 JSON schemas sampled at temperature 1 under several seeds validate
(`jsonschema`) whenever they finish with `stop`, and at least 80% do within 256 tokens; an output
cut by `length` is a prefix its grammar accepts; regex and choice constraints always hold; a
stream equals the response for a seed; greedy constrained output is the offline engine's, with a
remote prefill (the grammar's state crosses with the first token) and under forced preemption."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from pdserve.engine.grammar import GrammarCompiler
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams, StructuredOutput
from pdserve.engine.tokenizer import Tokenizer
from tests.e2e.conftest import ENGINE


def _object(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _str(max_length: int, **kw) -> dict:
    return {"type": "string", "maxLength": max_length, **kw}


# Nested objects, arrays, enums, required fields, numbers with bounds, strings with patterns and
# lengths; every string and array bounded.
SCHEMAS = [
    _object({"name": _str(10), "age": _int(0, 120)}),
    _object({"color": {"enum": ["red", "green", "blue"]}}),
    _object({"user": _object({"id": _int(1, 9999), "name": _str(8)})}),
    _object({"digits": {"type": "array", "items": _int(0, 9), "minItems": 1, "maxItems": 4}}),
    _object({"points": {"type": "array", "maxItems": 3, "items": _object({"x": _int(-5, 5), "y": _int(-5, 5)})}}),
    _object({"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 5}}),
    _object({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    _object({"word": _str(6, minLength=2)}),
    _object({"p": {"type": "number", "minimum": 0, "maximum": 1},
             "t": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}}),
    _object({"kind": {"const": "point"}, "x": _int(0, 10)}),
    _object({"v": {"anyOf": [_int(0, 50), _str(4)]}}),
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 5},
    _object({"a": _object({"b": _object({"c": _int(0, 3)})})}),
    _object({"level": {"enum": [1, 2, 3]}, "tag": {"enum": ["x", "y", None]}}),
    _object({"a": _int(0, 9), "b": _str(3)}, required=["a"]),
    _object({"grid": {"type": "array", "maxItems": 2, "items": {"type": "array", "items": {"type": "boolean"},
                                                                "maxItems": 2}}}),
    _object({"day": {"type": "string", "format": "date"}}),
    _object({"id": {"type": "string", "pattern": "^[a-f0-9]{8}$"}}),
    _object({"title": _str(6), "count": _int(0, 99), "done": {"type": "boolean"},
             "tags": {"type": "array", "items": _str(3), "maxItems": 2},
             "score": {"type": "number", "minimum": -1, "maximum": 1}, "kind": {"enum": ["a", "b"]}}),
    {"enum": ["yes", "no", "maybe"]},
]
SEEDS = (0, 1, 2)
PROMPT = "Reply with JSON only."
LONG = ("In a distant land, the old lighthouse keeper wrote letters to the sea every evening, "
        "and the sea, patient as ever, answered with the tide")  # > 24 tokens: prefilled remotely


@pytest.fixture(scope="module")
def grammars(tiny_llama):
    tok = Tokenizer(tiny_llama)
    return tok, GrammarCompiler(tok.tok.to_str(), tok.vocab_size, [tok.eos_token_id])


def _accepts_prefix(grammars, spec: StructuredOutput, text: str) -> bool:
    tok, compiler = grammars
    matcher = compiler.matcher(spec)
    return all(matcher.advance(t) for t in tok.encode(text.rstrip("\ufffd"), add_special_tokens=False))


def _aclient(app) -> openai.AsyncOpenAI:
    """A client of this event loop's own (one bound to an earlier `asyncio.run` loop fails)."""
    return openai.AsyncOpenAI(base_url=f"{app.base}/v1", api_key=app.api_key, max_retries=0, timeout=120)


async def _sample_all(app):
    """Every schema under every seed at temperature 1, half through chat's response_format and half
    through completions' guided_json, all at once."""
    aclient = _aclient(app)

    async def one(i: int, seed: int):
        schema = SCHEMAS[i]
        if (i + seed) % 2:
            r = await aclient.chat.completions.create(
                model=app.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=256, temperature=1.0,
                seed=seed, response_format={"type": "json_schema",
                                            "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
            return i, r.choices[0].message.content, r.choices[0].finish_reason
        r = await aclient.completions.create(model=app.model, prompt=PROMPT, max_tokens=256, temperature=1.0,
                                                 seed=seed, extra_body={"guided_json": schema})
        return i, r.choices[0].text, r.choices[0].finish_reason

    async with aclient:
        return await asyncio.gather(*(one(i, seed) for i in range(len(SCHEMAS)) for seed in SEEDS))


def test_json_schemas_sampled_at_temperature_1_validate(app, grammars):
    results = asyncio.run(_sample_all(app))
    stopped = 0
    for i, text, finish in results:
        if finish == "stop":
            stopped += 1
            jsonschema.validate(json.loads(text), SCHEMAS[i])
        else:
            assert finish == "length"
            spec = StructuredOutput("json", json.dumps(SCHEMAS[i], separators=(",", ":")))
            assert _accepts_prefix(grammars, spec, text), (i, text)
    assert stopped >= 0.8 * len(results), f"{stopped} of {len(results)} finished with stop"
    app.wait_for_idle()


def test_an_output_cut_by_length_is_a_prefix_the_grammar_accepts(app, grammars):
    schema = SCHEMAS[18]
    for seed in SEEDS:
        r = app.client.completions.create(model=app.model, prompt=PROMPT, max_tokens=6, seed=seed,
                                          extra_body={"guided_json": schema})
        assert r.choices[0].finish_reason == "length"
        spec = StructuredOutput("json", json.dumps(schema, separators=(",", ":")))
        assert _accepts_prefix(grammars, spec, r.choices[0].text)


def test_regex_and_choice_always_hold(app):
    choices = ["alpha", "beta gamma", "delta!"]
    for seed in range(4):
        r = app.client.completions.create(model=app.model, prompt=PROMPT, max_tokens=40, seed=seed,
                                          extra_body={"guided_regex": r"[A-Z]{2}[0-9]{3}(-[a-z]{1,3})?"})
        assert re.fullmatch(r"[A-Z]{2}[0-9]{3}(-[a-z]{1,3})?", r.choices[0].text)
        assert r.choices[0].finish_reason == "stop"
        c = app.client.chat.completions.create(model=app.model, messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=40, seed=seed,
                                               extra_body={"structured_outputs": {"choice": choices}})
        assert c.choices[0].message.content in choices and c.choices[0].finish_reason == "stop"


def test_a_stream_equals_the_response_for_a_seed(app):
    fmt = {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMAS[18]}}
    kwargs = dict(model=app.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=256, seed=11,
                  response_format=fmt)
    whole = app.client.chat.completions.create(**kwargs)
    chunks = list(app.client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMAS[18])


def test_an_invalid_schema_is_a_400_naming_its_field(app):
    with pytest.raises(openai.BadRequestError) as e:
        app.client.chat.completions.create(
            model=app.model, messages=[{"role": "user", "content": PROMPT}],
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nope"}}})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        app.client.completions.create(model=app.model, prompt=PROMPT, extra_body={"guided_regex": "(["})
    assert e.value.body["param"] == "guided_regex"


def test_greedy_constrained_output_is_the_offline_engines_remote_prefilled_and_preempted(serve_apps, tiny_llama):
    """The same greedy constrained request: offline, on the colocated app, on the disaggregated
    app with its prompt prefilled remotely (the first token and so the grammar's first step come
    from the prefill replica), and there again while long requests force preemptions."""
    schema = SCHEMAS[0]
    offline = LLM(tiny_llama, block_size=ENGINE["block_size"], num_kv_blocks=256)
    spec = StructuredOutput("json", json.dumps(schema, separators=(",", ":")))
    expected = offline.generate([LONG], SamplingParams(max_tokens=80, temperature=0, structured=spec))[0].text
    jsonschema.validate(json.loads(expected), schema)
    body = dict(prompt=LONG, max_tokens=80, temperature=0, extra_body={"guided_json": schema})

    colo, disagg = serve_apps["colo"], serve_apps["disagg"]
    assert colo.client.completions.create(model=colo.model, **body).choices[0].text == expected
    before = disagg.stats("Decode")
    assert disagg.client.completions.create(model=disagg.model, **body).choices[0].text == expected
    assert disagg.stats("Decode")["num_remote_prefills"] == before["num_remote_prefills"] + 1

    async def under_pressure():
        # 12 x ~230 tokens against a cache of 192 x 8: the newest running requests are preempted.
        aclient = _aclient(disagg)
        fillers = [aclient.completions.create(model=disagg.model, prompt=f"{i} {LONG}", max_tokens=200,
                                                     temperature=0, extra_body={"ignore_eos": True})
                   for i in range(12)]
        tasks = [asyncio.ensure_future(f) for f in fillers]
        await asyncio.sleep(0.5)
        constrained = [aclient.completions.create(model=disagg.model, **body) for _ in range(3)]
        async with aclient:
            results = await asyncio.gather(*constrained, *tasks)
        return [r.choices[0].text for r in results[:3]]

    for text in asyncio.run(under_pressure()):
        assert text == expected
    assert disagg.stats("Decode")["num_preemptions"] > before["num_preemptions"]
    disagg.wait_for_idle()
