"""A request's state inside the engine: its tokens, how many have KV computed, and its outputs.

The scheduler moves requests between waiting and running and advances `num_computed_tokens`;
the engine appends sampled tokens. Chained block hashes of all full blocks (prompt and output)
are kept up to date here so prefix caching and preemption-by-recompute can reuse them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


from pdserve.engine.block_hash import block_hashes, root_hash
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_size: int
    arrival_s: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # prompt_logprobs[i]: prompt token i given the tokens before it; None for token 0.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Prefill role: stop after the first token and keep the prompt's KV blocks for export.
    prefill_only: bool = False
    # Yield to decodes: prefill only in steps with nothing to decode until this long after arrival.
    prefill_pause_s: float = 0.0
    deadline_s: float | None = None  # absolute `time.time()` seconds; past it the engine aborts it

    def __post_init__(self):
        self.all_token_ids = list(self.prompt_token_ids)
        self.root_hash = root_hash(self.params.cache_salt)
        self.block_hashes = block_hashes(self.all_token_ids, self.block_size, self.root_hash)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) % self.block_size == 0:
            start = len(self.all_token_ids) - self.block_size
            parent = self.block_hashes[-1] if self.block_hashes else self.root_hash
            self.block_hashes.extend(block_hashes(self.all_token_ids[start:], self.block_size, parent))

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
