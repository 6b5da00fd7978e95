"""Structured output at the gateway: the request fields that constrain what is generated, turned
into one `StructuredOutput` and compiled before any compute.

In: a validated completions or chat request (`protocol.py`): OpenAI's `response_format`
(`json_object`, `json_schema`), vLLM's `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar` and `structured_outputs` ({json, regex, choice, grammar, json_object,
disable_any_whitespace}), and a chat request's tool grammar (`tools.py`). Out: the request's
`StructuredOutput` (or None), after a thinking model's reasoning section, which travels in its
`SamplingParams` to every pool, so prefill, decode and unified replicas apply the same grammar.

At most one constraint per request: a second is a 400 naming it. JSON is generated without free
whitespace unless `structured_outputs.disable_any_whitespace` is false. Each spec is compiled
here (on the request's parse thread, into the gateway's own bounded cache): a schema, regex or
grammar that does not compile, or exceeds the compiler's limits, is a 400 naming the field that
carried it before the request reaches a pool. The text's size was bounded before parsing
(`bounds.RequestBounds.check_counts`). It does not know about engines or tokens beyond the
tokenizer the compiler was built with.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from pdserve.config import EngineConfig
from pdserve.engine.grammar import GrammarCompiler, GrammarError
from pdserve.engine.sampling_params import StructuredOutput
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError

# The gateway keeps as many compiled specs as an engine does by default.
CACHE_SIZE = EngineConfig.model_fields["grammar_cache_size"].default
# Where a constraint's text sits in a request body (for the size bound, before pydantic).
CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs", "tools")  # tools: their schemas become a grammar (tools.py)


def constraint_chars(data: dict) -> tuple[int, str | None]:
    """The characters of a parsed body's constraints as compact JSON, and the largest one's field."""
    total, largest, param = 0, 0, None
    for name in CONSTRAINT_FIELDS:
        value = data.get(name)
        if value is None:
            continue
        try:
            n = len(value) if isinstance(value, str) else len(json.dumps(value, separators=(",", ":")))
        except RecursionError:  # the body's parser takes deeper nesting than the encoder
            raise InvalidRequestError(f"{name} is nested too deeply", param=name) from None
        total += n
        if n > largest:
            largest, param = n, name
    return total, param


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidRequestError(f"{param} is not valid JSON: {e}", param=param) from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param} must be a JSON schema (an object)", param=param)
    # Key order kept: a schema's property order is the order the output writes them in.
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:
        raise InvalidRequestError(f"{param} is nested too deeply", param=param) from None


def structured_output(body) -> tuple[StructuredOutput, str] | None:
    """The request's constraint and the field that carried it (None: unconstrained)."""
    found: list[tuple[str, str, str]] = []  # (param, kind, value)
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", "json_object", ""))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise InvalidRequestError("response_format of type json_schema needs json_schema.schema",
                                      param="response_format")
        found.append(("response_format", "json", _schema_text(rf.json_schema.json_schema, "response_format")))
    if body.guided_json is not None:
        found.append(("guided_json", "json", _schema_text(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        found.append(("guided_regex", "regex", body.guided_regex))
    if body.guided_choice is not None:
        found.append(("guided_choice", "choice", json.dumps(body.guided_choice, ensure_ascii=False)))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", "grammar", body.guided_grammar))
    so = body.structured_outputs
    if so is not None:
        p = "structured_outputs"
        if so.json_schema is not None:
            found.append((p, "json", _schema_text(so.json_schema, p)))
        if so.regex is not None:
            found.append((p, "regex", so.regex))
        if so.choice is not None:
            found.append((p, "choice", json.dumps(so.choice, ensure_ascii=False)))
        if so.grammar is not None:
            found.append((p, "grammar", so.grammar))
        if so.json_object:
            found.append((p, "json_object", ""))
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequestError(f"a request takes one output constraint; got {found[0][0]} and {found[1][0]}",
                                  param=found[1][0])
    param, kind, value = found[0]
    any_whitespace = so is not None and so.disable_any_whitespace is False
    return StructuredOutput(kind, value, any_whitespace), param


class StructuredOutputChecker:
    """Compiles each request's constraint once (cached), raising a 400 naming its field."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = CACHE_SIZE):
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.compiler = GrammarCompiler(tokenizer.tok.to_str(), tokenizer.vocab_size, eos, cache_size)

    def __call__(self, body, tool_grammar: str | None = None, reasoning: str = "") -> StructuredOutput | None:
        """`tool_grammar`: the Lark of a chat request's required or named tool choice (`tools.py`),
        a constraint of its own; `reasoning`: where a thinking model's reasoning section stands,
        which the constraint follows (`StructuredOutput.reasoning`)."""
        found = structured_output(body)
        if tool_grammar is not None:
            if found is not None:
                raise InvalidRequestError(f"a request takes one output constraint; got {found[1]} and a "
                                          "tool_choice that requires a call", param="tool_choice")
            found = StructuredOutput("grammar", tool_grammar), "tools"
        if found is None:
            return None
        spec, param = found
        if reasoning:
            spec = replace(spec, reasoning=reasoning)
        try:
            self.compiler.compile(spec)
        except GrammarError as e:
            raise InvalidRequestError(f"invalid {param}: {e}", param=param) from None
        return spec
