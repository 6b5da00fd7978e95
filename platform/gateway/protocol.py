"""OpenAI request bodies (completions, chat completions, tokenize) and their sampling parameters.

Pydantic validates types; ranges are checked once, by `SamplingParams` (and the request's size
by `bounds.py`, before these models are built). Unknown fields are ignored, as OpenAI and vLLM
do, so clients that send newer fields keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError

TokenIds = list[StrictInt]


class StreamOptions(BaseModel):
    include_usage: bool = False


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

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        choice: int = 0, cache_salt: str | None = None) -> SamplingParams:
        """Choice `choice`'s parameters; `cache_salt` is the salt the gateway settled on (see
        `OpenAIService`), not necessarily the request's own."""
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
                              skip_special_tokens=self.skip_special_tokens, cache_salt=cache_salt, **set_)


class CompletionRequest(_SamplingFields):
    prompt: Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]]
    logprobs: StrictInt | None = Field(None, ge=0)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts:
            raise InvalidRequestError("prompt is empty", param="prompt")
        return prompts


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[Annotated[TextPart, Field()]] | None = None

    def for_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True

    def template_messages(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise InvalidRequestError("messages must contain at least one message", param="messages")
        return [m.for_template() for m in self.messages]


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
