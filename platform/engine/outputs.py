"""What the engine emits per step for each request: `RequestOutput` (new tokens, text, logprobs,
finish) and `TokenLogprob`. Plain dataclasses with no torch at import, so the messages between
pools (`pdserve.protocol`) and the gateway can carry them without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability (from the model's raw logits) and the top alternatives."""
    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


@dataclass
class RequestOutput:
    """What one step produced for one request."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with a request's first output only
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    # Prefill role: the prompt's KV blocks, kept for export (finished with finish_reason None).
    kv_block_ids: list[int] | None = None

    @property
    def needs_decode(self) -> bool:
        return self.kv_block_ids is not None

    def merge(self, later: "RequestOutput") -> None:
        """Append the next output of the same request (a consumer that fell behind takes both at once)."""
        self.new_token_ids += later.new_token_ids
        self.new_text += later.new_text
        self.new_logprobs += later.new_logprobs
        self.finished, self.finish_reason, self.stop_reason = later.finished, later.finish_reason, later.stop_reason
        self.num_output_tokens, self.num_cached_tokens = later.num_output_tokens, later.num_cached_tokens
