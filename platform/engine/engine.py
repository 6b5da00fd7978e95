"""`LLMEngine`: the step loop both pools share (no Ray, no threads of its own).

`add_request` validates and queues a request; each `step()` schedules a batch, runs it, appends
the sampled tokens, detokenizes them incrementally, applies stop conditions and returns one
`RequestOutput` per request that produced something. `abort_request` frees a request at any time
between steps. The engine is built from an `EngineConfig`: it loads the checkpoint and tokenizer
and sizes the KV cache.

Stop conditions, in order: a stop string (text cut before it), a stop token id, EOS (unless
`ignore_eos`), `max_tokens`, the model's context length. The stop or EOS token stays in
`token_ids` and never appears in the text.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from pdserve.config import EngineConfig
from pdserve.engine.kv_cache import BlockPool, KVCache, KVCacheManager
from pdserve.engine.models.arch import parse_dtype
from pdserve.engine.models.loader import load_model
from pdserve.engine.request import Request, TokenLogprob
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.errors import InvalidRequestError, ModelLoadError, PromptTooLongError

log = logging.getLogger(__name__)


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


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        dtype = None if config.dtype == "auto" else parse_dtype(config.dtype)
        t0 = time.perf_counter()
        self.tokenizer = Tokenizer(config.model)
        self.model, self.arch = load_model(config.model, dtype, config.device, config.max_model_len)
        self.max_model_len = config.max_model_len or self.arch.context_len
        if self.max_model_len > self.arch.context_len:
            raise ModelLoadError(f"max_model_len {self.max_model_len} exceeds the model's context length "
                                 f"{self.arch.context_len}")
        kv_dtype = next(self.model.parameters()).dtype
        bytes_per_block = KVCache.bytes_per_block_for(self.arch.num_layers, config.block_size,
                                                      self.arch.num_kv_heads, self.arch.head_dim, kv_dtype)
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory_bytes // bytes_per_block)
        self.kv_cache = KVCache(self.arch.num_layers, num_blocks, config.block_size, self.arch.num_kv_heads,
                                self.arch.head_dim, kv_dtype, config.device)
        self.block_pool = BlockPool(num_blocks, config.block_size)
        self.kv_manager = KVCacheManager(self.block_pool, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.kv_cache, self.kv_manager, Sampler(config.seed), config.device)
        self.eos_token_ids = set(self.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        log.info("engine ready: %s (%s, %d layers), %d KV blocks of %d tokens (%.1f MiB), max_model_len %d, "
                 "loaded in %.1fs", config.model, self.arch.model_type, self.arch.num_layers, num_blocks,
                 config.block_size, num_blocks * bytes_per_block / 2**20, self.max_model_len,
                 time.perf_counter() - t0)

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running", param="request_id")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token", param="prompt")
        vocab = self.arch.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})", param="prompt")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {n} "
                f"tokens, leaving no room for output. Shorten the prompt.", param="prompt")
        need_blocks = -(-min(n + params.max_tokens, self.max_model_len) // self.kv_cache.block_size)
        if need_blocks > self.block_pool.num_blocks:
            raise PromptTooLongError(
                f"prompt plus max_tokens needs {need_blocks} KV blocks but this engine has "
                f"{self.block_pool.num_blocks}; lower max_tokens or shorten the prompt", param="max_tokens")
        req = Request(request_id, list(prompt_token_ids), params, self.kv_cache.block_size, time.monotonic())
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop,
                                                                params.skip_special_tokens)
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; False when it is unknown or already finished."""
        self._detokenizers.pop(request_id, None)
        return self.scheduler.abort(request_id) is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        sampled = self.runner.execute(plan)
        self.scheduler.update(plan)
        return [self._process(s.request, s.token_id, s.logprob) for s in sampled]

    def _process(self, req: Request, token_id: int, logprob: TokenLogprob | None) -> RequestOutput:
        req.append_token(token_id)
        if logprob is not None:
            req.output_logprobs.append(logprob)
        detok = self._detokenizers[req.request_id]
        text = detok.add(token_id)
        p = req.params
        if detok.stopped_by is not None:
            req.finish("stop", detok.stopped_by)
        elif token_id in p.stop_token_ids:
            req.finish("stop", token_id)
        elif not p.ignore_eos and token_id in self.eos_token_ids:
            req.finish("stop", None)
        elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            req.finish("length")
        if req.is_finished:
            text += detok.flush()
            del self._detokenizers[req.request_id]
            self.scheduler.finish(req)
        first = req.num_output_tokens == 1
        return RequestOutput(req.request_id, [token_id], text, req.is_finished, req.finish_reason,
                             req.stop_reason, [logprob] if logprob is not None else [],
                             req.prompt_logprobs if first and p.prompt_logprobs is not None else None,
                             req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens)
