"""`reasoning_effort`: to the chat template as its variables, as vLLM passes it (the value itself
where the template reads `reasoning_effort`; `enable_thinking` false for "none", true for any
other level, where it reads that), or a 400 naming the field where the template reads neither
or the request's chat_template_kwargs contradict it."""

from __future__ import annotations

import json

import pytest

from pdserve.config import GatewayConfig
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError
from pdserve.gateway.openai_service import OpenAIService
from pdserve.gateway.reasoning_effort import ReasoningEffort, template_variables
from tests.fakes.gateway_client import ScriptedClient, call
from tests.fakes.tool_model import CHAT_TEMPLATE as QWEN3_STYLE, make_tool_model

GPT_OSS_STYLE = "{% for m in messages %}{{ m.content }}{% endfor %}Reasoning: {{ reasoning_effort or 'medium' }}"
BOTH = "{% if enable_thinking %}<think>{% endif %}{{ reasoning_effort }}"
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}"


def test_the_variables_a_template_reads_are_found_by_parsing_it():
    assert {"enable_thinking", "messages", "tools"} <= template_variables(QWEN3_STYLE)
    assert "reasoning_effort" in template_variables(GPT_OSS_STYLE)
    assert template_variables(PLAIN) == {"messages"}
    assert template_variables(None) == template_variables("{% if %}") == frozenset()


@pytest.mark.parametrize("template, effort, kwargs, expected", [
    (QWEN3_STYLE, "none", {}, {"enable_thinking": False}),
    (QWEN3_STYLE, "minimal", {}, {"enable_thinking": True}),
    (QWEN3_STYLE, "high", {"enable_thinking": True, "x": 1}, {"enable_thinking": True, "x": 1}),
    (GPT_OSS_STYLE, "low", {}, {"reasoning_effort": "low"}),
    (BOTH, "none", {}, {"reasoning_effort": "none", "enable_thinking": False}),
    (PLAIN, None, {"x": 1}, {"x": 1}),  # not sent: nothing added, whatever the template
])
def test_an_effort_becomes_the_variables_the_template_reads(template, effort, kwargs, expected):
    assert ReasoningEffort(template).template_kwargs(effort, kwargs) == expected


@pytest.mark.parametrize("template, effort, kwargs", [
    (PLAIN, "high", {}),  # the template cannot honour it
    (PLAIN, "none", {}),
    (QWEN3_STYLE, "none", {"enable_thinking": True}),  # contradicted
    (GPT_OSS_STYLE, "high", {"reasoning_effort": "low"}),
])
def test_an_effort_the_template_cannot_take_is_a_400_naming_it(template, effort, kwargs):
    with pytest.raises(InvalidRequestError) as e:
        ReasoningEffort(template).template_kwargs(effort, kwargs)
    assert e.value.param == "reasoning_effort"


@pytest.fixture(scope="module")
def model(tiny_llama, tmp_path_factory):
    return str(make_tool_model(tiny_llama, tmp_path_factory.mktemp("tool-model")))


def _chat(model, text: str, **body):
    svc = OpenAIService(ScriptedClient([(5, text)], "stop"), Tokenizer(model), "tiny", 1024, GatewayConfig())
    status, raw = call(svc.chat_completions, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, **body})
    sent = svc.client.requests
    prompt = svc.tokenizer.decode(sent[-1].prompt_token_ids, skip_special_tokens=False) if sent else None
    return status, json.loads(raw), prompt


def test_none_closes_the_thinking_section_and_a_level_opens_it(model):
    status, answer, prompt = _chat(model, "weighing it</think>\n\nHello", reasoning_effort="none")
    assert status == 200 and prompt.endswith("<think>\n\n</think>\n\n")
    assert answer["choices"][0]["message"]["content"] == "weighing it</think>\n\nHello"  # no section: content
    status, answer, prompt = _chat(model, "weighing it</think>\n\nHello", reasoning_effort="low")
    assert status == 200 and prompt.endswith("<|im_start|>assistant\n<think>\n")
    message = answer["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("weighing it", "Hello")


@pytest.mark.parametrize("fields", [{"reasoning_effort": "extreme"}, {"reasoning_effort": 3},
                                    {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}])
def test_a_bad_or_contradicted_effort_is_a_400_before_any_work(model, fields):
    status, answer, prompt = _chat(model, "x", **fields)
    assert status == 400 and answer["error"]["param"] == "reasoning_effort", answer
    assert prompt is None
