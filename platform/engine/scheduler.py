"""Iteration-level continuous batching: which requests run in the next step, and how many tokens each.

Every step gets a token budget (`max_num_batched_tokens`). Running requests are served first, in
arrival order: a decoding request takes one token, a request still in (chunked) prefill takes
what is left of the budget. Then waiting requests are admitted in arrival order, their cached
prefix taken from the prefix cache, while budget, `max_num_seqs` and free KV blocks allow. When a
running request cannot get a block, the newest running request is preempted: its blocks are freed
and it goes back to the front of the queue to be recomputed later (its full blocks usually
survive in the prefix cache, so the recompute is mostly a cache hit).

With `long_prefill_token_threshold` T (vLLM's name; 0 turns it off), a prompt with more than T
tokens to compute is long: a prompt's chunk is at most T tokens a step, and one long prompt is
prefilled at a time, the first in line, while shorter prompts are admitted past the long ones
that wait. A short prompt that arrives during a long prefill then joins the next step beside its
next chunk, instead of waiting for it (and for every long prompt queued before it) to finish:
what a prefill replica needs, where most requests are short and a few prompts are long.

A request with a `prefill_pause_s` of W yields to decodes: its prompt is not prefilled in a step
that decodes running requests until W seconds after it arrived, only in the steps with nothing to
decode. A request with a `max_chunk_tokens` of C takes at most C of its prompt's tokens a step.
A decode replica that prefills a prompt itself sets both (pdserve.decode.placement): its streams
keep pure decode steps while the TTFT target leaves slack, and steps short enough for their ITL
target after that.

With `split_prompts_to_fill_steps` off, a waiting prompt that would not finish in this step is
not started in a step that already prefills another prompt: the budget left over is not filled
with its first chunk. Where a step's time grows with its tokens and a larger step buys no
efficiency (a CPU), filling only delays the first prompt's first token by the second's chunk.

A request prefilled elsewhere (`add_running`: its prompt's KV imported into its blocks) waits in
a queue of its own for a sequence slot, holding its blocks, and joins the running batch ahead of
the prompts waiting: it needs no prefill, only a slot (`max_num_seqs` bounds every step's batch).

Input: `Request`s (via `add`/`add_running`/`abort`). Output: a tensor-free `SchedulerOutput` for the runner.
It does not know about tensors, models or sampling.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    """`num_new_tokens` tokens of `request`, starting at position `start`."""
    request: Request
    start: int
    num_new_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last token, so its logits give the next one."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    joined: list[str] = field(default_factory=list)  # prefilled elsewhere, in the batch from this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int = 0, split_prompts_to_fill_steps: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.kv = kv_manager
        self.block_size = kv_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold  # 0: a chunk takes what budget is left
        self.split_prompts_to_fill_steps = split_prompts_to_fill_steps
        self.clock = clock  # arrival times, for prompts that yield to decodes
        self.waiting: deque[Request] = deque()
        self.ready: deque[Request] = deque()  # prefilled elsewhere, KV in their blocks: waiting for a slot
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Prefill tokens computed vs. served from the prefix cache, for tests and metrics.
        self.num_computed_prompt_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_preemptions = 0
        self.num_aborted = 0  # unfinished requests aborted (client gone, failed leg, shutdown)

    # -- queue management ---------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.arrival_s = self.clock()
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and free its blocks. Unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.ready:
            self.ready.remove(req)
        self.kv.free(request_id)
        if not req.is_finished:
            req.finish("abort")
            self.num_aborted += 1
        return req

    def add_running(self, request: Request) -> None:
        """A request whose prompt KV is already in its blocks (imported from a prefill replica):
        it joins the running batch at the first step with a sequence slot free."""
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.ready.append(request)
        self.kv.cache_full_blocks(request.request_id, request.block_hashes, request.num_computed_tokens)

    def finish(self, req: Request, keep_blocks: bool = False) -> None:
        """Drop a request the engine marked finished; frees its blocks unless `keep_blocks`."""
        self.running.remove(req)
        self.requests.pop(req.request_id, None)
        if not keep_blocks:
            self.kv.free(req.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.ready) + len(self.running)

    def waits_for_a_slot(self, request_id: str) -> bool:
        """Whether a request prefilled elsewhere will not join at the next step: the batch's free
        sequence slots go to those before it."""
        for place, r in enumerate(self.ready):
            if r.request_id == request_id:
                return place >= self.max_num_seqs - len(self.running)
        return False

    @property
    def num_waiting(self) -> int:
        """Requests admitted and not running: prompts waiting, and prefilled ones waiting for a slot."""
        return len(self.waiting) + len(self.ready)

    def num_queued_prefill_tokens(self) -> int:
        """Prompt tokens (and resumed outputs) admitted but not computed yet (prefix hits of waiting
        requests included).

        Safe to call from another thread: list() copies each queue under the GIL in one C call."""
        queued = list(self.waiting) + list(self.running)
        return sum(max(0, r.num_prefill_tokens - r.num_computed_tokens) for r in queued)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # A step that decodes (a request with one token left) is no place for prompts that yield.
        now = self.clock() if any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running) else None

        def yields(req: Request) -> bool:
            return now is not None and now - req.arrival_s < req.prefill_pause_s

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_tokens - req.num_computed_tokens > 1 and yields(req):
                i += 1
                continue
            n = self._chunk(req, req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
                budget -= n
                i += 1
                continue
            break

        # No admissions in a step that had to preempt: the pool is full. Prefilled requests first.
        while self.ready and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.ready[0]
            n = req.num_tokens - req.num_computed_tokens
            if not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                if not self.running:  # nothing will free a block: the newest prefilled one recomputes later
                    victim = self.ready.pop()
                    self._preempt(victim)
                    out.preempted.append(victim.request_id)
                break
            self.ready.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.joined.append(req.request_id)
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n

        is_long_running = any(self._is_long(r.num_tokens - r.num_computed_tokens) for r in self.running)
        j = 0
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[j]
            if yields(req):
                j += 1
                continue
            # Prompt logprobs need every prompt position's logits: no prefix-cache shortcut.
            wants_all_logits = req.params.prompt_logprobs is not None
            hit_blocks = [] if wants_all_logits else self.kv.match_prefix(req.block_hashes, req.num_tokens)
            num_hit = len(hit_blocks) * self.block_size
            is_long = self._is_long(req.num_tokens - num_hit)
            if is_long and is_long_running:  # it waits for the long prompt before it; shorter ones go past
                j += 1
                continue
            n = self._chunk(req, req.num_tokens - num_hit, budget)
            if n < req.num_tokens - num_hit and not self.split_prompts_to_fill_steps and _prefills(out):
                break  # it starts in a step of its own (see the module docstring)
            if not self.kv.allocate(req.request_id, num_hit + n, hit_blocks):
                break
            del self.waiting[j]
            is_long_running = is_long_running or is_long
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_preemptions == 0:
                # Prompt tokens only: a resumed request's hit may cover some of its outputs too.
                req.num_cached_tokens = min(num_hit, req.num_prompt_tokens)
                self.num_prefix_hit_tokens += req.num_cached_tokens
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, num_hit, n))
            budget -= n
        return out

    def _is_long(self, num_left: int) -> bool:
        return 0 < self.long_prefill_token_threshold < num_left

    def _chunk(self, req: Request, num_left: int, budget: int) -> int:
        """Tokens `req`, with `num_left` to compute, gets in this step."""
        return min(num_left, budget, self.long_prefill_token_threshold or budget, req.max_chunk_tokens or budget)

    def update(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts after the runner executed `out`; name newly full blocks."""
        for chunk in out.chunks:
            req = chunk.request
            prompt_part = max(0, min(chunk.end, req.num_prompt_tokens) - chunk.start)
            if req.num_preemptions == 0:
                self.num_computed_prompt_tokens += prompt_part
            req.num_computed_tokens = chunk.end
            self.kv.cache_full_blocks(req.request_id, req.block_hashes, req.num_computed_tokens)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)


def _prefills(out: SchedulerOutput) -> bool:
    """Whether the step prefills something (a chunk of more than one token; decodes take one)."""
    return any(c.num_new_tokens > 1 for c in out.chunks)
