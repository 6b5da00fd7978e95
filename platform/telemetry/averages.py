"""Moving averages of what a replica measures (rates, step times), for decisions made on them."""

from __future__ import annotations

import math
import threading
from bisect import bisect_left, insort
from collections import deque

# Weight of a new sample: the last ~10 samples dominate, so a rate follows a change of load within
# seconds of steps but one odd step moves it by a tenth.
EMA_WEIGHT = 0.1


class Average:
    """An exponential moving average that starts at a prior."""

    def __init__(self, prior: float):
        self.value, self.num_samples = prior, 0

    def add(self, sample: float) -> None:
        # The first samples replace the prior quickly (weight 1/n until it falls to EMA_WEIGHT).
        self.num_samples += 1
        weight = max(EMA_WEIGHT, 1.0 / self.num_samples)
        self.value += weight * (sample - self.value)


class Window:
    """What happened over the last `window_s` seconds: samples (time, value, weight), oldest dropped
    as new ones come. Its figures: the share of weight whose value held (`share`), the values' mean
    (`mean`), and the rate a cumulative counter grew at (`rate`, its samples being the counter's
    readings). Thread-safe: an
    engine's thread adds while its replica's event loop reads."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.samples: deque[tuple[float, float, float]] = deque()
        self._lock = threading.Lock()

    def add(self, now: float, value: float, weight: float = 1.0) -> None:
        with self._lock:
            self.samples.append((now, value, weight))
            self._drop(now)

    def _drop(self, now: float) -> None:
        while self.samples and self.samples[0][0] < now - self.window_s:
            self.samples.popleft()

    def share(self, now: float) -> float | None:
        """Weighted share of samples whose value is true (None: none in the window)."""
        with self._lock:
            self._drop(now)
            samples = list(self.samples)
        total = sum(w for _, _, w in samples)
        return sum(w for _, v, w in samples if v) / total if total else None

    def mean(self, now: float) -> float | None:
        """Weighted mean of the samples' values (None: none in the window)."""
        with self._lock:
            self._drop(now)
            samples = list(self.samples)
        total = sum(w for _, _, w in samples)
        return sum(v * w for _, v, w in samples) / total if total else None

    def rate(self, now: float) -> float | None:
        """Growth per second of the counter whose readings the samples are (None: under two)."""
        with self._lock:
            self._drop(now)
            if len(self.samples) < 2 or self.samples[-1][0] <= self.samples[0][0]:
                return None
            (t0, v0, _), (t1, v1, _) = self.samples[0], self.samples[-1]
        return (v1 - v0) / (t1 - t0)


class Tail:
    """The last `size` samples of a quantity within `horizon_s` seconds, kept in order for their
    percentiles: where a decision must hold for a share of cases (a latency target's percentile),
    an average hides the tail. Samples age out, so a tail measured under a past load does not
    outlive it."""

    def __init__(self, size: int, horizon_s: float):
        self.size, self.horizon_s = size, horizon_s
        self.recent: deque[tuple[float, float]] = deque()  # (time, sample), oldest first
        self.ordered: list[float] = []

    def __len__(self) -> int:
        return len(self.recent)

    def add(self, now: float, sample: float) -> None:
        if len(self.recent) == self.size:
            self._remove_oldest()
        self.recent.append((now, sample))
        insort(self.ordered, sample)

    def expire(self, now: float) -> None:
        """Forget the samples older than the horizon."""
        while self.recent and self.recent[0][0] < now - self.horizon_s:
            self._remove_oldest()

    def _remove_oldest(self) -> None:
        del self.ordered[bisect_left(self.ordered, self.recent.popleft()[1])]

    def percentile(self, percent: float) -> float:
        """The smallest sample at least `percent` percent of the samples do not exceed (the
        nearest-rank percentile; there must be samples)."""
        n = len(self.ordered)
        return self.ordered[min(n - 1, max(0, math.ceil(percent / 100 * n) - 1))]
