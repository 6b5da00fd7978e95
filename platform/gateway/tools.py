"""Tool calling at the gateway, on the request's side: which call format a model writes, what a
chat request's `tools`, `tool_choice` and `parallel_tool_calls` ask for, and the grammar that
enforces `required` and a named function.

In: the `gateway.tool_call_parser` setting, the tokenizer (its chat template names the format
under `auto`; for mistral, whether calls are written in v11's `[TOOL_CALLS]name[ARGS]{...}`
form: the template writes `[ARGS]` or the vocabulary has it, else the JSON list of older
tokenizers), and a validated `ChatCompletionRequest`. Out: a `ToolPlan` (None: no tools in
play): the tools for the chat template, the format `tool_calls.py` parses the output in, how
many calls may be kept, and for `required`/named the Lark grammar (the format's markup around
JSON that a schema built from the tools' parameters constrains) that `structured.py` compiles and
the engine enforces. Bad input (a tool choice without tools, an unknown tool name, two tools of
one name, a model with no known format) is an `InvalidRequestError` naming its field.

It does not parse output (`tool_calls.py`) nor know reasoning: the service puts a reasoning
section before the grammar (`StructuredOutput.reasoning`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError
from pdserve.gateway.tool_calls import ARGS_TAG, FORMATS

# What a chat template writes for each format: the first one it contains picks the format.
_TEMPLATE_MARKS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"))
_ARGUMENTS_KEY = {"hermes": "arguments", "mistral": "arguments", "llama3_json": "parameters"}
_NO_PARAMETERS = {"type": "object", "properties": {}}


def tool_format(setting: str, chat_template: str | None) -> str | None:
    """The format a model's tool calls are read in: the setting, or under "auto" the one its
    chat template writes (None: none known)."""
    if setting in FORMATS:
        return setting
    if setting == "auto" and chat_template:
        return next((fmt for mark, fmt in _TEMPLATE_MARKS if mark in chat_template), None)
    return None


@dataclass(frozen=True)
class ToolPlan:
    fmt: str  # the format the output is parsed in (tool_calls.FORMATS)
    tools: list[dict]  # OpenAI's tool definitions, for the chat template
    max_calls: int | None  # calls kept (1: parallel_tool_calls false, or a named function)
    grammar: str | None  # Lark, for tool_choice required or a named function
    keeps_special_tokens: bool = False  # the format's marker is a special token: the text must keep it


def _special_token_id(tokenizer: Tokenizer, text: str) -> int | None:
    """`text`'s id where the vocabulary has it as a special token (one the detokenizer skips)."""
    tid = tokenizer.tok.token_to_id(text)
    added = tokenizer.tok.get_added_tokens_decoder()
    return tid if tid is not None and tid in added and added[tid].special else None


class ToolCalling:
    """Tool calling for one model: its format, and each request's plan."""

    def __init__(self, setting: str, tokenizer: Tokenizer):
        self.fmt = tool_format(setting, tokenizer.chat_template)
        # mistral: its markers' ids where they are special tokens (the grammar names them by id),
        # and whether calls are written name[ARGS]{...} (v11) rather than as a JSON list
        self.marker_id = self.args_id = None
        self.is_mistral_v11 = False
        if self.fmt == "mistral":
            self.marker_id = _special_token_id(tokenizer, "[TOOL_CALLS]")
            self.args_id = _special_token_id(tokenizer, ARGS_TAG)
            self.is_mistral_v11 = (ARGS_TAG in (tokenizer.chat_template or "")
                                   or tokenizer.tok.token_to_id(ARGS_TAG) is not None)

    def plan(self, body) -> ToolPlan | None:
        choice, tools = body.tool_choice, body.tools or []
        if not tools:
            if choice not in (None, "none"):
                raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
            return None
        if choice == "none":  # the model may not call: as if no tools were sent
            return None
        if self.fmt is None:
            raise InvalidRequestError("this model's chat template writes no tool-call format pdserve knows; set "
                                      "gateway.tool_call_parser", param="tools")
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise InvalidRequestError("two tools have the same name", param="tools")
        named = None if choice in (None, "auto", "required") else choice.function.name
        if named is not None and named not in names:
            raise InvalidRequestError(f"tool_choice names {named[:64]!r}, which is not among the tools",
                                      param="tool_choice")
        single = named is not None or not body.parallel_tool_calls
        grammar = None
        if choice == "required" or named is not None:
            chosen = [t for t in tools if named is None or t.function.name == named]
            grammar = self.grammar(chosen, single)
        return ToolPlan(self.fmt, [t.model_dump(exclude_none=True) for t in tools], 1 if single else None, grammar,
                        self.marker_id is not None or self.args_id is not None)

    def grammar(self, tools, single: bool) -> str:
        """Lark for one call (`single`) or one or more, to any of `tools`, in this model's format;
        the arguments follow each tool's parameters schema, written without free whitespace."""
        if self.is_mistral_v11:
            return self._mistral_v11_grammar(tools, single)
        key = _ARGUMENTS_KEY[self.fmt]
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   key: t.function.parameters or _NO_PARAMETERS},
                  "required": ["name", key], "additionalProperties": False} for t in tools]
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if self.fmt == "mistral":
            marker = _token(self.marker_id, "[TOOL_CALLS]")
            array = {"type": "array", "items": call, "minItems": 1, **({"maxItems": 1} if single else {})}
            return f"start: {marker} %json {_compact(array)}\n"
        if self.fmt == "hermes":
            rule = f'call: "<tool_call>\\n" %json {_compact(call)} "\\n</tool_call>"\n'
            sep = '"\\n"'
        else:
            rule = f"call: %json {_compact(call)}\n"
            sep = '"; "'
        return ("start: call\n" if single else f"start: call ({sep} call)*\n") + rule


    def _mistral_v11_grammar(self, tools, single: bool) -> str:
        """`[TOOL_CALLS]name[ARGS]{...}` once (`single`) or more, a rule per tool."""
        marker, args = (_token(tid, text) for tid, text in ((self.marker_id, "[TOOL_CALLS]"),
                                                            (self.args_id, ARGS_TAG)))
        rules = [f"call_{i}: {marker} {json.dumps(t.function.name)} {args} "
                 f"%json {_compact(t.function.parameters or _NO_PARAMETERS)}" for i, t in enumerate(tools)]
        call = " | ".join(f"call_{i}" for i in range(len(tools)))
        return f"start: {'call' if single else 'call+'}\ncall: {call}\n" + "\n".join(rules) + "\n"


def _token(tid: int | None, text: str) -> str:
    """Lark for a marker: its special token by id, or else its text."""
    return f"<[{tid}]>" if tid is not None else json.dumps(text)


def _compact(schema: dict) -> str:
    return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}}, separators=(",", ":"),
                      ensure_ascii=False)
