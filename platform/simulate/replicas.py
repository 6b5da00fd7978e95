"""The simulated engine replicas: their queues, batches and KV blocks, one event per engine step.

`SimPrefill` runs chunked prefill (first come, first served; each step packs prompt chunks up to
the step budget, or only whole prompts beside another as the engine does with
`split_prompts_to_fill_steps` off). `SimDecode` runs continuous batching: every step decodes each
running stream once, plus at most one chunk of a locally prefilled prompt; a stream's last step
is known when it joins (it asks for a fixed number of tokens), so a step costs O(1) bookkeeping
plus the streams that finish in it, never a walk over the batch. Each step's duration comes from the roofline
(`StepCost`), stretched on a shared host (`SharedCores`), and feeds the replica's `CostModel`
exactly as a real replica's engine does (`on_step(num_decodes, num_prefill_tokens, seconds)`).

A decode replica takes up to `max_ongoing_requests` requests (Ray Serve's bound; the rest wait
for a replica with room) and places each at once. Its engine holds what the real one holds, when
it holds it: a remotely prefilled request's blocks from its import (before the pull; none free: it
recomputes here), a sequence slot (of `max_num_seqs`) once it joins the batch, waiting pulled in
`ready` meanwhile, ahead of local prompts; a local prompt takes its slot and blocks as its first
chunk starts. Blocks are a request's whole length (prompt + output, as the decode router counts
it), so the simulation never preempts (the real scheduler takes blocks as the sequence grows and
preempts when short: at high occupancy the simulation is the more conservative). Prefill
replicas' blocks and leases are not modelled. They know nothing of routing or placement: the
`Simulation` calls them and they call back `sim.at` (schedule), `sim.first_token`, `sim.finished`,
`sim.prefill_done` and `sim.changed`.
"""

from __future__ import annotations

import math
from collections import deque

from pdserve.decode.placement import CostModel
from pdserve.telemetry.averages import Average
from pdserve.simulate.roofline import StepCost, prefill_pairs


class SharedCores:
    """The cores of one `Host` (hardware.py) as the engines and the request path use them: an
    engine step takes `stretch()` times its own time when the engines mid-step, the app's idle
    load and the path's recent CPU use (`spend`, a rate decayed over `TAU_S`) ask for more cores
    than there are (each busy thing gets an equal share). The stretch is set when a step starts."""

    TAU_S = 1.0

    def __init__(self, host):
        self.host = host
        self.num_busy = 0  # engines mid-step
        self._path_cores = 0.0  # the path's CPU seconds a second, lately
        self._at = 0.0

    def _decay(self, now: float) -> None:
        if now > self._at:
            self._path_cores *= math.exp((self._at - now) / self.TAU_S)
            self._at = now

    def spend(self, cpu_s: float, now: float) -> None:
        self._decay(now)
        self._path_cores += cpu_s / self.TAU_S

    def stretch(self, now: float) -> float:
        self._decay(now)
        demand = self.num_busy + self.host.idle_cores + self._path_cores
        return demand / self.host.cores if demand > self.host.cores else 1.0


class Req:
    __slots__ = ("id", "arrival", "prompt", "output", "prefix_id", "prefix_tokens", "blocks", "decode",
                 "uncached", "dispatched", "ahead", "first", "pull_bytes", "placed", "routed")

    def __init__(self, rid: int, arrival: float, prompt: int, output: int, prefix_id, prefix_tokens: int,
                 blocks: int):
        self.id, self.arrival, self.prompt, self.output = rid, arrival, prompt, output
        self.prefix_id, self.prefix_tokens, self.blocks = prefix_id, prefix_tokens, blocks
        self.decode = None
        self.uncached = prompt  # prompt tokens the decode replica's cache lacks
        self.dispatched = self.ahead = self.first = self.pull_bytes = self.routed = 0
        self.placed = None  # (path, mean predicted TTFT, when placed), as the real decode replica keeps it


class _Replica:
    def __init__(self, sim, name: str, cost: StepCost, budget: int):
        self.sim, self.name, self.cost, self.budget = sim, name, cost, budget
        self.busy = False
        self.is_active = True  # routable: started and not draining
        self.version = 0  # bumped on every change the routers rank by
        self.started_s = 0.0
        self.num_steps = 0
        self.host = sim.config.host  # its Python beside its engine takes time only on a shared host

    def _shared_stretch(self, now: float) -> float:
        """How much slower than its own time the step starting now runs (1 off a shared host)."""
        cores = self.sim.cores
        if cores is None:
            return 1.0
        cores.num_busy += 1
        return cores.stretch(now)

    def _step_ended(self) -> None:
        if self.sim.cores is not None:
            self.sim.cores.num_busy -= 1


class SimPrefill(_Replica):
    def __init__(self, sim, name: str, cost: StepCost, budget: int, num_blocks: int):
        super().__init__(sim, name, cost, budget)
        self.num_blocks = num_blocks
        self.queue: deque[list] = deque()  # [req, remaining tokens, tokens done (cached + computed), cached]
        self.queued_tokens = 0
        self.prefill_rate = Average(0.0)  # its prompt tokens a second, told with each result (as the real one)
        self._plan: list[tuple[list, int]] = []

    @property
    def is_idle(self) -> bool:
        return not self.queue and not self.busy

    def enqueue(self, req: Req, num_uncached: int, now: float) -> None:
        self.queue.append([req, num_uncached, req.prompt - num_uncached, req.prompt - num_uncached])
        self.queued_tokens += num_uncached
        self.sim.changed(self)
        if not self.busy:
            self._start(now)

    def _start(self, now: float) -> None:
        left, plan, kv, pairs = self.budget, [], 0, 0.0
        for entry in self.queue:
            c = min(entry[1], left)
            if c < entry[1] and plan and not self.sim.config.split_prompts_to_fill_steps:
                break  # as the engine: a prompt that would not finish starts in a step of its own
            plan.append((entry, c))
            kv += entry[2] + c
            pairs += prefill_pairs(entry[2], c)
            left -= c
            if not left:
                break
        if not plan:
            self.busy = False
            return
        self.busy, self._plan = True, plan
        tokens = self.budget - left
        # Each prompt it finishes hands its KV over at the end of the step.
        own = sum(self.host.prefill_own_s(entry[0].prompt, entry[3]) for entry, c in plan if c == entry[1]) \
            if self.host else 0.0
        dt = (self.cost.seconds(tokens, kv, pairs) + own) * self._shared_stretch(now)
        self.prefill_rate.add(tokens / dt)
        self.sim.prefill_step(tokens, dt)
        self.sim.at(now + dt, self._end, None)

    def _end(self, now: float, _) -> None:
        self._step_ended()
        self.num_steps += 1
        for entry, c in self._plan:
            entry[1] -= c
            entry[2] += c
            self.queued_tokens -= c
            if entry[1] == 0:
                self.queue.popleft()  # the plan takes the queue's head first: finished ones lead
                self.sim.prefill_done(entry[0], self, now)
        self.sim.changed(self)
        self._start(now)


class SimDecode(_Replica):
    def __init__(self, sim, name: str, cost: StepCost, budget: int, num_blocks: int, max_num_seqs: int,
                 max_ongoing_requests: int):
        super().__init__(sim, name, cost, budget)
        # The priors a real replica starts from; its prediction errors dated in simulated time.
        self.cm = CostModel(percentile=sim.config.slo.percentile, clock=lambda: sim.now)
        self.num_blocks, self.max_num_seqs, self.max_ongoing_requests = num_blocks, max_num_seqs, max_ongoing_requests
        h = self.host
        self.request_s, self.step_s, self.token_s, self.join_s = (
            (h.decode_request_s, h.decode_step_s, h.decode_token_s, h.decode_join_s) if h else (0.0,) * 4)
        self.jitter = h.decode_step_jitter_s if h else ()
        self.num_in_flight = 0  # requests routed here and not finished (what max_ongoing_requests bounds)
        self.routed_blocks = 0  # their blocks, as the decode router counts what it sent
        self.used_blocks = 0  # blocks the engine holds (imported or prefilling here, waiting, decoding)
        self.num_running = 0
        self.context_tokens = 0  # KV tokens of the running streams (what a decode step reads)
        self.finishing: dict[int, list[Req]] = {}  # step number -> streams whose last token it makes
        self.ready: deque[Req] = deque()  # pulled, holding blocks, waiting for a sequence slot
        self.joining: list[Req] = []  # holding a slot, joining the batch at the next step
        # [req, remaining, done, chunk tokens (0: budget), pause until, holds a slot and blocks]
        self.local: deque[list] = deque()
        self.local_queued_tokens = 0
        self.remote_queued_tokens = 0  # uncached tokens of this replica's prompts with the prefill pool
        self._decodes = self._chunk = 0
        self._started = 0.0

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.used_blocks

    @property
    def is_idle(self) -> bool:
        return not (self.busy or self.num_in_flight)

    @property
    def has_room(self) -> bool:
        return self.num_in_flight < self.max_ongoing_requests

    @property
    def _prefilling(self) -> bool:
        """Whether the first local prompt holds its slot and blocks (its prefill has started)."""
        return bool(self.local and self.local[0][5])

    @property
    def num_waiting(self) -> int:
        """Requests here waiting for a sequence slot: pulled ones, and local prompts not started."""
        return len(self.ready) + len(self.local) - self._prefilling

    @property
    def num_seqs(self) -> int:
        """Sequence slots held: the batch, those joining it, a local prompt prefilling."""
        return self.num_running + len(self.joining) + self._prefilling

    def route(self, req: Req, now: float) -> None:
        """A request the decode router chose this replica for: placed at once."""
        req.decode, req.routed = self, now
        self.sim.window.num_routed += 1
        self.num_in_flight += 1
        self.routed_blocks += req.blocks
        self.sim.changed(self)
        self.sim.place_prefill(req, self, now)

    def reserve(self, req: Req) -> bool:
        """Blocks for a remotely prefilled request's KV, before its pull (False: none free)."""
        if req.blocks > self.num_blocks - self.used_blocks:
            return False
        self.used_blocks += req.blocks
        return True

    def prefill_locally(self, req: Req, chunk_tokens: int, pause_until: float, now: float) -> None:
        self.local.append([req, req.uncached, req.prompt - req.uncached, chunk_tokens, pause_until, False])
        self.local_queued_tokens += req.uncached
        if not self.busy:
            self._start(now)

    def join(self, req: Req, now: float) -> None:
        """The request's KV is here (pulled): it joins the batch at the next step with a slot free."""
        self.ready.append(req)
        if not self.busy:
            self._start(now)

    def _start(self, now: float) -> None:
        self.busy = True  # what a finish below sets off (admissions, placements) waits for this step
        free = self.max_num_seqs - self.num_seqs
        while self.ready and free > 0:  # pulled requests take free slots first, as the scheduler's `ready`
            self.joining.append(self.ready.popleft())
            free -= 1
        joined = 0.0  # the joining requests' time in this step
        while self.joining:
            joining, self.joining = self.joining, []
            for req in joining:  # its first token goes out as it joins
                joined += self.join_s
                if self.sim.cores is not None:  # the rest of its time here runs beside the engine
                    self.sim.cores.spend(max(0.0, self.request_s - self.join_s)
                                         + self.host.decode_prompt_s(req.prompt, req.prompt - req.uncached), now)
                self.sim.first_token(req, now)
                if req.output == 1:
                    self._finish(req, now)
                    continue
                self.num_running += 1
                self.context_tokens += req.prompt
                self.finishing.setdefault(self.num_steps + req.output - 1, []).append(req)
        n, chunk, kv, pairs = self.num_running, 0, self.context_tokens, float(self.context_tokens)
        if self.local:
            head = self.local[0]
            if not head[5] and n < self.max_num_seqs and head[0].blocks <= self.num_blocks - self.used_blocks:
                head[5] = True  # admitted: a slot and its blocks
                self.used_blocks += head[0].blocks
            if head[5] and (not n or now >= head[4]):  # a pause yields to decodes only while there are any
                # The step's budget goes to the decodes first (the scheduler's order), then the chunk.
                chunk = max(0, min(head[1], head[3] if n and head[3] else self.budget, self.budget - n))
                if chunk:
                    kv += head[2] + chunk
                    pairs += prefill_pairs(head[2], chunk)
        if not n and not chunk:
            self.busy = False
            return
        self._decodes, self._chunk, self._started = n, chunk, now
        own = self.cost.seconds(n + chunk, kv, pairs) + self.step_s + n * self.token_s + joined
        if self.jitter:  # a percentile drawn at random: the step's own cost spreads as measured (never below 0)
            own += max(-self.step_s, self.jitter[int(self.sim.rng.random() * len(self.jitter))])
        self.sim.at(now + own * self._shared_stretch(now), self._end, None)

    def _end(self, now: float, _) -> None:
        self._step_ended()
        dt = now - self._started
        n, chunk = self._decodes, self._chunk
        self.cm.step(n, chunk, dt)
        self.num_steps += 1
        if n:
            self.context_tokens += n
            self.sim.tokens(n, dt)
        if chunk:
            head = self.local[0]
            head[1] -= chunk
            head[2] += chunk
            self.local_queued_tokens -= chunk
            if head[1] == 0:
                self.local.popleft()
                self.sim.local_prefill_done(head[0], self, now)
                self.joining.append(head[0])
        for req in self.finishing.pop(self.num_steps, ()):
            self.num_running -= 1
            self.context_tokens -= req.prompt + req.output - 1
            self._finish(req, now)
        self._start(now)

    def _finish(self, req: Req, now: float) -> None:
        self.used_blocks -= req.blocks
        self.routed_blocks -= req.blocks
        self.num_in_flight -= 1
        self.sim.finished(req, now)
        self.sim.changed(self)
        self.sim.route_pending(now)
