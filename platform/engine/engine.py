"""`LLMEngine`: the step loop both pools share (no Ray, no threads of its own).

`add_request` validates and queues a request; each `step()` schedules a batch, runs it, appends
the sampled tokens, detokenizes them incrementally, applies stop conditions and returns one
`RequestOutput` per request that produced something. `abort_request` frees a request at any time
between steps. The engine is built from an `EngineConfig`: it loads the checkpoint and tokenizer
and sizes the KV cache.

No single request stops the engine. A step that fails for one request (its sampling, logprobs,
detokenizing or stop checks) aborts that request alone, freeing its blocks, and the step goes on
for the others; a request with a `deadline_s` is aborted at the first step after it passes, queued
or running. Each such end is kept as `(request id, RequestError)`, a `RequestFailedError` or a
`DeadlineExceededError`, until `take_failed_requests()` hands it to whoever reads the request's
outputs (`AsyncLLMEngine` raises it in that request's stream). Only a failure of the model or the
device itself (the forward pass, a collective) raises out of `step()`.

Stop conditions, in order: a stop string (text cut before it), a stop token id, EOS (unless
`ignore_eos`), a structured output that is complete (its grammar allows nothing more: "stop"),
`max_tokens`, the model's context length. The stop or EOS token stays in
`token_ids` and never appears in the text.

A request may be resumed (`add_request(..., output_token_ids=...)`): another engine generated and
streamed those outputs, then failed. They are outputs here too (penalties, `max_tokens`, the
seeded sampler's position and usage count them) and are prefilled with the prompt (the prefix
cache applies to both). They are replayed through the stop checks and the detokenizer as the
first engine ran them, their text discarded, so the next text delta is the one that engine would
have sent next: a greedy or seeded continuation is exactly the uninterrupted run's.

A request with a structured output (`SamplingParams.structured`) gets a grammar matcher at
admission (`pdserve.engine.grammar`; compiled on a miss, which `AsyncLLMEngine.prepare` does
off the step loop first), advanced by `_process_token` with every output: sampled here, taken
over from a prefill replica, or replayed for a resumed request (an output its grammar refuses is
an `InvalidRequestError`).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Sequence

import torch

from pdserve.config import EngineConfig
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.block_hash import block_hashes, root_hash
from pdserve.engine.grammar import GrammarCompiler, GrammarError
from pdserve.engine.kv_cache import BlockPool, KVCacheManager
from pdserve.engine.kv_groups import HybridKVCacheManager, layer_groups
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.llama import check_parallel
from pdserve.engine.outputs import RequestOutput, TokenLogprob
from pdserve.engine.parallel import SINGLE, ParallelState, backend_for, broadcast_step, free_init_method, init_group
from pdserve.engine.request import Request
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams, describe_value
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.engine.worker import load_rank, spawn_local_workers
from pdserve.errors import (DeadlineExceededError, InvalidRequestError, ModelLoadError, PromptTooLongError,
                            RequestError, RequestFailedError)

log = logging.getLogger(__name__)


class LLMEngine:
    """The driver of one engine (rank 0 of a parallel one).

    With `tensor_parallel_size` N > 1 it needs N-1 worker ranks in its group: by default it starts
    them itself as local processes; a caller that places them elsewhere (Ray rank workers) passes
    the group's `init_method` and starts `pdserve.engine.worker.run_worker` on each.
    """

    def __init__(self, config: EngineConfig, init_method: str | None = None):
        self.config = config
        t0 = time.perf_counter()
        self.parallel = SINGLE
        self._local_workers = []
        self._owns_group = False
        try:
            if config.tensor_parallel_size > 1:
                parallel = ParallelState(0, config.tensor_parallel_size, config.enable_expert_parallel)
                # Fail on a degree the model cannot be split by before any rank starts.
                check_parallel(ModelArch.from_dir(config.model), parallel)
                if init_method is None:
                    init_method = free_init_method()
                    self._local_workers = spawn_local_workers(config, init_method)
                init_group(0, config.tensor_parallel_size, init_method,
                           backend_for(config.device, config.distributed_backend))
                self._owns_group = True
                self.parallel = parallel
            self.tokenizer = Tokenizer(config.model)
            self.model, self.arch, self.kv_cache = load_rank(config, self.parallel)
        except BaseException:
            self._stop_workers(graceful=False)
            raise
        self.max_model_len = config.max_model_len or self.arch.context_len
        num_blocks = self.kv_cache.num_blocks
        bytes_per_block = self.kv_cache.kv[:, :, 0].numel() * self.kv_cache.kv.element_size()
        self.block_pool = BlockPool(num_blocks, config.block_size)
        groups = layer_groups(self.arch.num_layers, self.arch.layer_windows)
        self.kv_manager = (KVCacheManager(self.block_pool, config.enable_prefix_caching) if len(groups) == 1 else
                           HybridKVCacheManager(self.block_pool, groups, config.enable_prefix_caching))
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.long_prefill_token_threshold, config.split_prompts_to_fill_steps)
        self.runner = ModelRunner(self.model, self.kv_cache, self.kv_manager, Sampler(config.seed), config.device,
                                  self.parallel, self._capture_decode_graphs())
        self.eos_token_ids = set(self.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.grammars = GrammarCompiler(self.tokenizer.tok.to_str(), self.arch.vocab_size, self.eos_token_ids,
                                        config.grammar_cache_size)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._held_kv: dict[str, list[int]] = {}  # prefill-only requests' blocks awaiting export
        self._prefilled: dict[str, Request] = {}  # imported requests whose KV is being filled in
        self._deadlines: dict[str, float] = {}  # live requests that have one
        self._next_deadline_s = math.inf  # no live request's deadline is earlier
        self._failed: list[tuple[str, RequestError]] = []  # ended by a failure or deadline, not yet taken
        # Told (sequences decoded, prompt tokens computed, seconds) after every step: a decode
        # replica's placement cost model learns its step times from it.
        self.on_step: Callable[[int, int, float], None] | None = None
        # Told the requests prefilled elsewhere that join the batch in a step, before it runs.
        self.on_join: Callable[[list[str]], None] | None = None
        log.info("engine ready: %s (%s, %d layers), %d KV blocks of %d tokens (%.1f MiB), max_model_len %d, "
                 "loaded in %.1fs", config.model, self.arch.model_type, self.arch.num_layers, num_blocks,
                 config.block_size, num_blocks * bytes_per_block / 2**20, self.max_model_len,
                 time.perf_counter() - t0)

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs of the decode step where they apply: a CUDA device, one rank, a model whose
        forward pass has no host syncs, and not `enforce_eager`."""
        config = self.config
        if (torch.device(config.device).type != "cuda" or config.enforce_eager or self.parallel.size > 1
                or not getattr(self.model, "supports_cuda_graphs", False)):
            return None
        graphs = DecodeGraphs(self.model, self.kv_cache, config.max_num_seqs,
                              -(-self.max_model_len // config.block_size), config.device)
        try:
            graphs.capture()
        except RuntimeError as e:  # out of memory, or an op that cannot be captured
            raise ModelLoadError(f"capturing the decode step as CUDA graphs failed ({e}); set enforce_eager: "
                                 "true to run without them") from e
        return graphs

    def shutdown(self) -> None:
        """Release the worker ranks of a parallel engine (nothing to do for a single rank)."""
        self._stop_workers(graceful=True)

    def _stop_workers(self, graceful: bool) -> None:
        import torch.distributed as dist

        if self._owns_group and dist.is_initialized():
            self._owns_group = False
            if graceful:
                try:
                    broadcast_step(None, self.runner.device)
                except RuntimeError as e:  # a rank is gone already
                    log.warning("stopping the worker ranks: %s", e)
            dist.destroy_process_group()
        for p in self._local_workers:
            p.join(timeout=10 if graceful else 0)
            if p.is_alive():
                p.kill()
        self._local_workers = []

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prefill_only: bool = False, prefill_pause_s: float = 0.0, deadline_s: float | None = None,
                    output_token_ids: Sequence[int] = (), max_chunk_tokens: int = 0) -> None:
        """Queue a request. With `prefill_only` it stops after its first token unless that token
        already ends it; its output then carries `kv_block_ids`, the prompt's blocks, which stay
        allocated until `release_kv` (the prefill role exports them in between). With
        `prefill_pause_s`, its prompt yields to decodes for that long, and with `max_chunk_tokens` a
        step computes at most that many of its tokens (see the scheduler). With
        `deadline_s` (absolute `time.time()` seconds), it is aborted once that passes (see the
        module docstring); one already past raises `DeadlineExceededError` here. With
        `output_token_ids` it is resumed (see the module docstring): outputs that already end it
        raise `InvalidRequestError`. Resumed and `prefill_only`, its blocks hold the prompt's and
        those outputs' KV, and its first output is the one after them."""
        req = self._new_request(request_id, prompt_token_ids, params, deadline_s, output_token_ids)
        req.prefill_only, req.prefill_pause_s, req.max_chunk_tokens = prefill_only, prefill_pause_s, max_chunk_tokens
        self.scheduler.add(req)
        self._track_deadline(req)

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                              first: RequestOutput, deadline_s: float | None = None,
                              output_token_ids: Sequence[int] = ()) -> tuple[int, list[int] | None]:
        """Take over a request another engine prefilled (decode role), up to its first token
        (resumed: `output_token_ids` as `add_request`'s, prefilled there with the prompt, and
        `first` the output after them).

        Reuses this cache's prefix of the prompt (and outputs) and allocates blocks for the rest; returns
        `(num_local_blocks, block_ids_to_fill)`: the caller fills those blocks with the exporter's
        blocks from index `num_local_blocks` on, then calls `start_prefilled_request`, or
        `abort_request` on failure. Without free blocks it returns `(0, None)`: start it with
        `recompute` and it waits in the queue like any new request. `deadline_s`: as `add_request`
        (it is not checked while the blocks are being filled: the caller bounds the pull).
        """
        req = self._new_request(request_id, prompt_token_ids, params, deadline_s, output_token_ids)
        try:
            self._process_token(req, first.new_token_ids[0], first.new_logprobs[0] if first.new_logprobs else None)
        except Exception as e:  # noqa: BLE001 - this request's alone
            del self._detokenizers[request_id]
            raise self._failure(request_id, e) from e
        self._prefilled[request_id] = req
        self._track_deadline(req)
        hit = self.kv_manager.match_prefix(req.block_hashes, req.num_tokens)
        if not self.kv_manager.allocate(request_id, req.num_prefill_tokens, hit, req.num_prefill_tokens):
            return 0, None  # no room now: the caller starts it with recompute, to wait its turn here
        # What the client's usage counts as cached: the prompt tokens the prefill replica did not
        # compute (this replica's own hits only save transfer, not compute).
        req.num_cached_tokens = first.num_cached_tokens
        return self.kv_manager.import_blocks(request_id, req.num_prefill_tokens, len(hit))

    def start_prefilled_request(self, request_id: str, recompute: bool = False) -> None:
        """The blocks from `add_prefilled_request` hold the prompt's KV: decode from the next step.
        With `recompute` (the pull failed, or there were no free blocks) the request instead queues
        to prefill here, like a preempted one; nothing the client saw changes. Without blocks and
        without `recompute` it raises ValueError and stays to be started or aborted: decoding on no
        KV would read whatever its block table's slots held before (the GPU suite's reference did)."""
        if not recompute and request_id not in self.kv_manager.block_tables:
            raise ValueError(f"request {request_id!r} holds no blocks (add_prefilled_request found no room): "
                             "start it with recompute=True, or abort it")
        req = self._prefilled.pop(request_id)
        if recompute:
            self.kv_manager.free(request_id)
            self.scheduler.add(req)
            return
        req.num_computed_tokens = req.num_prefill_tokens
        self.scheduler.add_running(req)

    def num_uncached_prompt_tokens(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
        """Prompt tokens this engine's prefix cache does not hold (decides local vs. remote prefill)."""
        hashes = block_hashes(prompt_token_ids, self.kv_cache.block_size, root_hash(cache_salt))
        return len(prompt_token_ids) - len(self.kv_manager.match_prefix(hashes, len(prompt_token_ids))) * \
            self.kv_cache.block_size

    def release_kv(self, request_id: str) -> None:
        """Free the blocks a prefill-only request kept (after they were exported and pinned)."""
        if self._held_kv.pop(request_id, None) is not None:
            self.kv_manager.free(request_id)

    def _new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     deadline_s: float | None, output_token_ids: Sequence[int] = ()) -> Request:
        if request_id in self.scheduler.requests or request_id in self._prefilled:
            raise InvalidRequestError(f"request id {request_id!r} is already running", param="request_id")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token", param="prompt")
        if len(output_token_ids) >= params.max_tokens:  # bounded before any of them is read
            raise InvalidRequestError(f"the resumed outputs already end the request (length) at output "
                                      f"{params.max_tokens} of {len(output_token_ids)}", param="output_token_ids")
        vocab = self.arch.vocab_size
        for param, ids in (("prompt", prompt_token_ids), ("output_token_ids", output_token_ids)):
            bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"token id {describe_value(bad)} is outside the vocabulary [0, {vocab})",
                                          param=param)
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"stop token id {describe_value(bad)} is outside the vocabulary [0, {vocab})",
                                      param="stop_token_ids")
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"logit_bias token id {describe_value(bad)} is outside the vocabulary "
                                      f"[0, {vocab})", param="logit_bias")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {n} "
                f"tokens, leaving no room for output. Shorten the prompt.", param="prompt")
        max_chunk = self.config.long_prefill_token_threshold or self.config.max_num_batched_tokens
        need_blocks = self.kv_manager.max_blocks_for(min(n + params.max_tokens, self.max_model_len), max_chunk)
        if need_blocks > self.block_pool.num_blocks:
            raise PromptTooLongError(
                f"prompt plus max_tokens needs {need_blocks} KV blocks but this engine has "
                f"{self.block_pool.num_blocks}; lower max_tokens or shorten the prompt", param="max_tokens")
        if deadline_s is not None and time.time() >= deadline_s:
            raise DeadlineExceededError("the request's deadline passed before it was queued")
        req = Request(request_id, list(prompt_token_ids), params, self.kv_cache.block_size, time.monotonic(),
                      deadline_s=deadline_s)
        if params.structured is not None:
            try:
                req.grammar = self.grammars.matcher(params.structured)
            except GrammarError as e:
                raise InvalidRequestError(f"invalid structured output: {e}", param="structured_outputs") from None
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop,
                                                                params.skip_special_tokens)
        if output_token_ids:
            self._replay_outputs(req, output_token_ids)
        return req

    def _replay_outputs(self, req: Request, output_token_ids: Sequence[int]) -> None:
        """Resume `req` after `output_token_ids`: each goes through `_process_token` as when it was
        sampled (the detokenizer's pending bytes and held-back stop-string window, the stop
        checks), its text discarded: the client has it already."""
        try:
            for token_id in output_token_ids:
                self._process_token(req, token_id, None)
                if req.grammar is not None and req.grammar.error is not None:
                    raise InvalidRequestError(f"the resumed outputs break the request's structured output at "
                                              f"output {req.num_output_tokens}", param="output_token_ids")
                if req.is_finished:
                    raise InvalidRequestError(f"the resumed outputs already end the request ({req.finish_reason}) "
                                              f"at output {req.num_output_tokens} of {len(output_token_ids)}",
                                              param="output_token_ids")
        except InvalidRequestError:
            del self._detokenizers[req.request_id]
            raise
        except Exception as e:  # noqa: BLE001 - this request's alone (its detokenizing)
            del self._detokenizers[req.request_id]
            raise self._failure(req.request_id, e) from e
        req.num_resumed_tokens = len(output_token_ids)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; False when it is unknown or already finished."""
        self._detokenizers.pop(request_id, None)
        self._deadlines.pop(request_id, None)
        self.release_kv(request_id)
        if self._prefilled.pop(request_id, None) is not None:
            self.kv_manager.free(request_id)
            return True
        return self.scheduler.abort(request_id) is not None

    @property
    def num_free_kv_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    def take_failed_requests(self) -> list[tuple[str, RequestError]]:
        """The requests the steps since the last call ended with an error, each with its error
        (`RequestFailedError` or `DeadlineExceededError`); they are aborted and hold nothing."""
        failed, self._failed = self._failed, []
        return failed

    def _track_deadline(self, req: Request) -> None:
        if req.deadline_s is not None:
            self._deadlines[req.request_id] = req.deadline_s
            self._next_deadline_s = min(self._next_deadline_s, req.deadline_s)

    def _expire_deadlines(self) -> None:
        """Abort the queued and running requests whose deadline has passed. It looks at them only
        once the earliest deadline has passed: until then a step pays one comparison."""
        now = time.time()
        if now < self._next_deadline_s:
            return
        for request_id, deadline_s in list(self._deadlines.items()):
            req = self.scheduler.requests.get(request_id)
            # One still in `_prefilled` has a pull writing into its blocks: its caller ends it.
            if deadline_s <= now and req is not None:
                error = DeadlineExceededError(f"the request's deadline passed while it was {req.status.value}")
                self.abort_request(request_id)
                self._failed.append((request_id, error))
        self._next_deadline_s = min(self._deadlines.values(), default=math.inf)

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._deadlines:
            self._expire_deadlines()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        if plan.joined and self.on_join is not None:
            self.on_join(plan.joined)
        for p in self._local_workers:  # a collective with a dead rank would wait, not fail
            if not p.is_alive():
                raise RuntimeError(f"worker rank {p.name} exited with {p.exitcode}; this engine cannot step")
        started = time.perf_counter()
        sampled = self.runner.execute(plan)
        if self.on_step is not None:
            num_decodes = sum(c.num_new_tokens == 1 for c in plan.chunks)
            self.on_step(num_decodes, plan.num_batched_tokens - num_decodes, time.perf_counter() - started)
        self.scheduler.update(plan)
        outputs = []
        for s in sampled:
            error = s.error
            if error is None:
                try:
                    outputs.append(self._process(s.request, s.token_id, s.logprob))
                except Exception as e:  # noqa: BLE001 - pinned to this request: it alone ends
                    error = e
            if error is not None:
                self._fail(s.request.request_id, error)
        return outputs

    def _fail(self, request_id: str, cause: Exception) -> None:
        """End a request a step failed on, alone: abort it, free whatever it holds, keep its error."""
        self.abort_request(request_id)
        self.kv_manager.free(request_id)  # blocks a half-done `_process` left with no owner (no-op otherwise)
        self._failed.append((request_id, self._failure(request_id, cause)))

    def _failure(self, request_id: str, cause: Exception) -> RequestFailedError:
        """The error a client sees for a request that failed in this engine: the cause is logged
        here with the request id, and kept only as `__cause__` (not in the message)."""
        log.error("request %s failed in the engine (%r); aborted it, the engine goes on", request_id, cause,
                  exc_info=cause)
        error = RequestFailedError()
        error.__cause__ = cause
        return error

    def _process(self, req: Request, token_id: int, logprob: TokenLogprob | None) -> RequestOutput:
        text = self._process_token(req, token_id, logprob)
        kv_block_ids = None
        if not req.is_finished and req.prefill_only:
            req.finish(None)  # finished here, to be continued by a decode engine
            del self._detokenizers[req.request_id]
            self.scheduler.finish(req, keep_blocks=True)
            kv_block_ids = self._held_kv[req.request_id] = self.kv_manager.export_blocks(req.request_id)
        elif req.is_finished:
            text += self._detokenizers.pop(req.request_id).flush()
            self.scheduler.finish(req)
        if req.is_finished:
            self._deadlines.pop(req.request_id, None)
        first = req.num_output_tokens == 1
        return RequestOutput(req.request_id, [token_id], text, req.is_finished, req.finish_reason,
                             req.stop_reason, [logprob] if logprob is not None else [],
                             req.prompt_logprobs if first and req.params.prompt_logprobs is not None else None,
                             req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens, kv_block_ids)

    @staticmethod
    def _grammar_ends(req: Request, token_id: int) -> bool:
        """Advance the request's grammar by its new output; True when nothing can follow it. A
        token the grammar refuses leaves the matcher in error (the sampler's next mask, or the
        replay, raises for this request alone)."""
        return req.grammar.advance(token_id) and req.grammar.is_stopped

    def _process_token(self, req: Request, token_id: int, logprob: TokenLogprob | None) -> str:
        """Append a sampled token, apply the stop conditions; returns the new text. A stop token
        (EOS, `stop_token_ids`) adds no text, as in vLLM: with `skip_special_tokens` false,
        EOS's own text (`</s>`) would otherwise end the output (and follow a tool call)."""
        req.append_token(token_id)
        if logprob is not None:
            req.output_logprobs.append(logprob)
        detok = self._detokenizers[req.request_id]
        p = req.params
        if token_id in p.stop_token_ids:
            req.finish("stop", token_id)
            return ""
        if not p.ignore_eos and token_id in self.eos_token_ids:
            req.finish("stop", None)
            return ""
        text = detok.add(token_id)
        if detok.stopped_by is not None:
            req.finish("stop", detok.stopped_by)
        elif req.grammar is not None and self._grammar_ends(req, token_id):
            req.finish("stop", None)
        elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            req.finish("length")
        return text
