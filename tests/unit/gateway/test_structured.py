"""The gateway's output constraints and output-changing fields (#45): `response_format`, vLLM's
`guided_*` and `structured_outputs` become one `StructuredOutput` in every sequence's sampling
parameters; a bad or oversized constraint, two constraints, `best_of` other than `n` and the
OpenAI fields not implemented are 400s naming their field, before anything reaches a pool;
`logit_bias` reaches the sampling parameters; metadata fields are accepted."""

from __future__ import annotations

import json

import pytest

from pdserve.config import GatewayConfig
from pdserve.engine.sampling_params import StructuredOutput
from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.openai_service import OpenAIService
from tests.fakes.gateway_client import ScriptedClient, call

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def service(tiny_llama):
    service = OpenAIService(ScriptedClient([(5, "a"), (6, "b")]), Tokenizer(tiny_llama), "tiny", 256,
                            GatewayConfig(max_structured_output_chars=2000))
    yield service
    service.close()


def post(service, path, body):
    route = {"/v1/completions": service.completions, "/v1/chat/completions": service.chat_completions}[path]
    before = len(service.client.requests)
    status, raw = call(route, path, body)
    return status, json.loads(raw), service.client.requests[before:]


def _body(path, **fields):
    base = {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "hi"}
    return {**base, "max_tokens": 8, **fields}


ROUTES = ["/v1/completions", "/v1/chat/completions"]
COMPACT = json.dumps(SCHEMA, separators=(",", ":"))


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutput("json", COMPACT)),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": SCHEMA}, StructuredOutput("json", COMPACT)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput("json", COMPACT)),
    ({"guided_regex": "[0-9]+"}, StructuredOutput("regex", "[0-9]+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutput("choice", '["yes", "no"]')),
    ({"guided_grammar": 'root ::= "a"+'}, StructuredOutput("grammar", 'root ::= "a"+')),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False}},
     StructuredOutput("json", COMPACT, any_whitespace=True)),
    ({"structured_outputs": {"choice": ["x"]}}, StructuredOutput("choice", '["x"]')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
], ids=["json_schema", "json_object", "text", "guided_json", "guided_json_text", "regex", "choice", "grammar",
        "so_json_whitespace", "so_choice", "so_json_object"])
def test_each_constraint_reaches_every_sequence(service, path, fields, expected):
    status, answer, sent = post(service, path, _body(path, n=2, **fields))
    assert status == 200, answer
    assert [r.params.structured for r in sent] == [expected, expected]


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"properties": {"a": {"$ref": "#/nowhere"}}}}, "guided_json"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"guided_regex": "a" * 2001}, "guided_regex"),
    ({"guided_json": {"enum": ["x" * 50] * 50}}, "guided_json"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
], ids=["bad_schema", "no_schema", "bad_type", "bad_json", "bad_ref", "bad_regex", "no_choice", "bad_grammar",
        "so_bad_regex", "so_unknown_key", "two_constraints", "format_and_guided", "regex_too_long",
        "schema_too_long", "bias_value", "bias_token"])
def test_a_bad_constraint_is_a_400_naming_it_before_any_work(service, path, fields, param):
    status, answer, sent = post(service, path, _body(path, **fields))
    assert status == 400 and answer["error"]["param"] == param, answer
    assert not sent


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"best_of": 2, "n": 1}, "best_of"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"web_search_options": {}}, None),  # empty: asks for nothing
])
def test_output_changing_fields_not_implemented_are_refused_by_name(service, path, fields, param):
    status, answer, sent = post(service, path, _body(path, **fields))
    if param is None:
        assert status == 200 and sent
        return
    assert status == 400 and answer["error"]["param"] == param, answer
    assert not sent


@pytest.mark.parametrize("fields, param, reason", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool"),  # tiny-llama's template
    ({"tool_choice": "required"}, "tool_choice", "tools"),  # a choice among no tools
])
def test_tools_a_model_cannot_call_are_refused_by_name(service, fields, param, reason):
    status, answer, sent = post(service, "/v1/chat/completions", _body("/v1/chat/completions", **fields))
    assert status == 400 and answer["error"]["param"] == param and reason in answer["error"]["message"], answer
    assert not sent


@pytest.mark.parametrize("path", ROUTES)
def test_metadata_fields_and_a_matching_best_of_are_accepted_and_logit_bias_travels(service, path):
    extra = {"best_of": 2} if path == "/v1/completions" else {"tools": [], "tool_choice": "none",
                                                               "modalities": ["text"], "parallel_tool_calls": True}
    status, answer, sent = post(service, path, _body(path, n=2, user="u", metadata={"k": "v"}, store=False,
                                                     service_tier="auto", logit_bias={"7": -100, "9": 2.5}, **extra))
    assert status == 200, answer
    assert all(r.params.logit_bias == ((7, -100.0), (9, 2.5)) for r in sent) and len(sent) == 2


def _nested(depth: int) -> bytes:
    """A completions body whose guided_json nests `depth` objects (as text: deeper than json.dumps goes)."""
    schema = '{"type":"object","properties":{"a":' * depth + '{"type":"integer"}' + "}}" * depth
    return ('{"prompt":"hi","max_tokens":8,"guided_json":' + schema + "}").encode()


@pytest.mark.parametrize("depth", [200, 490, 2000])
def test_a_deeply_nested_schema_is_a_400_not_a_crash(tiny_llama, depth):
    roomy = OpenAIService(ScriptedClient([(5, "a")]), Tokenizer(tiny_llama), "tiny", 256,
                          GatewayConfig(max_body_bytes=2**20))
    status, answer, sent = post(roomy, "/v1/completions", _nested(depth))
    roomy.close()
    # Past the body parser's depth the body itself is refused (no param); within it, the schema.
    assert status == 400 and answer["error"]["param"] == ("guided_json" if depth < 1000 else None), answer
    assert not sent


def test_each_schema_is_compiled_once(service):
    schema = {"type": "object", "properties": {"once": {"type": "boolean"}}}
    before = service.structured.compiler.num_compiled
    for _ in range(3):
        status, _, _ = post(service, "/v1/completions", _body("/v1/completions", guided_json=schema))
        assert status == 200
    assert service.structured.compiler.num_compiled == before + 1
