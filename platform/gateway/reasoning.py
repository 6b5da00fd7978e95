"""Reasoning output: the `<think>...</think>` section that thinking models (Qwen3, QwQ,
DeepSeek-R1) write before their answer, split off as `reasoning_content`.

In: the chat template (does this model think at all?), the rendered prompt (where does the
output start: inside a `<think>` the template opened, after one it closed, or free to open one?),
then the output text as it is detokenized. Out: (reasoning, content) text deltas. Feeding the
whole text at once gives what feeding it in pieces gives: the non-streaming answer is the
stream's, joined. Text is held back only while it may still be (the start of) a tag, so the
work per delta is proportional to the delta.

It does not know tokens, grammars or tools: `engine/grammar.py` applies a constraint after the
reasoning section (`StructuredOutput.reasoning`, set from `reasoning_mode`), and the tool-call
parser reads the content this module passes on.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
# Where a thinking model's output starts (StructuredOutput.reasoning takes the same values).
OPEN, OPTIONAL, CLOSED = "open", "optional", "closed"


def template_thinks(chat_template: str | None) -> bool:
    """Whether a chat template belongs to a thinking model: it writes or strips `</think>`."""
    return bool(chat_template) and END in chat_template


def reasoning_mode(prompt_text: str) -> str:
    """OPEN: the prompt ends inside a `<think>` (DeepSeek-R1, Qwen3 thinking templates open it);
    CLOSED: it ends with an empty, closed one (Qwen3 with `enable_thinking: false`); else the
    output may open one itself (OPTIONAL)."""
    if prompt_text.rfind(START) > prompt_text.rfind(END):
        return OPEN
    return CLOSED if prompt_text.rstrip().endswith(END) else OPTIONAL


def held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """One choice's output split into reasoning and content, a delta at a time."""

    def __init__(self, mode: str):
        self.state = {OPEN: "reasoning", OPTIONAL: "start"}.get(mode, "content")
        self.held = ""  # text that may still be (the start of) a tag

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that `text` completes."""
        buf, self.held = self.held + text, ""
        reasoning = ""
        while buf:
            if self.state == "start":  # the output may open with <think> (after whitespace)
                stripped = buf.lstrip()
                if stripped.startswith(START):
                    self.state, buf = "reasoning", stripped[len(START):]
                elif START.startswith(stripped):
                    self.held = buf
                    return reasoning, ""
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                end = buf.find(END)
                if end >= 0:
                    reasoning += buf[:end]
                    self.state, buf = "after", buf[end + len(END):]
                    continue
                keep = held_prefix(buf, END)
                self.held = buf[len(buf) - keep:]
                return reasoning + buf[:len(buf) - keep], ""
            elif self.state == "after":  # the newlines between </think> and the answer are neither
                buf = buf.lstrip("\n")
                if buf:
                    self.state = "content"
            else:
                return reasoning, buf
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """What was held back: an unfinished tag is text of the section it stands in."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "reasoning" else ("", held)
