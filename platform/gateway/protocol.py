"""OpenAI request bodies (completions, chat completions, tokenize) and their sampling parameters.

Pydantic validates types; ranges are checked once, by `SamplingParams` (and the request's size
by `bounds.py`, before these models are built). Unknown fields are ignored, as OpenAI and vLLM
do, so clients that send newer fields keep working. OpenAI fields that would change what is
generated but are not implemented are declared only to be refused (`refuse_unsupported`: a 400
naming the field), never ignored; metadata fields (`user`, `metadata`, `store`,
`service_tier`) are accepted and change nothing. Output constraints (`response_format`, vLLM's
`guided_*` and `structured_outputs`) are read by `structured.py`; `tools` and `tool_choice`
by `tools.py`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictInt, StrictStr, TypeAdapter, ValidationError,
                      model_validator)

from pdserve.engine.sampling_params import SamplingParams, StructuredOutput
from pdserve.errors import InvalidRequestError

TokenIds = list[StrictInt]
_TOKEN_IDS = TypeAdapter(TokenIds)


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: StrictStr | None = None
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or JSON of a schema."""
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs`: one constraint, and whether JSON may carry free whitespace
    (`disable_any_whitespace`, pdserve's default true). Unknown keys are refused: each would
    change the output."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    seed: StrictInt | None = Field(None, ge=-2**63, le=2**63 - 1)  # a signed 64-bit integer, as vLLM
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    logit_bias: dict[str, float] | None = None
    cache_salt: StrictStr | None = Field(None, max_length=256)  # vLLM's: blocks are shared only within a salt
    n: StrictInt = Field(1, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: StructuredOutputsField | None = None

    # Fields that change the output and are not implemented: (name, why), refused when set.
    UNSUPPORTED: ClassVar[tuple[tuple[str, str], ...]] = ()

    def refuse_unsupported(self) -> None:
        """A 400 naming the first field set that would change the output and is not implemented."""
        for name, why in self.UNSUPPORTED:
            if _is_set(getattr(self, name)):
                raise InvalidRequestError(f"{name} is not supported{why}", param=name)

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        choice: int = 0, cache_salt: str | None = None,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """Choice `choice`'s parameters; `cache_salt` is the salt the gateway settled on (see
        `OpenAIService`), not necessarily the request's own; `structured` the constraint
        `structured.py` compiled. `logit_bias` was checked against the vocabulary
        (`bounds.check_logit_bias`)."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream: true", param="stream_options")
        if max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        set_ = {k: v for k, v in dict(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty).items() if v is not None}
        # Choice i of a seeded request draws from seed + i: reproducible, yet n distinct samples
        # (wrapped within the signed 64-bit range seeds take).
        seed = None if self.seed is None else (self.seed + choice + 2**63) % 2**64 - 2**63
        return SamplingParams(max_tokens=max_tokens, seed=seed, stop=self.stop or (),
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              skip_special_tokens=self.skip_special_tokens, cache_salt=cache_salt,
                              logit_bias=tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()),
                              structured=structured, **set_)


class CompletionRequest(_SamplingFields):
    prompt: Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]]
    logprobs: StrictInt | None = Field(None, ge=0)
    echo: bool = False
    best_of: StrictInt | None = Field(None, ge=1)
    suffix: Any = None  # refused (UNSUPPORTED)

    UNSUPPORTED = (("suffix", " (insertion: the supported models have no fill-in-the-middle template)"),)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        # best_of = n samples n and returns them all: what n does. More than n (keep the best by
        # log-probability) is not implemented.
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(f"best_of other than n is not supported (got best_of={self.best_of}, "
                                      f"n={self.n}); send n choices and rank them yourself", param="best_of")

    @model_validator(mode="wrap")
    @classmethod
    def _token_id_prompts_one_at_a_time(cls, data: Any, handler):
        """Many prompts of token ids are validated one list at a time: one call over all of them
        held the GIL ~30 ms at 256 prompts of 8,000 ids, and the gateway's event loop with it."""
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if not (isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], list)):
            return handler(data)
        body = handler({**data, "prompt": prompt[:1]})  # (the first picks the prompt's type)
        prompts = [body.prompt[0]]
        for i, ids in enumerate(prompt[1:], 1):
            try:
                prompts.append(_TOKEN_IDS.validate_python(ids))
            except ValidationError as e:
                raise ValidationError.from_exception_data(cls.__name__, [
                    {"type": err["type"], "loc": ("prompt", i, *err["loc"]), "input": err["input"]}
                    for err in e.errors()]) from None
        body.prompt = prompts
        return body

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts:
            raise InvalidRequestError("prompt is empty", param="prompt")
        return prompts


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    """A call the assistant made, in the history: `arguments` is JSON text, as OpenAI sends it."""
    name: StrictStr
    arguments: StrictStr


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: StrictStr = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[Annotated[TextPart, Field()]] | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages only
    tool_call_id: StrictStr | None = Field(None, max_length=256)  # tool messages: the call they answer

    def text(self) -> str:
        content = self.content
        return "".join(part.text for part in content) if isinstance(content, list) else content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it; a call's arguments as an object (the templates of
        the supported families write them with `tojson`), as vLLM and transformers hand them over."""
        out = {**(self.model_extra or {}), "role": self.role, "content": self.text()}
        if self.tool_calls:
            if self.role != "assistant":
                raise InvalidRequestError("only assistant messages carry tool_calls", param="messages")
            out["tool_calls"] = [{"id": c.id, "type": c.type,
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(call: FunctionCall) -> Any:
    try:
        return json.loads(call.arguments)
    except (ValueError, RecursionError):
        raise InvalidRequestError(f"the arguments of a tool call to {call.name[:64]!r} are not JSON",
                                  param="messages") from None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule (dots too, as vLLM)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction


# chat_template_kwargs may not replace what the gateway itself hands the template.
_TEMPLATE_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                "raise_exception", "strftime_now"})


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, StrictStr | bool | int | float | None] | None = None
    # Refused when set (UNSUPPORTED, and modalities below); declared to be seen.
    functions: Any = None
    function_call: Any = None
    prediction: Any = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    # To the chat template as its variables (reasoning_effort.py): a 400 where it cannot take it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    UNSUPPORTED = (("functions", " (deprecated by OpenAI: send tools)"),
                    ("function_call", " (deprecated by OpenAI: send tool_choice)"),
                    ("prediction", " (predicted outputs)"),
                    ("audio", " (text output only)"), ("web_search_options", ""), ("verbosity", ""))

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if _is_set(self.modalities) and self.modalities != ["text"]:
            raise InvalidRequestError("only the text modality is supported", param="modalities")

    def template_messages(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise InvalidRequestError("messages must contain at least one message", param="messages")
        return [m.for_template() for m in self.messages]

    def template_kwargs(self) -> dict[str, Any]:
        """vLLM's `chat_template_kwargs` (e.g. Qwen3's enable_thinking): flat values only."""
        kwargs = self.chat_template_kwargs or {}
        reserved = sorted(_TEMPLATE_RESERVED & kwargs.keys())
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved[0]}", param="chat_template_kwargs")
        return kwargs


def _is_set(value) -> bool:
    """Set to something that asks for a behaviour: not absent, null or empty."""
    return value is not None and value != [] and value != {} and value != ""


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the template."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: TokenIds
