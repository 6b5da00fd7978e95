"""Moving averages of what a replica measures (rates, step times), for decisions made on them."""

from __future__ import annotations

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
