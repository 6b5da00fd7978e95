"""When each request is sent: Poisson or constant-rate offsets from the run's start (seeded).

A fixed concurrency needs no offsets: the runner keeps that many requests in flight instead.
"""

from __future__ import annotations

import numpy as np


def arrival_offsets(num_requests: int, rate: float, kind: str = "poisson", seed: int = 0) -> list[float]:
    """Send offsets in seconds. `rate` requests/s; `inf` sends everything at once."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if rate == float("inf"):
        return [0.0] * num_requests
    if kind == "poisson":
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests)
    elif kind == "constant":
        gaps = np.full(num_requests, 1.0 / rate)
    else:
        raise ValueError(f"unknown arrival kind {kind!r} (poisson or constant)")
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps).tolist()
