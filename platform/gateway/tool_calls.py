"""Tool calls in a model's output: parsed into OpenAI `tool_calls`, a text delta at a time.

In: the call format (`FORMATS`), then the output text (after any reasoning section) as it is
detokenized. Out: content deltas and `ToolCallDelta`s in OpenAI's streaming shape: a call's
first delta carries its id and name, the next ones fragments of its arguments (the JSON text
the model wrote, character for character). Feeding the whole text at once gives what feeding it
in pieces gives, so a response is its stream joined. The formats:

- hermes (Hermes, Qwen2.5/Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call, text allowed around them;
- llama3_json (Llama 3.1+): the output opens with `{"name": ..., "parameters": {...}}`
  (after an optional `<|python_tag|>`), calls separated by `;`;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizers before v11; one
  object without the list is read too), or v11's `[TOOL_CALLS]name[ARGS]{...}`, repeated for
  parallel calls. Each `[TOOL_CALLS]` is read in whichever form follows it.

Anything that is not a call (no name, broken JSON before the name, garbage in a tag) stays
content, never an error: a call is committed once its name is read (in v11's form: once
`[ARGS]` follows a name); what breaks after that ends its arguments. Text is held back only
while it may still be a tag or a call whose name is not read yet, and each character is looked
at once. Whitespace around calls is dropped. It does
not know tools, grammars or HTTP: `tools.py` decides which format and what a request allows.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Callable

from pdserve.gateway.reasoning import held_prefix

FORMATS = ("hermes", "llama3_json", "mistral")
_OPEN_TAG = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}
_CLOSE_TAG = "</tool_call>"
ARGS_TAG = "[ARGS]"  # mistral v11: between a call's name and its arguments
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")  # OpenAI's
_ARGUMENT_KEYS = ("arguments", "parameters")
_WS = " \t\r\n"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # set on a call's first delta, with its name
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class _Value:
    """Where one JSON value ends, a character at a time (it does not check the value's syntax)."""

    def __init__(self):
        self.kind = None  # "container", "string" or "scalar"
        self.depth, self.in_string, self.escaped = 0, False, False

    def step(self, c: str) -> int:
        """1: `c` is part of the value; 2: it is the value's last character; 0: the value ended before it."""
        if self.kind is None:
            self.kind = "container" if c in "{[" else "string" if c == '"' else "scalar"
            self.depth, self.in_string = int(c in "{["), c == '"'
            return 1
        if self.kind == "scalar":
            return 0 if c in ",}]" or c in _WS else 1
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                return 2 if self.kind == "string" else 1
            return 1
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            return 2 if self.depth == 0 else 1
        return 1


class _CallObject:
    """One call object, `{"name": "...", "arguments": ...}` (or "parameters"), a character at a time."""

    def __init__(self):
        self.stage = "open"  # open, key, colon, value, next, done, error
        self.key, self.raw, self.value = "", "", None
        self.name: str | None = None
        self.args_seen = False
        self.args = ""  # argument text read and not yet taken

    def step(self, c: str) -> None:
        stage = self.stage
        if stage == "value":
            part = self.value.step(c)
            if part:
                if self.key in _ARGUMENT_KEYS:
                    self.args += c
                else:
                    self.raw += c
            if part != 1:
                self._value_done()
                if part == 0:
                    self.step(c)
            return
        if stage == "key" and self.value is not None:  # inside the key's string
            self._key_char(c)
            return
        if c in _WS or stage in ("done", "error"):
            return
        if stage == "open":
            self.stage = "key" if c == "{" else "error"
        elif stage == "key":
            if c == "}":
                self._close()
            elif c == '"':
                self.value, self.raw = _Value(), ""
                self._key_char(c)
            else:
                self.stage = "error"
        elif stage == "colon":
            self.stage = "start" if c == ":" else "error"
        elif stage == "start":
            self.stage, self.value, self.raw = "value", _Value(), ""
            if self.key in _ARGUMENT_KEYS:
                if self.args_seen:  # both "arguments" and "parameters": not a call we can stream
                    self.stage = "error"
                    return
                self.args_seen = True
            self.step(c)
        elif stage == "next":
            self.stage = "key" if c == "," else "error"
            if c == "}":
                self._close()

    def _key_char(self, c: str) -> None:
        self.raw += c
        if self.value.step(c) == 2:
            self.key, self.value, self.stage = _loads(self.raw), None, "colon"

    def _value_done(self) -> None:
        if self.key == "name":
            name = _loads(self.raw)
            if not isinstance(name, str) or self.name is not None:
                self.stage = "error"
                return
            self.name = name
        self.value, self.stage = None, "next"

    def _close(self) -> None:
        if self.name is None:
            self.stage = "error"
            return
        if not self.args_seen:
            self.args, self.args_seen = "{}", True
        self.stage = "done"


class _Arguments:
    """Mistral v11's call after `name[ARGS]`: its arguments, one JSON object, a character at a
    time (the interface `_CallObject` offers `ToolCallStream`)."""

    def __init__(self, name: str):
        self.name, self.args, self.stage, self.value = name, "", "value", _Value()

    def step(self, c: str) -> None:
        if self.stage != "value" or (self.value.kind is None and c in _WS):
            return
        if self.value.kind is None and c != "{":
            self.stage = "error"
            return
        self.args += c
        if self.value.step(c) == 2:
            self.stage = "done"


def _loads(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return None


class ToolCallStream:
    """One choice's output in `fmt` (one of FORMATS), a delta at a time. With `max_calls`, later
    calls are read and dropped (parallel_tool_calls: false)."""

    def __init__(self, fmt: str, max_calls: int | None = None, make_id: Callable[[], str] = new_call_id):
        assert fmt in FORMATS, fmt
        self.fmt, self.max_calls, self.make_id = fmt, max_calls, make_id
        self.state = "start" if fmt == "llama3_json" else "text"
        self.held = ""  # text that may still be a tag
        self.pending_ws = ""  # content whitespace that a call right after it would drop
        self.call: _CallObject | None = None
        self.call_raw = ""  # the current call's text while it may still turn out not to be one
        self.call_index: int | None = None  # the current call's, once its name committed it
        self.after_call = False  # whitespace from here to the next content is dropped
        self.in_list = False  # mistral: inside [TOOL_CALLS][...]
        self.name = ""  # mistral v11: the name read so far after [TOOL_CALLS]
        self.num_calls = 0
        self.content = ""  # content delta being built
        self.deltas: list[ToolCallDelta] = []

    # -- interface --------------------------------------------------------------------------------
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The content and call deltas `text` completes."""
        buf, self.held = self.held + text, ""
        while buf:
            buf = getattr(self, "_" + self.state)(buf)
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What was held back: an unfinished tag, or an object whose name never came, is content."""
        if (self.state == "call" and self.call_index is None) or self.state in ("list_open", "name"):
            self._add_content(self.call_raw + (self.held if self.state == "name" else ""))
        elif self.state in ("text", "start", "plain"):
            self._add_content(self.held)
        self.held = ""
        if not self.num_calls:
            self.content += self.pending_ws
        self.pending_ws = ""
        return self._take()

    # -- states: each takes the buffer and returns what it did not consume ------------------------
    def _start(self, buf: str) -> str:  # llama3_json: a call only where the output opens with one
        stripped = buf.lstrip()
        tag = _OPEN_TAG["llama3_json"]
        if stripped.startswith(tag):
            stripped = stripped[len(tag):].lstrip()
        if not stripped or tag.startswith(stripped):
            self.held = buf
            return ""
        if stripped[0] == "{":
            self._begin_call(buf[:len(buf) - len(stripped)])
            return stripped
        self.state = "plain"
        return buf

    def _plain(self, buf: str) -> str:
        self._add_content(buf)
        return ""

    def _text(self, buf: str) -> str:
        tag = _OPEN_TAG[self.fmt]
        at = buf.find(tag)
        if at < 0:
            keep = held_prefix(buf, tag)
            self._add_content(buf[:len(buf) - keep])
            self.held = buf[len(buf) - keep:]
            return ""
        self._add_content(buf[:at])
        if self.fmt == "mistral":
            self.state, self.call_raw = "list_open", tag
        else:
            self._begin_call(tag)
        return buf[at + len(tag):]

    def _list_open(self, buf: str) -> str:  # mistral: [TOOL_CALLS] then [obj, ...], one obj, or name[ARGS]
        stripped = buf.lstrip()
        if not stripped:
            self.call_raw += buf
            return ""
        if stripped[0] not in "[{":
            self.state, self.name, self.in_list = "name", "", False
            self.call_raw += buf[:len(buf) - len(stripped)]
            return stripped
        self.in_list = stripped[0] == "["
        raw = self.call_raw + buf[:len(buf) - len(stripped)]
        if self.in_list:
            raw, stripped = raw + "[", stripped[1:]
        self._begin_call(raw)
        return stripped

    def _name(self, buf: str) -> str:  # mistral v11: [TOOL_CALLS]name[ARGS]{...}
        at = buf.find(ARGS_TAG)
        head = buf if at < 0 else buf[:at]
        keep = 0 if at >= 0 else held_prefix(head, ARGS_TAG)
        for i, c in enumerate(head[:len(head) - keep]):
            if c not in _NAME_CHARS and c not in _WS:
                self.call_raw += head[:i]
                return self._broken(buf[i:])
        self.name += head[:len(head) - keep]
        self.call_raw += head[:len(head) - keep]
        if at < 0:
            self.held = head[len(head) - keep:]
            return ""
        name = self.name.strip()
        if not name or any(c in _WS for c in name):  # no name, or two words: not a call
            self.call_raw += ARGS_TAG
            return self._broken(buf[at + len(ARGS_TAG):])
        self.state, self.call, self.call_index = "call", _Arguments(name), None
        self._emit_call()  # the name is read: the call is committed
        return buf[at + len(ARGS_TAG):]

    def _call(self, buf: str) -> str:
        call = self.call
        for i, c in enumerate(buf):
            call.step(c)
            if self.call_index is None and call.name is None:
                self.call_raw += c
            if call.stage == "error":
                return self._broken(buf[i + 1:])
            if call.name is not None:
                self._emit_call()
            if call.stage == "done":
                self.state = "after"
                return buf[i + 1:]
        return ""

    def _after(self, buf: str) -> str:  # after a call object: its closing tag, separator, list end
        buf = buf.lstrip()
        if not buf:
            return ""
        if self.fmt == "hermes":
            if buf.startswith(_CLOSE_TAG):
                self._to_text()
                return buf[len(_CLOSE_TAG):]
            if _CLOSE_TAG.startswith(buf):
                self.held = buf
                return ""
            self.state = "skip"  # stray text in the block: the call is complete, drop to the tag
            return buf
        sep = "," if self.fmt == "mistral" and self.in_list else ";" if self.fmt == "llama3_json" else None
        if sep and buf[0] == sep:
            self._begin_call("")
            return buf[1:].lstrip()
        if self.fmt == "mistral" and self.in_list and buf[0] == "]":
            self._to_text()
            return buf[1:]
        self._to_text()  # text after the calls: content (llama3_json opens no further call)
        if self.fmt == "llama3_json":
            self.state = "plain"
        return buf

    def _skip(self, buf: str) -> str:  # inside a committed call's broken block: drop to its end
        if self.fmt != "hermes":
            return ""
        at = buf.find(_CLOSE_TAG)
        if at < 0:
            self.held = buf[len(buf) - held_prefix(buf, _CLOSE_TAG):]
            return ""
        self._to_text()
        return buf[at + len(_CLOSE_TAG):]

    # -- helpers ----------------------------------------------------------------------------------
    def _begin_call(self, raw: str) -> None:
        self.state, self.call, self.call_raw, self.call_index = "call", _CallObject(), raw, None

    def _broken(self, rest: str) -> str:
        if self.call_index is None:  # never a call: its text is content, and reading goes on after it
            self._add_content(self.call_raw)
            self.state = "plain" if self.fmt == "llama3_json" else "text"
            return rest
        self.state = "skip"
        return rest

    def _emit_call(self) -> None:
        """The current call's new deltas (its header once the name is known, then arguments)."""
        call = self.call
        if self.call_index is None:  # the name just came: the call is committed
            self.call_raw, self.pending_ws, self.after_call = "", "", True
            self.call_index = index = self.num_calls
            self.num_calls += 1
            if self.max_calls is None or index < self.max_calls:
                self.deltas.append(ToolCallDelta(index, self.make_id(), call.name))
        index = self.call_index
        if call.args and (self.max_calls is None or index < self.max_calls):
            if self.deltas and self.deltas[-1].index == index:
                self.deltas[-1].arguments += call.args
            else:
                self.deltas.append(ToolCallDelta(index, arguments=call.args))
        call.args = ""

    def _to_text(self) -> None:
        self.state, self.call = "text", None

    def _add_content(self, text: str) -> None:
        if self.after_call:  # whitespace right after a call is dropped too
            text = text.lstrip()
            self.after_call = not text
        body = text.rstrip()
        if body:
            self.content += self.pending_ws + body
            self.pending_ws = ""
        self.pending_ws += text[len(body):]

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        out = self.content, self.deltas
        self.content, self.deltas = "", []
        return out


def parse_tool_calls(text: str, fmt: str, max_calls: int | None = None,
                     make_id: Callable[[], str] = new_call_id) -> tuple[str, list[dict]]:
    """A whole output: its content and its calls as OpenAI's message `tool_calls`."""
    stream = ToolCallStream(fmt, max_calls, make_id)
    content, deltas = stream.feed(text)
    more, rest = stream.finish()
    return content + more, merge_deltas(deltas + rest)


def merge_deltas(deltas: list[ToolCallDelta]) -> list[dict]:
    """Call deltas joined into whole calls, as a client joins a stream's."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.id is not None:
            calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
        calls[d.index]["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]
