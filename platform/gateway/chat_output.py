"""One chat choice's output as OpenAI shapes it when a thinking model or tools are in play: the
reasoning section as `reasoning_content`, tool calls as `tool_calls`, the rest as `content`.

In: the choice's text deltas (the detokenizer's), how the prompt left the reasoning section
(`reasoning.py`'s modes, or None: no reasoning parser) and the tool-call format (None: no
tools). Out: per delta, the stream chunk's `delta`; at the end, the `finish_reason`
("tool_calls" when a call was made and the model stopped by itself) and, for a response, the
whole `message` (the deltas joined, so a stream and a response agree). It does not know tokens,
HTTP or how the request was built.
"""

from __future__ import annotations

from pdserve.gateway.reasoning import ReasoningStream
from pdserve.gateway.tool_calls import ToolCallDelta, ToolCallStream, merge_deltas


class ChatChoiceOutput:
    def __init__(self, reasoning_mode: str | None, tool_format: str | None, max_calls: int | None = None):
        self.reasoning = ReasoningStream(reasoning_mode) if reasoning_mode is not None else None
        self.tools = ToolCallStream(tool_format, max_calls) if tool_format is not None else None
        self.has_calls = False

    def feed(self, text: str, finished: bool = False) -> dict:
        """The chunk delta `text` completes (with `finished`, everything held back too)."""
        reasoning, content, calls = self._step(text, finished)
        delta: dict = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [c.to_openai() for c in calls]
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.has_calls and reason == "stop" else reason

    def message(self, text: str) -> dict:
        """A response's message for the whole text."""
        reasoning, content, calls = self._step(text, finished=True)
        message = {"role": "assistant", "content": content or (None if calls else "")}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = merge_deltas(calls)
        return message

    def _step(self, text: str, finished: bool) -> tuple[str, str, list[ToolCallDelta]]:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if finished and self.reasoning:
            more_reasoning, more_content = self.reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[ToolCallDelta] = []
        if self.tools:
            content, calls = self.tools.feed(content)
            if finished:
                more_content, more_calls = self.tools.finish()
                content, calls = content + more_content, _joined(calls + more_calls)
        self.has_calls = self.has_calls or bool(calls)
        return reasoning, content, calls


def _joined(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive argument fragments of one call as one delta."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and d.id is None and out[-1].index == d.index:
            out[-1].arguments += d.arguments
        else:
            out.append(d)
    return out

