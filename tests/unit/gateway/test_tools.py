"""Tool calling and reasoning through the chat route (#45), on a Qwen3-style test model and the
scripted pools: tools reach the chat template; `required` and a named function become a grammar
whose outputs parse into calls with schema-valid arguments; a scripted call is `tool_calls`
with `finish_reason: "tool_calls"`, streamed deltas join to the response's; history with
tool calls and tool messages renders; a thinking model's reasoning splits off and the grammar
follows it; bad input is a 400 naming its field before any work."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.config import GatewayConfig
from pdserve.engine.grammar import GrammarCompiler
from pdserve.engine.sampling_params import StructuredOutput
from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.openai_service import OpenAIService
from pdserve.gateway.protocol import ChatCompletionRequest
from pdserve.gateway.tool_calls import parse_tool_calls
from pdserve.gateway.tools import ToolCalling, tool_format
from tests.fakes.gateway_client import ScriptedClient, call
from tests.fakes.mistral_tool_model import CHAT_TEMPLATE as MISTRAL_TEMPLATE
from tests.fakes.mistral_tool_model import make_mistral_tool_model
from tests.fakes.tool_model import CHAT_TEMPLATE, make_tool_model

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}
DAYS = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather now", "parameters": CITY}},
         {"type": "function", "function": {"name": "forecast", "parameters": DAYS}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model(tiny_llama, tmp_path_factory):
    return str(make_tool_model(tiny_llama, tmp_path_factory.mktemp("tool-model")))


def service(model, text: str, finish_reason: str = "stop", **gateway) -> OpenAIService:
    steps = [(5, text[i:i + 4]) for i in range(0, len(text), 4)]
    return OpenAIService(ScriptedClient(steps, finish_reason), Tokenizer(model), "tiny", 1024,
                         GatewayConfig(**gateway))


def chat(svc, **body):
    status, raw = call(svc.chat_completions, "/v1/chat/completions", {"messages": ASK, "max_tokens": 64, **body})
    if body.get("stream"):
        assert status == 200, raw
        return [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    return status, json.loads(raw)


def test_the_format_comes_from_the_template_or_the_setting():
    assert tool_format("auto", CHAT_TEMPLATE) == "hermes"
    assert tool_format("auto", "{{ '[TOOL_CALLS]' }}") == "mistral"
    assert tool_format("auto", MISTRAL_TEMPLATE) == "mistral"
    assert tool_format("auto", "{{ '<|python_tag|>' }}") == "llama3_json"
    assert tool_format("auto", "{{ messages }}") is None
    assert tool_format("llama3_json", CHAT_TEMPLATE) == "llama3_json"
    assert tool_format("none", CHAT_TEMPLATE) is None


def test_tools_reach_the_template_and_a_scripted_call_is_tool_calls(model):
    svc = service(model, "Checking.\n" + CALL)
    status, answer = chat(svc, tools=TOOLS)
    assert status == 200, answer
    prompt = svc.tokenizer.decode(svc.client.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert json.dumps(TOOLS[0]) in prompt and '"name": "forecast"' in prompt
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [tc] = choice["message"]["tool_calls"]
    assert tc["type"] == "function" and tc["id"].startswith("call_")
    assert tc["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert choice["message"]["content"] == "Checking."
    assert svc.client.requests[-1].params.structured is None  # auto: the model decides


def test_streamed_deltas_join_to_the_response(model):
    svc = service(model, "Checking.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"))
    _, whole = chat(svc, tools=TOOLS)
    chunks = chat(svc, tools=TOOLS, stream=True)
    content, calls = "", {}
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        for d in delta.get("tool_calls", ()):
            if "id" in d:
                calls[d["index"]] = {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}
                assert d["type"] == "function"
            else:
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    message = whole["choices"][0]["message"]
    assert content == message["content"]
    assert [calls[i] for i in sorted(calls)] == [c["function"] for c in message["tool_calls"]]
    assert len(calls) == 2 and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("choice, names", [("required", {"weather", "forecast"}),
                                            ({"type": "function", "function": {"name": "forecast"}}, {"forecast"})])
def test_required_and_named_choices_are_a_grammar_whose_outputs_are_valid_calls(model, choice, names):
    svc = service(model, CALL)
    status, _ = chat(svc, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    assert status == 200
    spec = svc.client.requests[-1].params.structured
    assert spec.kind == "grammar" and not spec.reasoning
    tok = svc.tokenizer
    compiler = GrammarCompiler(tok.tok.to_str(), tok.vocab_size, [tok.eos_token_id])
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    good = {"weather": '{"city":"Paris"}', "forecast": '{"days":3}'}
    for name in ("weather", "forecast"):
        text = f'<tool_call>\n{{"name":"{name}","arguments":{good[name]}}}\n</tool_call>'
        matcher = compiler.matcher(spec)
        accepted = all(matcher.advance(t) for t in tok.encode(text, add_special_tokens=False))
        assert (accepted and matcher.is_accepting) == (name in names), name
        if accepted:
            [tc] = parse_tool_calls(text, "hermes")[1]
            jsonschema.validate(json.loads(tc["function"]["arguments"]), schemas[tc["function"]["name"]])
    for bad in ('<tool_call>\n{"name":"weather","arguments":{"city":"Far too long a name"}}\n</tool_call>',
                '<tool_call>\n{"name":"forecast","arguments":{"days":9}}\n</tool_call>', "Sure!"):
        matcher = compiler.matcher(spec)
        assert not (all(matcher.advance(t) for t in tok.encode(bad, add_special_tokens=False))
                    and matcher.is_accepting)


def test_a_round_trip_with_tool_calls_and_a_tool_message_renders(model):
    svc = service(model, "It is sunny.")
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    status, answer = chat(svc, tools=TOOLS, messages=history)
    assert status == 200, answer
    message = answer["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "It is sunny.", "reasoning_content": None}
    assert answer["choices"][0]["finish_reason"] == "stop"
    prompt = svc.tokenizer.decode(svc.client.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert '{"name": "weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


def test_reasoning_splits_off_and_the_grammar_follows_it(model):
    svc = service(model, "I should call it.</think>\n\n" + CALL)
    status, answer = chat(svc, tools=TOOLS, tool_choice="required", chat_template_kwargs={"enable_thinking": True})
    assert status == 200, answer
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"] == "I should call it." and message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "weather"
    spec = svc.client.requests[-1].params.structured
    assert spec.reasoning == "open"
    tok = svc.tokenizer
    compiler = GrammarCompiler(tok.tok.to_str(), tok.vocab_size, [tok.eos_token_id])
    call_text = '<tool_call>\n{"name":"weather","arguments":{"city":"Oslo"}}\n</tool_call>'
    for text, valid in [("free <b>text</b>, even <tool_call></think>\n\n" + call_text, True),
                        ("</think>" + call_text, True), ("thinking</think>Sure!", False), (call_text, False)]:
        matcher = compiler.matcher(spec)  # free up to the first </think>, then the call's grammar
        ok = all(matcher.advance(t) for t in tok.encode(text, add_special_tokens=False)) and matcher.is_accepting
        assert ok == valid, text
    chunks = chat(svc, tools=TOOLS, tool_choice="required", chat_template_kwargs={"enable_thinking": True},
                  stream=True)
    assert "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks) == "I should call it."
    # Thinking off (the template closes an empty section): no reasoning, the grammar starts at once.
    status, answer = chat(svc, tools=TOOLS, tool_choice="required")
    assert svc.client.requests[-1].params.structured.reasoning == ""
    assert chat(service(model, "plain", reasoning_parser="none"), tools=TOOLS)[1]["choices"][0]["message"] == \
        {"role": "assistant", "content": "plain"}


def test_a_response_format_follows_the_reasoning_section_too(model):
    svc = service(model, "hmm</think>{}")
    status, answer = chat(svc, response_format={"type": "json_object"}, chat_template_kwargs={"enable_thinking": True})
    assert status == 200 and answer["choices"][0]["message"]["content"] == "{}"
    assert svc.client.requests[-1].params.structured.reasoning == "open"


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]}, "messages"),
    ({"chat_template_kwargs": {"messages": "x"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"deep": {"x": 1}}}, "chat_template_kwargs"),
])
def test_bad_tool_input_is_a_400_naming_its_field_before_any_work(model, fields, param):
    svc = service(model, CALL)
    status, answer = chat(svc, **fields)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert not svc.client.requests


def test_a_model_without_a_tool_format_refuses_tools_by_name(model):
    svc = service(model, CALL, tool_call_parser="none")
    status, answer = chat(svc, tools=TOOLS)
    assert status == 400 and answer["error"]["param"] == "tools"
    assert chat(svc, tools=TOOLS, tool_choice="none")[0] == 200  # no call asked for: tools are left out


@pytest.fixture(scope="module")
def mistral_model(tiny_llama, tmp_path_factory):
    return str(make_mistral_tool_model(tiny_llama, tmp_path_factory.mktemp("mistral-tool-model")))


def _accepts(compiler, tok, spec, text: str) -> bool:
    matcher = compiler.matcher(spec)
    return all(matcher.advance(t) for t in tok.encode(text, add_special_tokens=False)) and matcher.is_accepting


@pytest.mark.parametrize("v11", [True, False], ids=["name[ARGS]", "json-list"])
def test_mistral_required_and_named_grammars_write_the_form_the_template_uses(model, mistral_model, v11):
    """v11 (the template writes [ARGS], a special token as [TOOL_CALLS] is): the grammar names both
    by id and writes name[ARGS]{...} per call; older tokenizers (no [ARGS]): a JSON list of calls."""
    tok = Tokenizer(mistral_model if v11 else model)
    tools = ToolCalling("auto" if v11 else "mistral", tok)
    assert (tools.fmt, tools.is_mistral_v11) == ("mistral", v11)
    assert (tools.marker_id is not None, tools.args_id is not None) == (v11, v11)
    compiler = GrammarCompiler(tok.tok.to_str(), tok.vocab_size, [tok.eos_token_id])
    if v11:
        weather, forecast = '[TOOL_CALLS]weather[ARGS]{"city":"Paris"}', '[TOOL_CALLS]forecast[ARGS]{"days":3}'
    else:
        weather = '[TOOL_CALLS][{"name":"weather","arguments":{"city":"Paris"}}]'
        forecast = '[TOOL_CALLS][{"name":"forecast","arguments":{"days":3}}]'
    both = weather + forecast if v11 else weather[:-1] + "," + forecast[len("[TOOL_CALLS]["):]
    names = {weather: ["weather"], forecast: ["forecast"], both: ["weather", "forecast"]}
    for body, accepted in ((dict(tool_choice="required"), {weather, forecast, both}),
                           (dict(tool_choice="required", parallel_tool_calls=False), {weather, forecast}),
                           (dict(tool_choice={"type": "function", "function": {"name": "forecast"}}), {forecast})):
        plan = tools.plan(ChatCompletionRequest(messages=ASK, tools=TOOLS, **body))
        assert plan.keeps_special_tokens == v11
        spec = StructuredOutput("grammar", plan.grammar)
        for text in (weather, forecast, both, weather.replace("Paris", "Far too long a name"), "Sure!"):
            assert _accepts(compiler, tok, spec, text) == (text in accepted), (body, text)
            if text in accepted:
                calls = parse_tool_calls(text, "mistral")[1]
                assert [c["function"]["name"] for c in calls] == names[text]


def test_a_mistral_call_is_read_with_its_special_tokens_kept(mistral_model):
    svc = service(mistral_model, 'Let me check.[TOOL_CALLS]weather[ARGS]{"city": "Paris"}')
    status, answer = chat(svc, tools=TOOLS)
    assert status == 200, answer
    assert svc.client.requests[-1].params.skip_special_tokens is False  # [TOOL_CALLS] and [ARGS] are special
    choice = answer["choices"][0]
    assert choice["message"]["content"] == "Let me check." and choice["finish_reason"] == "tool_calls"
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "weather", "arguments": '{"city": "Paris"}'}]
    prompt = svc.tokenizer.decode(svc.client.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert prompt.startswith("<s>[AVAILABLE_TOOLS][") and prompt.endswith("[INST]Weather in Paris?[/INST]")
