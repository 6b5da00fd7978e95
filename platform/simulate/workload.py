"""What arrives at the simulated deployment: a stream of `SimRequest`s in arrival order.

Two sources:
- `pdserve bench`'s own workload generators (random, shared-prefix, long-prompt mix) with its
  arrival process (`pdserve.bench.arrivals`), given a builder that counts tokens instead of
  writing prompts (`CountingBuilder`: it draws from the generator's random stream exactly as the
  bench's builder does, so one seed gives the bench's lengths and tenants). Long runs are drawn in
  chunks (chunk i seeded from (seed, i)); one chunk reproduces a bench run of that seed exactly.
  The rate may change over time (`rate_steps`: a piecewise-constant Poisson process).
- a JSONL trace: one request a line, `{"arrival_s" (or "offset_s"), "prompt_tokens",
  "output_tokens", optionally "prefix_id" and "prefix_tokens"}`; requests with the same prefix id
  share their first prefix_tokens tokens.

A request's prefix (tenant) is all the simulator needs of its tokens: blocks past it are the
request's own and can never be a cache hit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from pdserve.bench import workloads as bench
from pdserve.bench.arrivals import arrival_offsets

KINDS = ("random", "shared-prefix", "long-prompt-mix")
CHUNK = 20_000  # most requests drawn at once in a long run (the first chunks are smaller)


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_id: int | None = None  # requests with the same id share their first prefix_tokens tokens
    prefix_tokens: int = 0


class _Span:
    """A run of `n` tokens: only its length is kept (prompts are sums of spans)."""
    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __add__(self, other: "_Span") -> "_Span":
        return _Span(self.n + len(other))


class CountingBuilder:
    """`PromptBuilder`'s interface for the bench generators, keeping token counts only. It draws
    the same random numbers as a builder with a vocabulary of `pool_size` whole-word tokens."""

    is_exact = True

    def __init__(self, pool_size: int = 24):  # the bench's word fallback has 24 words
        self.pool_size = pool_size

    def tokens(self, n: int, rng: np.random.Generator) -> _Span:
        rng.integers(0, self.pool_size, size=n)  # Generator.choice's own draw
        return _Span(n)

    def request(self, token_ids: _Span, max_tokens: int, **kw) -> bench.BenchRequest:
        return bench.BenchRequest("", None, len(token_ids), max_tokens, **kw)


@dataclass(frozen=True)
class WorkloadSpec:
    """A bench workload's parameters (the `pdserve bench` flags of the same names)."""
    kind: str = "random"
    input_len: str = "128"
    output_len: str = "128"
    num_tenants: int = 8
    system_prompt_len: int = 1000
    question_len: str = "32:96"
    popularity: str = "zipf"
    long_len: str = "2048"
    long_fraction: float = 0.05
    long_output_len: str = "16"

    def draw(self, n: int, seed: int, builder: CountingBuilder) -> list[bench.BenchRequest]:
        if self.kind == "random":
            return bench.random_workload(builder, n, self.input_len, self.output_len, seed)
        if self.kind == "shared-prefix":
            return bench.shared_prefix_workload(builder, n, self.num_tenants, self.system_prompt_len,
                                                self.question_len, self.output_len, self.popularity, seed=seed)
        if self.kind == "long-prompt-mix":
            return bench.long_prompt_mix_workload(builder, n, self.input_len, self.long_len, self.output_len,
                                                  self.long_fraction, self.long_output_len, seed=seed)
        raise ValueError(f"workload {self.kind!r}: choose from {', '.join(KINDS)}")

    def prefix_tokens(self, r: bench.BenchRequest) -> int:
        return self.system_prompt_len if r.tenant is not None else 0


def parse_rate_steps(text: str) -> list[tuple[float, float]]:
    """'0:1000,120:4000,240:1000' -> [(0, 1000), (120, 4000), (240, 1000)]: from each time (s) on,
    that many requests/s."""
    steps = []
    for part in text.split(","):
        at, _, rate = part.partition(":")
        try:
            steps.append((float(at), float(rate)))
        except ValueError:
            raise ValueError(f"bad rate step {part!r}: use SECONDS:RATE, e.g. 0:1000,120:4000") from None
    if not steps or steps[0][0] != 0 or any(b[0] <= a[0] for a, b in zip(steps, steps[1:])) \
            or any(r <= 0 for _, r in steps):
        raise ValueError(f"rate steps {text!r}: times must start at 0 and rise, rates be positive")
    return steps


def alternating_steps(low: float, high: float, period_s: float, duration_s: float) -> list[tuple[float, float]]:
    """Rate steps for a bursty load: `low` requests/s, then `high`, in turn, each for `period_s`."""
    if min(low, high) <= 0 or period_s <= 0 or duration_s <= 0:
        raise ValueError("rates, period and duration must be positive")
    return [(i * period_s, high if i % 2 else low) for i in range(math.ceil(duration_s / period_s))]


def mean_rate(steps: list[tuple[float, float]], duration_s: float) -> float:
    """The average requests/s of `steps` over [0, duration_s)."""
    bounds = [s[0] for s in steps[1:]] + [duration_s]
    return sum(max(0.0, min(end, duration_s) - start) * rate for (start, rate), end in zip(steps, bounds)) / duration_s


def arrival_times(steps: list[tuple[float, float]], duration_s: float, seed: int) -> list[float]:
    """The arrival times `bench_requests` gives a stream of `steps` with this seed (a real run
    sends its requests at the times the simulation replays)."""
    rng = np.random.default_rng([seed, 1])
    return [t for times in _poisson_times(steps, duration_s, rng) for t in times.tolist()]


def _poisson_times(steps: list[tuple[float, float]], duration_s: float,
                   rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Arrival times of a piecewise-constant Poisson process over [0, duration_s), in blocks."""
    bounds = [s[0] for s in steps[1:]] + [duration_s]
    for (start, rate), end in zip(steps, bounds):
        t = start
        end = min(end, duration_s)
        while t < end:
            gaps = rng.exponential(1.0 / rate, size=max(16, min(CHUNK, int((end - t) * rate * 1.1) + 16)))
            times = t + np.cumsum(gaps)
            inside = times[times < end]
            if len(inside):
                yield inside
            t = float(times[-1]) if len(inside) == len(times) else end


def tokenizer_pool_size(tokenizer_dir: str) -> int:
    """How many whole-word tokens the bench's builder draws prompts from with this tokenizer (what
    `CountingBuilder` needs to draw a tokenizer-built bench workload's lengths exactly)."""
    return len(bench.PromptBuilder(tokenizer_dir).word_ids)


def bench_requests(spec: WorkloadSpec, seed: int, *, num_requests: int | None = None, rate: float | None = None,
                   duration_s: float | None = None, rate_steps: list[tuple[float, float]] | None = None,
                   arrival: str = "poisson", pool_size: int = 24,
                   arrival_seed: int | None = None) -> Iterator[SimRequest]:
    """The bench workload's requests with arrival times: `num_requests` at `rate` (the bench's
    own arrival offsets, seed `arrival_seed`, default `seed`, as `pdserve bench --seed`), or a
    Poisson stream at `rate` (or `rate_steps`) for `duration_s` seconds."""
    builder = CountingBuilder(pool_size)
    if num_requests is not None:
        reqs = spec.draw(num_requests, seed, builder)
        offsets = arrival_offsets(num_requests, rate or float("inf"), arrival,
                                  seed if arrival_seed is None else arrival_seed)
        for r, t in zip(reqs, offsets):
            yield SimRequest(t, r.prompt_tokens, r.max_tokens, r.tenant, spec.prefix_tokens(r))
        return
    if duration_s is None or (rate is None and rate_steps is None):
        raise ValueError("give num_requests, or duration_s with a rate or rate steps")
    rng = np.random.default_rng([seed, 1])
    chunk_index = 0
    pending: list[bench.BenchRequest] = []
    for times in _poisson_times(rate_steps or [(0.0, rate)], duration_s, rng):
        for t in times.tolist():
            if not pending:
                size = min(CHUNK, 256 << chunk_index)
                pending = spec.draw(size, int(np.random.SeedSequence([seed, chunk_index]).generate_state(1)[0]),
                                    builder)[::-1]
                chunk_index += 1
            r = pending.pop()
            yield SimRequest(t, r.prompt_tokens, r.max_tokens, r.tenant, spec.prefix_tokens(r))


def trace_requests(path: str) -> Iterator[SimRequest]:
    """A JSONL trace's requests (sorted by arrival when the file is not)."""
    rows, prefix_ids = [], {}
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            at = float(row["arrival_s"] if "arrival_s" in row else row["offset_s"])
            prefix = row.get("prefix_id")
            prefix_tokens = int(row.get("prefix_tokens", 0))
            if prefix is not None and prefix_tokens <= 0:
                raise ValueError("prefix_id needs prefix_tokens > 0")
            prompt, output = int(row["prompt_tokens"]), int(row["output_tokens"])
            if prompt < 1 or output < 1 or at < 0 or prefix_tokens > prompt:
                raise ValueError("need prompt_tokens, output_tokens >= 1, arrival >= 0, prefix_tokens <= prompt")
            prefix_id = None if prefix is None else prefix_ids.setdefault(prefix, len(prefix_ids))
            rows.append(SimRequest(at, prompt, output, prefix_id, prefix_tokens))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: bad trace line ({e}); need arrival_s, prompt_tokens, "
                             "output_tokens") from e
    rows.sort(key=lambda r: r.arrival_s)
    return iter(rows)
