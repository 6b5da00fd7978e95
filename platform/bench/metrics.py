"""Serving metrics from recorded request timings, with vLLM's definitions and field names.

In: one `RequestRecord` per request (send time, arrival time of every streamed chunk and how many
tokens it carried, end time, token counts, error kind) and the run's duration. Out: a flat dict
whose names match vLLM's serving benchmark where the meaning is the same (`mean_ttft_ms`,
`p99_itl_ms`, `output_throughput`, `request_goodput`, ...). Pure functions: the tests feed
scripted timestamps and compare exact values. It does not know how requests were sent.

Definitions (as vLLM): TTFT = first chunk - send; ITL = gaps between consecutive chunks after
the first; TPOT per request = (E2E - TTFT) / (output tokens - 1), only for requests with more than
one output token; E2E = end - send. Percentiles interpolate linearly (numpy's default). Goodput
counts completed requests meeting every SLO given (TTFT, TPOT, E2E, in ms).

Across a sweep of rates, `max_goodput_rate` gives DistServe's goodput: the highest request rate at
which a given share of requests still meets the SLO. At one rate under capacity, vLLM's
`request_goodput` is the offered rate less the run's last requests' latency; this one is what a
pool sustains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    send_s: float
    prompt_tokens: int
    chunk_times_s: list[float] = field(default_factory=list)
    end_s: float | None = None
    output_tokens: int = 0
    output_tokens_source: str = "chunks"  # "usage" | "tokenizer" | "chunks"
    error: str | None = None  # error kind, None when the request completed
    error_detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times_s) and self.end_s is not None

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.send_s

    @property
    def e2el_s(self) -> float:
        return self.end_s - self.send_s

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=500ms,tpot=50ms' -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds; 's' suffix allowed)."""
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        key, _, value = part.strip().partition("=")
        key = key.strip().lower()
        if key not in SLO_KEYS or not value:
            raise ValueError(f"bad SLO {part!r}: use ttft=, tpot= or e2el= with a time, e.g. ttft=500ms")
        value = value.strip().lower()
        if value.endswith("ms"):
            ms = float(value[:-2])
        elif value.endswith("s"):
            ms = float(value[:-1]) * 1000
        else:
            ms = float(value)
        if ms <= 0:
            raise ValueError(f"bad SLO {part!r}: the time must be positive")
        slo[key] = ms
    return slo


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000 if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def compute_metrics(records: list[RequestRecord], duration_s: float, slo: dict[str, float] | None = None,
                    percentiles: tuple[float, ...] = (50, 90, 99)) -> dict:
    done = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            kind = r.error or "empty_response"
            errors[kind] = errors.get(kind, 0) + 1
    total_input = sum(r.prompt_tokens for r in done)
    total_output = sum(r.output_tokens for r in done)
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    good = 0
    for r in done:
        measured = {"ttft": r.ttft_s * 1000, "tpot": (r.tpot_s or 0.0) * 1000, "e2el": r.e2el_s * 1000}
        good += all(measured[k] <= v for k, v in (slo or {}).items())
    sources = sorted({r.output_tokens_source for r in done})
    result = {
        "duration": duration_s,
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": errors,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "output_tokens_counted_by": ",".join(sources),
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": total_output / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration_s if duration_s > 0 else 0.0,
        "request_goodput": good / duration_s if slo and duration_s > 0 else None,
        # The share of requests sent that completed within the SLO. Goodput divides the same count
        # by the run's length, which a bounded run's last, slowest requests stretch.
        "slo_attainment": good / len(records) if slo and records else None,
        "slo_ms": slo or {},
    }
    result.update(_stats("ttft", [r.ttft_s for r in done], percentiles))
    result.update(_stats("tpot", tpots, percentiles))
    result.update(_stats("itl", [x for r in done for x in r.itls_s], percentiles))
    result.update(_stats("e2el", [r.e2el_s for r in done], percentiles))
    return result


@dataclass(frozen=True)
class MaxGoodput:
    rate: float  # requests/s
    exact: bool  # False: every rate measured met the target, so `rate`, the highest, is a lower bound


def check_attainment(attainment: float) -> None:
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment {attainment}: a share of requests, in (0, 1]")


def max_goodput_rate(points: Iterable[tuple[float, float]], attainment: float = 0.9) -> MaxGoodput | None:
    """DistServe's goodput from a sweep's (offered rate, share within SLO) points: the highest rate
    at which at least `attainment` of the requests met the SLO.

    The rate where the attainment curve first drops below the target, interpolated linearly between
    the last rate that met it and the first that did not; later rates are not looked at, so one
    lucky draw past the knee does not raise it. None when even the lowest rate missed the target.
    """
    check_attainment(attainment)
    pts = sorted(points)
    if not pts or pts[0][1] < attainment:
        return None
    for (r0, a0), (r1, a1) in zip(pts, pts[1:]):
        if a1 < attainment:
            return MaxGoodput(r0 + (r1 - r0) * (a0 - attainment) / (a0 - a1), exact=True)
    return MaxGoodput(pts[-1][0], exact=False)
