"""Latency distributions at batch level: weighted log histograms (1% wide bins).

A decode step that gives `n` streams a token adds one value with weight `n`, so a run of millions
of requests and billions of tokens costs one `add` per step, and percentiles come back within 1%
(half a bin). Pure, no numpy on the hot path.
"""

from __future__ import annotations

import math

MIN_S = 1e-6
RATIO = 1.01
_LOG_RATIO = math.log(RATIO)
NUM_BINS = int(math.log(1e5 / MIN_S) / _LOG_RATIO) + 2  # 1 us .. 1e5 s


class LogHistogram:
    __slots__ = ("counts", "total", "sum")

    def __init__(self):
        self.counts = [0.0] * NUM_BINS
        self.total = 0.0
        self.sum = 0.0

    def add(self, seconds: float, weight: float = 1.0) -> None:
        i = int(math.log(seconds / MIN_S) / _LOG_RATIO) + 1 if seconds > MIN_S else 0
        self.counts[i if i < NUM_BINS else NUM_BINS - 1] += weight
        self.total += weight
        self.sum += seconds * weight

    def percentile(self, p: float) -> float | None:
        """The value below which `p` percent of the weight lies (a bin's geometric middle)."""
        if self.total <= 0:
            return None
        goal, seen = self.total * p / 100.0, 0.0
        for i, c in enumerate(self.counts):
            seen += c
            if c and seen >= goal:
                return 0.0 if i == 0 else MIN_S * RATIO ** (i - 0.5)
        return MIN_S * RATIO ** (NUM_BINS - 1.5)

    @property
    def mean(self) -> float | None:
        return self.sum / self.total if self.total > 0 else None

    def share_within(self, seconds: float) -> float | None:
        """The share of weight at or below `seconds` (to the bin)."""
        if self.total <= 0:
            return None
        i = int(math.log(seconds / MIN_S) / _LOG_RATIO) + 1 if seconds > MIN_S else 0
        return sum(self.counts[:i + 1]) / self.total

    def merge(self, other: "LogHistogram") -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.total += other.total
        self.sum += other.sum


class Window:
    """What one autoscaling window saw: first tokens and inter-token gaps against the targets,
    the prefill pool's work, and the requests that reached and left the decode pool."""
    __slots__ = ("num_first", "num_first_within", "gap_weight", "gap_weight_within", "prompt_tokens", "num_prompts",
                 "prefill_tokens", "prefill_busy_s", "num_routed", "num_finished", "held_s")

    def __init__(self):
        self.num_first = self.num_first_within = 0
        self.gap_weight = self.gap_weight_within = 0.0
        self.prompt_tokens = self.num_prompts = 0  # uncached prompt tokens, and prompts, sent to the prefill pool
        self.prefill_tokens = 0  # prompt tokens the prefill pool computed
        self.prefill_busy_s = 0.0  # seconds its replicas spent computing them
        self.num_routed = self.num_finished = 0  # requests routed to a decode replica, and ended there
        self.held_s = 0.0  # the seconds the ended ones were held there, together
