"""Where a decode replica has a prompt prefilled, from an online cost model and the latency target.

A decode replica either sends a prompt to the prefill pool ("remote": its KV is pulled back) or
prefills it in its own steps beside the streams it decodes ("local"). `place` predicts both:

- remote TTFT: the prompt tokens queued on the prefill pool's least-queued replica, as this
  replica's router for the pool sees them now (every decode replica's prompts: a queue that
  other replicas filled, or that drained, shows at once, not a call later), plus this one's
  uncached tokens, at the pool's measured prefill rate; plus what a call took beyond that (the
  hops, reports' age), as measured; plus the KV transfer at the measured link rate; plus a
  decode step (the request joins the batch between two steps).
- local TTFT: this replica's own queued prefill tokens plus this prompt's, in chunks sized so a
  step stays inside `itl_s` (every stream here, and any that joins meanwhile, keeps its pace), each
  chunk in one step beside the decodes.
- ITL damage: the stall local prefill adds to the streams here, the prefill's seconds times the
  streams it slows (at least one: a stream that joins during it waits too). Remote prefill adds
  none: that is what disaggregation is for.

The rule: of the paths that meet the TTFT target, the one with the least damage (remote whenever
it meets the target); when neither does, the sooner. A local prefill gets its chunk size and a
pause: while the TTFT target leaves slack, it prefills only in steps with nothing to decode
(see the scheduler's `prefill_pause_s`).

The rates come from `CostModel`, moving averages of what this replica measures (its engine steps,
its remote prefill calls, its pulls), starting from priors. Averages predict the mean; the target
holds for a percentile of requests, so each path's prediction carries a margin: that percentile of
how far its recent first tokens came after their predictions (queues, hops and other processes
vary more than any average says), over the last minute at most. Pure logic: no Ray, no engine.

Beside it, `kv_read_share`: the same replica's steps as the joint autoscaling policy needs them
(how much of a step grows with the batch, so how a smaller pool's steps lengthen).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from pdserve.telemetry.averages import Average, Tail

# Prediction errors kept per path: at 256, a 99th percentile is the third largest. Kept a minute at
# most: a margin measured under a past load must not outlive it, least of all on a path it keeps
# unused (no new errors would ever replace the old).
ERROR_SAMPLES = 256
ERROR_HORIZON_S = 60.0
# Below this many first tokens on a path its margin is 0: a handful of requests says nothing of a tail.
MIN_ERROR_SAMPLES = 20

@dataclass(frozen=True)
class Target:
    """The latency target placement aims at (`ServeConfig.slo`), in seconds."""
    ttft_s: float
    itl_s: float


@dataclass(frozen=True)
class Rates:
    """What the cost model has measured (or assumes, before any sample)."""
    decode_step_s: float  # a step of this replica that only decodes, at its recent batch size
    prefill_token_s: float  # the time one more prompt token adds to a step of this replica
    remote_tokens_per_s: float  # prompt tokens a prefill replica computes per second (as it reports)
    remote_wait_s: float  # what a remote prefill call takes beyond computing the tokens it waits behind
    link_bytes_per_s: float  # KV pulled per second from a prefill replica
    # How much later than predicted a first token comes, at the target's percentile, per path
    remote_margin_s: float = 0.0
    local_margin_s: float = 0.0


@dataclass(frozen=True)
class Load:
    """One prompt and the replica's state as it arrives."""
    num_uncached_tokens: int  # the prompt tokens this replica's cache lacks
    num_remote_queued_tokens: int  # prompt tokens a remote prefill sent now waits behind (the least queue)
    num_local_queued_tokens: int  # prompt tokens waiting in this replica's own prefill queue
    num_running: int  # streams this replica decodes
    kv_bytes_per_token: int
    max_chunk_tokens: int  # the engine's step budget (max_num_batched_tokens)


@dataclass(frozen=True)
class Placement:
    where: str  # "remote" | "local"
    reason: str  # why, in words (logged, and counted by decision)
    remote_ttft_s: float  # predicted at the target's percentile (mean + margin): what the rule compares
    local_ttft_s: float
    local_damage_s: float  # stream-seconds of stall a local prefill would add
    chunk_tokens: int  # local: most prompt tokens a step takes (0: any)
    pause_s: float  # local: how long it yields to decodes first (the TTFT target's slack)
    expected_ttft_s: float  # the chosen path's mean prediction, its pause included (its error is measured against it)


def kv_read_share(kv_bytes: float, weight_bytes: float) -> float:
    """Of the bytes a decode step streams (the weights once, and the KV of every sequence in the
    batch: decode is memory-bound), the share that is KV: the part of a step's time that grows with
    the batch. `kv_bytes`: the KV the replica holds."""
    return kv_bytes / (kv_bytes + weight_bytes) if kv_bytes > 0 else 0.0


def place(load: Load, rates: Rates, target: Target) -> Placement:
    num_remote_tokens = load.num_remote_queued_tokens + load.num_uncached_tokens
    remote = (rates.remote_wait_s + num_remote_tokens / rates.remote_tokens_per_s
              + load.num_uncached_tokens * load.kv_bytes_per_token / rates.link_bytes_per_s + rates.decode_step_s
              + rates.remote_margin_s)
    chunk = local_chunk_tokens(load, rates, target)
    queued = load.num_local_queued_tokens + load.num_uncached_tokens
    steps = math.ceil(queued / chunk)
    local = rates.local_margin_s + (steps * rates.decode_step_s + queued * rates.prefill_token_s if load.num_running
                                    else queued * rates.prefill_token_s)
    damage = load.num_uncached_tokens * rates.prefill_token_s * max(1, load.num_running)
    if remote <= target.ttft_s:
        where, reason = "remote", "remote meets the TTFT target"
    elif local <= target.ttft_s:
        where, reason = "local", "only local meets the TTFT target"
    elif local < remote:
        where, reason = "local", "neither meets the TTFT target; local is sooner"
    else:
        where, reason = "remote", "neither meets the TTFT target; remote is sooner"
    # The target's slack is spent waiting for steps with nothing to decode, less one chunk's step
    # as margin for the prediction's error; with nothing decoding there is nothing to yield to.
    slack = target.ttft_s - local - (rates.decode_step_s + chunk * rates.prefill_token_s)
    pause = max(0.0, slack) if load.num_running else 0.0
    expected = remote - rates.remote_margin_s if where == "remote" else local - rates.local_margin_s + pause
    return Placement(where, reason, remote, local, damage, chunk if load.num_running else 0, pause, expected)


def local_chunk_tokens(load: Load, rates: Rates, target: Target) -> int:
    """The most prompt tokens a step beside the decodes may take so it stays inside the ITL
    target (at least one block's worth of progress, 16 tokens, when even a pure decode step
    misses it: the prompt must advance)."""
    room = target.itl_s - rates.decode_step_s
    fits = int(room / rates.prefill_token_s + 1e-9) if room > 0 else 0  # (+1e-9: 0.02 / 0.001 is 19.999...)
    return max(16, min(load.max_chunk_tokens, fits))


class CostModel:
    """The rates `place` needs, learned online by one decode replica.

    Priors: a CPU-class step (20 ms to decode, 1 ms a prompt token), prefill replicas as fast as
    this replica and no wait beyond their compute, a 1 GB/s link, no margin; real hardware replaces
    each within a few samples. Samples that carry no information are skipped: a zero-length step,
    or prompt tokens beside decodes in a step no longer than a decode step alone (so no rate ever
    falls to 0). The margins are the `percentile`-th percentile of each path's recent errors (a
    first token's time from placement less its prediction); `clock` dates them (seconds)."""

    def __init__(self, decode_step_s: float = 0.02, prefill_token_s: float = 1e-3,
                 link_bytes_per_s: float = 1e9, percentile: float = 99.0,
                 clock: Callable[[], float] = time.monotonic):
        self.decode_step = Average(decode_step_s)
        self.prefill_token = Average(prefill_token_s)
        self.remote_rate = Average(0.0)  # until a prefill replica reports its rate: this replica's own
        self.remote_wait = Average(0.0)
        self.link = Average(link_bytes_per_s)
        self.percentile, self.clock = percentile, clock
        self.errors = {where: Tail(ERROR_SAMPLES, ERROR_HORIZON_S) for where in ("remote", "local")}

    def step(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """One engine step: `num_decodes` sequences decoded, `num_prefill_tokens` prompt tokens
        computed, in `seconds`."""
        if seconds <= 0:
            return
        if num_prefill_tokens == 0:
            if num_decodes:
                self.decode_step.add(seconds)
            return
        extra = seconds - (self.decode_step.value if num_decodes else 0.0)
        if extra > 0:  # (not beyond a decode step's noise: it says nothing of the tokens' cost, never 0)
            self.prefill_token.add(extra / num_prefill_tokens)

    def remote_prefill(self, num_tokens: int, seconds: float, replica_tokens_per_s: float | None) -> None:
        """A remote prefill call returned `seconds` after it was made, predicted to compute
        `num_tokens` prompt tokens (those it waited behind and its own uncached ones); the prefill
        replica reported computing `replica_tokens_per_s` prompt tokens a second (None: not yet
        measured there)."""
        if replica_tokens_per_s:
            self.remote_rate.add(replica_tokens_per_s)
        if seconds > 0 and num_tokens > 0:
            self.remote_wait.add(max(0.0, seconds - num_tokens / self.rates().remote_tokens_per_s))

    def pull(self, num_bytes: int, seconds: float) -> None:
        if seconds > 0 and num_bytes > 0:
            self.link.add(num_bytes / seconds)

    def first_token(self, where: str, predicted_s: float, seconds: float) -> None:
        """A request placed `where` ("remote" or "local") with a mean prediction of `predicted_s`
        (`Placement.expected_ttft_s`) had its first token `seconds` after it was placed."""
        self.errors[where].add(self.clock(), seconds - predicted_s)

    def _margin(self, where: str) -> float:
        errors = self.errors[where]
        errors.expire(self.clock())
        return errors.percentile(self.percentile) if len(errors) >= MIN_ERROR_SAMPLES else 0.0

    def rates(self) -> Rates:
        remote = self.remote_rate.value if self.remote_rate.num_samples else 1.0 / self.prefill_token.value
        return Rates(self.decode_step.value, self.prefill_token.value, remote, self.remote_wait.value, self.link.value,
                     self._margin("remote"), self._margin("local"))
