"""OpenAI's `reasoning_effort` as chat-template variables, the way vLLM passes it, or a 400.

In: the model's chat template (which variables it reads, found once by parsing it) and a chat
request's `reasoning_effort` with its `chat_template_kwargs`. Out: the variables to render the
template with. A template that reads `reasoning_effort` (gpt-oss style) gets the value as sent.
A template that reads `enable_thinking` (Qwen3 style, thinking on or off, no levels) gets
`enable_thinking: false` for "none" and `true` for every other level: the effort is honoured as
"think or not", no finer. A template that reads neither cannot honour the field: 400 naming it,
never a silent no-op. A `chat_template_kwargs` value that contradicts it is a 400 too.

It does not render templates or read output (`reasoning.py` splits the reasoning section off).
"""

from __future__ import annotations

from typing import Any

from pdserve.errors import InvalidRequestError

EFFORT_VARIABLE, THINKING_VARIABLE = "reasoning_effort", "enable_thinking"


def template_variables(chat_template: str | None) -> frozenset[str]:
    """The variables a chat template reads from its context (none for no template, or one that
    does not parse: rendering it reports that)."""
    if not chat_template:
        return frozenset()
    from jinja2 import Environment, TemplateSyntaxError, meta

    try:
        return frozenset(meta.find_undeclared_variables(Environment().parse(chat_template)))
    except TemplateSyntaxError:
        return frozenset()


class ReasoningEffort:
    """`reasoning_effort` for one model's chat template."""

    def __init__(self, chat_template: str | None):
        variables = template_variables(chat_template)
        self.takes_effort = EFFORT_VARIABLE in variables
        self.takes_thinking = THINKING_VARIABLE in variables

    def template_kwargs(self, effort: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`kwargs` (the request's chat_template_kwargs) with `effort` added as this template reads it."""
        if effort is None:
            return kwargs
        if not (self.takes_effort or self.takes_thinking):
            raise InvalidRequestError("reasoning_effort is not supported by this model: its chat template reads "
                                      f"neither {EFFORT_VARIABLE} nor {THINKING_VARIABLE}", param="reasoning_effort")
        wanted: dict[str, Any] = {}
        if self.takes_effort:
            wanted[EFFORT_VARIABLE] = effort
        if self.takes_thinking:
            wanted[THINKING_VARIABLE] = effort != "none"
        for name, value in wanted.items():
            if name in kwargs and kwargs[name] != value:
                raise InvalidRequestError(f"reasoning_effort {effort!r} contradicts chat_template_kwargs "
                                          f"{name}={kwargs[name]!r}", param="reasoning_effort")
        return {**kwargs, **wanted}
