"""Tool-call parsing (#45): each format's output becomes content and OpenAI tool calls; a stream
fed in any pieces gives the whole text's answer; partial tags are held, never leaked; garbage
and hostile output stays content (or a committed call's partial arguments), never an error."""

from __future__ import annotations

import random

import pytest

from pdserve.gateway.tool_calls import ToolCallStream, merge_deltas, parse_tool_calls

ARGS = '{"city": "Paris", "days": [1, 2], "note": "a } in a \\"string\\" {"}'
CASES = [
    # (format, output, content, [(name, arguments)])
    ("hermes", f'<tool_call>\n{{"name": "weather", "arguments": {ARGS}}}\n</tool_call>', None, [("weather", ARGS)]),
    ("hermes", 'Let me look.\n\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
               '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>', "Let me look.",
     [("a", "{}"), ("b", '{"x": 1}')]),
    ("hermes", '<tool_call>{"arguments": {"x": 1}, "name": "late"}</tool_call>', None, [("late", '{"x": 1}')]),
    ("hermes", '<tool_call>{"name": "noargs"}</tool_call>', None, [("noargs", "{}")]),
    ("hermes", '<tool_call>{"name": "cut", "arguments": {"x": [1, ', None, [("cut", '{"x": [1, ')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}} junk</tool_call> after', "after", [("f", "{}")]),
    ("hermes", "no call here, just <b>text</b> and <tool", "no call here, just <b>text</b> and <tool", []),
    ("hermes", "<tool_call>not json</tool_call> rest", "<tool_call>not json</tool_call> rest", []),
    ("hermes", '<tool_call>{"name": 7}</tool_call>', '<tool_call>{"name": 7}</tool_call>', []),
    ("hermes", '<tool_call>{"x": 1}</tool_call>', '<tool_call>{"x": 1}</tool_call>', []),
    ("llama3_json", '{"name": "search", "parameters": {"q": "x"}}', None, [("search", '{"q": "x"}')]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": true}}', None,
     [("a", "{}"), ("b", '{"k": true}')]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "The answer is {not a call}", "The answer is {not a call}", []),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": "]"}}, {"name": "b", "arguments": {}}]', None,
     [("a", '{"x": "]"}'), ("b", "{}")]),
    ("mistral", 'Sure [TOOL_CALLS]{"name": "one", "arguments": {"n": 1}}', "Sure", [("one", '{"n": 1}')]),
    ("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", []),
    # v11: name[ARGS]{...}, once per call
    ("mistral", '[TOOL_CALLS]weather[ARGS]{"city": "Paris", "x": "[ARGS]"}', None,
     [("weather", '{"city": "Paris", "x": "[ARGS]"}')]),
    ("mistral", 'Sure. [TOOL_CALLS]a[ARGS]{} [TOOL_CALLS]b.v-2[ARGS] {"n": [1]}', "Sure.",
     [("a", "{}"), ("b.v-2", '{"n": [1]}')]),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}][TOOL_CALLS]b[ARGS]{}', None, [("a", "{}"), ("b", "{}")]),
    ('mistral', '[TOOL_CALLS]cut[ARGS]{"x": [1, ', None, [("cut", '{"x": [1, ')]),
    ("mistral", "[TOOL_CALLS]two words[ARGS]{}", "[TOOL_CALLS]two words[ARGS]{}", []),
    ("mistral", "[TOOL_CALLS]f(x) = 1", "[TOOL_CALLS]f(x) = 1", []),
    ("mistral", "[TOOL_CALLS]half[ARG", "[TOOL_CALLS]half[ARG", []),
    ("mistral", "[TOOL_CALLS]a[ARGS]oops [TOOL_CALLS]b[ARGS]{}", None, [("a", "")]),
]


def _calls(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _streamed(text: str, fmt: str, cuts: list[int], max_calls: int | None = None) -> tuple[str, list[dict]]:
    stream, content, deltas = ToolCallStream(fmt, max_calls), "", []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        c, d = stream.feed(text[a:b])
        content, deltas = content + c, deltas + d
    c, d = stream.finish()
    return content + c, merge_deltas(deltas + d)


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_each_format_becomes_content_and_calls(fmt, text, content, calls):
    got_content, got_calls = parse_tool_calls(text, fmt)
    assert _calls(got_calls) == calls
    assert got_content == (content or "")
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_a_stream_in_any_pieces_equals_the_whole(fmt, text, content, calls):
    whole = parse_tool_calls(text, fmt)
    rng = random.Random(len(text))
    splits = [list(range(1, len(text))), list(range(2, len(text), 2)), list(range(3, len(text), 7))]
    splits += [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 5))) for _ in range(5)]
    for cuts in splits:
        got = _streamed(text, fmt, cuts)
        assert (got[0], _calls(got[1])) == (whole[0], _calls(whole[1])), cuts


def test_a_call_streams_as_openai_does_id_and_name_first_then_argument_fragments():
    stream = ToolCallStream("hermes")
    text = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    deltas = [d.to_openai() for i in range(len(text)) for d in stream.feed(text[i])[1]] + \
        [d.to_openai() for d in stream.finish()[1]]
    first, rest = deltas[0], deltas[1:]
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "weather", "arguments": ""} and first["index"] == 0
    assert len(rest) > 3 and all(set(d) == {"index", "function"} and d["index"] == 0 for d in rest)
    assert "".join(d["function"]["arguments"] for d in rest) == '{"city": "Paris"}'


def test_partial_tags_are_held_and_plain_text_is_not():
    stream = ToolCallStream("hermes")
    assert stream.feed("Hello <tool") == ("Hello", [])  # the space waits: a call right after drops it
    assert stream.feed("box> and more") == (" <toolbox> and more", [])
    assert stream.finish() == ("", [])
    stream = ToolCallStream("hermes")
    for _ in range(2000):  # plain text passes through: nothing accumulates
        assert stream.feed("word ")[0]
    assert len(stream.held) + len(stream.pending_ws) < len("<tool_call>")


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert _calls(parse_tool_calls(text, "hermes", max_calls=1)[1]) == [("a", "{}")]
    assert _calls(_streamed(text, "hermes", list(range(1, len(text))), max_calls=1)[1]) == [("a", "{}")]


GARBAGE_PIECES = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "get_x", "<|python_tag|>",
                  "{", "}", "[", "]", '"', "\\",
                  '"name"', '"arguments"', '"parameters"', ":", ",", ";", " ", "\n", "x", "7", "null", "\ufffd", "é"]


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_garbage_never_raises_and_a_stream_still_equals_the_whole(fmt):
    rng = random.Random(fmt)
    for _ in range(300):
        text = "".join(rng.choice(GARBAGE_PIECES) for _ in range(rng.randint(1, 40)))
        content, calls = parse_tool_calls(text, fmt)
        if not calls:  # nothing was taken for a call: the text is all content
            assert content == text
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6))) if len(text) > 1 else []
        got = _streamed(text, fmt, cuts)
        assert (got[0], _calls(got[1])) == (content, _calls(calls)), text
