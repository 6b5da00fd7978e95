"""Tool calling and reasoning over the OpenAI API (#45), with the official `openai` client, on an
app of its own (disaggregated: long prompts are prefilled remotely, so each grammar's first step
crosses from the prefill replica) serving a Qwen3-style test model (`tests/fakes/tool_model.py`:
the tiny checkpoint's weights, a chat template with tools and thinking, `</think>` one token).

- `required` and a named function, sampled at temperature 1 under several seeds, always give a
  parseable call whose arguments validate against the tool's schema (`jsonschema`).
- `auto` reads the model's free output. The random weights never write a call on their own, so
  the request constrains the output to one call's text with `guided_regex`: the parser is not
  told, and reads it as it would read a model trained to call (the constraint stands in for the
  weights; the call's arguments vary with the seed). Streamed deltas join to the response's call.
- A round trip (the call, then a `tool` message with its result) is answered.
- A Mistral v11 test model (`tests/fakes/mistral_tool_model.py`: `[AVAILABLE_TOOLS]`,
  `[TOOL_CALLS]name[ARGS]{...}`, `[TOOL_RESULTS]`, weights that write a call) on a colocated app:
  under `auto` it calls by itself, the stream joins to the same call, a `tool` message back gets
  its answer, and a named choice (a grammar in v11's form) gives a valid call.
- `reasoning_effort` reaches the template as `enable_thinking` (on for a level, off for "none");
  a model whose template reads neither it nor `enable_thinking` answers 400 naming it.
- Reasoning: with thinking on (the template opens `<think>`) and `logit_bias` (+18) making `</think>`
  likely, the section comes back as `reasoning_content`, the rest as `content`, and a regex
  constraint holds for the content after it; a stream agrees with the response.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from pdserve.config import ServeConfig
from tests.e2e.conftest import App, POOL
from tests.fakes.mistral_tool_model import ANSWER, CALL_ARGUMENTS, CALL_NAME, make_mistral_tool_model
from tests.fakes.tool_model import END_THINK_ID, make_tool_model

ENGINE = {"num_threads": 1, "num_kv_blocks": 256, "block_size": 16, "max_model_len": 1024, "max_num_seqs": 16,
          "max_num_batched_tokens": 1024}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
FORECAST = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7},
                                             "hourly": {"type": "boolean"}},
            "required": ["days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "forecast", "parameters": FORECAST}}]
SCHEMAS = {"weather": WEATHER, "forecast": FORECAST}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SEEDS = (0, 1, 2, 3)
# One call's text, as the test model's template asks for it; the city varies with the seed.
CALL_REGEX = (r'<tool_call>\n\{"name": "weather", "arguments": \{"city": "[A-Z][a-z]{1,6}", "unit": "c"\}\}'
              r"\n</tool_call>")


@pytest.fixture(scope="module")
def tools_app(serve_apps, tiny_llama, tmp_path_factory):
    from ray import serve

    from pdserve.app import build

    model = make_tool_model(tiny_llama, tmp_path_factory.mktemp("models") / "tool-model")
    cfg = ServeConfig(name="tools", model=str(model), engine=ENGINE, prefill=POOL, decode=POOL,
                      transfer={"host": "127.0.0.1", "lease_s": 20})
    serve.run(build(cfg), name="tools", route_prefix="/tools")
    yield App("tools", f"{serve_apps['base']}/tools", "tool-model", "unused", ["Prefill", "Decode"])
    serve.delete("tools")


def _valid_calls(message, names: set[str]) -> list[tuple[str, dict]]:
    calls = []
    for tc in message.tool_calls or ():
        assert tc.type == "function" and tc.id.startswith("call_") and tc.function.name in names
        args = json.loads(tc.function.arguments)
        jsonschema.validate(args, SCHEMAS[tc.function.name])
        calls.append((tc.function.name, args))
    return calls


@pytest.mark.parametrize("choice, names", [
    ("required", {"weather", "forecast"}),
    ({"type": "function", "function": {"name": "forecast"}}, {"forecast"}),
], ids=["required", "named"])
def test_required_and_named_choices_always_give_a_valid_call(tools_app, choice, names):
    for seed in SEEDS:
        r = tools_app.client.chat.completions.create(
            model=tools_app.model, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
            temperature=1.0, seed=seed, max_tokens=120)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", (seed, c)
        assert len(_valid_calls(c.message, names)) == 1 and not c.message.content


def test_required_with_parallel_calls_gives_valid_calls(tools_app):
    r = tools_app.client.chat.completions.create(
        model=tools_app.model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=5,
        max_tokens=300)
    c = r.choices[0]
    if c.finish_reason == "tool_calls":  # else length cut a later call: the complete ones still parse
        assert _valid_calls(c.message, set(SCHEMAS))
    else:
        assert c.finish_reason == "length" and c.message.tool_calls


def _joined_stream(chunks) -> tuple[str, list[dict], str | None]:
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or ():
            if d.id is not None:
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                calls[d.index]["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_auto_reads_a_call_from_free_output_and_a_stream_joins_to_the_same_call(tools_app):
    for seed in SEEDS[:2]:
        kwargs = dict(model=tools_app.model, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=1.0,
                      seed=seed, max_tokens=120, extra_body={"guided_regex": CALL_REGEX})
        whole = tools_app.client.chat.completions.create(**kwargs)
        c = whole.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        [(name, args)] = _valid_calls(c.message, {"weather"})
        content, calls, finish = _joined_stream(tools_app.client.chat.completions.create(stream=True, **kwargs))
        assert content == "" and finish == "tool_calls"
        assert [(x["name"], x["arguments"]) for x in calls] == [(name, c.message.tool_calls[0].function.arguments)]


def test_a_round_trip_with_a_tool_message(tools_app):
    first = tools_app.client.chat.completions.create(
        model=tools_app.model, messages=ASK, tools=TOOLS, tool_choice={"type": "function",
                                                                      "function": {"name": "weather"}},
        temperature=1.0, seed=0, max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = tools_app.client.chat.completions.create(
        model=tools_app.model, messages=history, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=1.0, seed=1, max_tokens=120)
    assert second.choices[0].finish_reason == "tool_calls" and len(_valid_calls(second.choices[0].message,
                                                                                set(SCHEMAS))) == 1
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt
    answer = tools_app.client.chat.completions.create(model=tools_app.model, messages=history, tools=TOOLS,
                                                      temperature=0, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_tool_input_is_a_400_naming_its_field(tools_app):
    for fields, param in [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                           "tool_choice"),
                          ({"tool_choice": "required"}, "tool_choice"),
                          ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools")]:
        with pytest.raises(openai.BadRequestError) as e:
            tools_app.client.chat.completions.create(model=tools_app.model, messages=ASK, max_tokens=4, **fields)
        assert e.value.body["param"] == param


def test_reasoning_comes_back_apart_and_the_constraint_holds_after_it(tools_app):
    content_regex = r"[a-z]{2,6}( [a-z]{2,6}){0,2}"
    for seed in SEEDS[:3]:
        kwargs = dict(model=tools_app.model, messages=ASK, temperature=1.0, seed=seed, max_tokens=80,
                      logit_bias={str(END_THINK_ID): 18},
                      extra_body={"guided_regex": content_regex, "chat_template_kwargs": {"enable_thinking": True}})
        whole = tools_app.client.chat.completions.create(**kwargs)
        c = whole.choices[0]
        assert c.finish_reason == "stop", (seed, c)
        assert re.fullmatch(content_regex, c.message.content)
        assert isinstance(c.message.reasoning_content, str) and "</think>" not in c.message.reasoning_content
        chunks = [x for x in tools_app.client.chat.completions.create(stream=True, **kwargs) if x.choices]
        assert "".join(getattr(x.choices[0].delta, "reasoning_content", None) or "" for x in chunks) == \
            c.message.reasoning_content
        assert "".join(x.choices[0].delta.content or "" for x in chunks) == c.message.content
    # Unconstrained, the split is the same: everything before the first </think> is reasoning.
    kwargs = dict(model=tools_app.model, messages=ASK, temperature=1.0, seed=9, max_tokens=30,
                  logit_bias={str(END_THINK_ID): 18}, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    whole = tools_app.client.chat.completions.create(**kwargs).choices[0].message
    assert isinstance(whole.reasoning_content, str)
    chunks = [x for x in tools_app.client.chat.completions.create(stream=True, **kwargs) if x.choices]
    assert "".join(getattr(x.choices[0].delta, "reasoning_content", None) or "" for x in chunks) == \
        whole.reasoning_content
    assert "".join(x.choices[0].delta.content or "" for x in chunks) == whole.content
    tools_app.wait_for_idle()


def test_reasoning_effort_turns_thinking_on_or_off_and_a_template_without_it_refuses(tools_app, serve_apps):
    """The test model's template reads enable_thinking: "low" opens the section, "none" closes it
    (the same logit_bias then makes no reasoning); tiny-llama's template reads neither: 400."""
    kwargs = dict(model=tools_app.model, messages=ASK, temperature=1.0, seed=4, max_tokens=30,
                  logit_bias={str(END_THINK_ID): 18})
    thinking = tools_app.client.chat.completions.create(reasoning_effort="low", **kwargs)
    assert isinstance(thinking.choices[0].message.reasoning_content, str)
    plain = tools_app.client.chat.completions.create(reasoning_effort="none", **kwargs)
    assert plain.choices[0].message.reasoning_content is None
    assert plain.usage.prompt_tokens > thinking.usage.prompt_tokens  # the closed, empty section
    colo = serve_apps["colo"]
    with pytest.raises(openai.BadRequestError) as e:
        colo.client.chat.completions.create(model=colo.model, messages=ASK, max_tokens=4, reasoning_effort="high")
    assert e.value.body["param"] == "reasoning_effort"

@pytest.fixture(scope="module")
def mistral_app(serve_apps, tiny_llama, tmp_path_factory):
    from ray import serve

    from pdserve.app import build

    model = make_mistral_tool_model(tiny_llama, tmp_path_factory.mktemp("models") / "mistral-tool-model")
    cfg = ServeConfig(name="mistral-tools", model=str(model), engine=ENGINE, mode="colocated", decode=POOL)
    serve.run(build(cfg), name="mistral-tools", route_prefix="/mistral-tools")
    yield App("mistral-tools", f"{serve_apps['base']}/mistral-tools", "mistral-tool-model", "unused", ["Unified"])
    serve.delete("mistral-tools")


def test_a_mistral_model_calls_by_itself_streams_the_same_call_and_answers_a_tool_message(mistral_app):
    client, model = mistral_app.client, mistral_app.model
    whole = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=40)
    c = whole.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    assert _valid_calls(c.message, {"weather"}) == [(CALL_NAME, json.loads(CALL_ARGUMENTS))]
    assert c.message.tool_calls[0].function.arguments == CALL_ARGUMENTS  # the model's text, as written
    content, calls, finish = _joined_stream(client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=40, stream=True))
    assert (content, finish) == ("", "tool_calls")
    assert [(x["name"], x["arguments"]) for x in calls] == [(CALL_NAME, CALL_ARGUMENTS)]

    history = ASK + [c.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": c.message.tool_calls[0].id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model=model, messages=history, tools=TOOLS, temperature=0,
                                            max_tokens=40)
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.content == ANSWER
    assert not answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > whole.usage.prompt_tokens  # the call and its result are in the prompt


def test_a_mistral_named_choice_gives_a_valid_call(mistral_app):
    for seed in SEEDS[:2]:
        r = mistral_app.client.chat.completions.create(
            model=mistral_app.model, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=60,
            tool_choice={"type": "function", "function": {"name": "forecast"}})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", (seed, c)
        assert [name for name, _ in _valid_calls(c.message, {"forecast"})] == ["forecast"]
