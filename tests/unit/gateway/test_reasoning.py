"""Reasoning output (#45): a thinking model's `<think>...</think>` section splits off as
reasoning, wherever the prompt left it (opened, closed, or up to the model); a stream fed in any
pieces gives the whole text's split; partial tags are held, garbage never raises."""

from __future__ import annotations

import random

import pytest

from pdserve.gateway.reasoning import CLOSED, OPEN, OPTIONAL, ReasoningStream, reasoning_mode, template_thinks


def split(text: str, mode: str, cuts: list[int] | None = None) -> tuple[str, str]:
    stream, reasoning, content = ReasoningStream(mode), "", ""
    cuts = cuts or []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        r, c = stream.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


def test_the_prompt_says_where_the_output_starts():
    assert reasoning_mode("<|im_start|>assistant\n<think>\n") == OPEN  # DeepSeek-R1, Qwen3 thinking-2507
    assert reasoning_mode("<|im_start|>assistant\n<think>\n\n</think>\n\n") == CLOSED  # enable_thinking false
    assert reasoning_mode("<think>old</think>answer<|im_start|>assistant\n") == OPTIONAL  # Qwen3: the model opens
    assert template_thinks("{{ content.split('</think>')[-1] }}") and not template_thinks("{{ content }}")
    assert not template_thinks(None)


@pytest.mark.parametrize("mode, text, reasoning, content", [
    (OPEN, "let me see</think>\n\nThe answer.", "let me see", "The answer."),
    (OPEN, "still thinking </thi", "still thinking </thi", ""),  # cut by length inside the section
    (OPEN, "a</think>b</think>c", "a", "b</think>c"),
    (OPTIONAL, "<think>\nhmm\n</think>\n\nYes.", "\nhmm\n", "Yes."),
    (OPTIONAL, "  <think>x</think>y", "x", "y"),
    (OPTIONAL, "No thinking here.", "", "No thinking here."),
    (OPTIONAL, "<thi", "", "<thi"),
    (OPTIONAL, "<thinking>", "", "<thinking>"),
    (CLOSED, "<think>x</think>y", "", "<think>x</think>y"),
])
def test_the_reasoning_section_splits_off(mode, text, reasoning, content):
    assert split(text, mode) == (reasoning, content)
    for cuts in (list(range(1, len(text))), list(range(3, len(text), 4))):
        assert split(text, mode, cuts) == (reasoning, content)


def test_text_that_cannot_be_a_tag_is_not_held():
    stream = ReasoningStream(OPEN)
    assert stream.feed("thinking <") == ("thinking ", "")
    assert stream.feed("b>bold") == ("<b>bold", "")
    for _ in range(1000):
        assert stream.feed("more ")[0] == "more "
    assert stream.held == ""


def test_garbage_never_raises_and_a_stream_equals_the_whole():
    rng = random.Random(7)
    pieces = ["<think>", "</think>", "<", "/", ">", "think", "\n", " ", "x", "\ufffd"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        for mode in (OPEN, OPTIONAL, CLOSED):
            whole = split(text, mode)
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 5))) if len(text) > 1 else []
            assert split(text, mode, cuts) == whole
