"""One API request as the gateway sees it: its span, its sequences' token timings and its outcome.

`RequestRecord` opens the request's `pdserve.gateway` span under the client's `traceparent` (if
sent), hands its trace context to the `GenerateRequest`s, takes every output as it arrives
(time to each sequence's first token, gaps between tokens) and, once, the outcome. The metrics
sink is optional (`GatewayMetrics` in a deployment, None in tests of the service alone); no Ray here.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Mapping

from opentelemetry.trace import SpanKind

from pdserve.telemetry.tracing import carrier, end_span, start_span

if TYPE_CHECKING:
    from pdserve.telemetry.metrics import GatewayMetrics

TRACE_HEADERS = ("traceparent", "tracestate")


class RequestRecord:
    def __init__(self, route: str, request_id: str, headers: Mapping[str, str],
                 metrics: "GatewayMetrics | None" = None):
        self.metrics = metrics
        self.started = time.perf_counter()
        self.start_unix_s = time.time()  # when it arrived: its deadline counts from here
        parent = {h: headers[h] for h in TRACE_HEADERS if h in headers}
        self.span = start_span("pdserve.gateway", parent, SpanKind.SERVER, route=route, request_id=request_id)
        self.trace_context = carrier(self.span)
        self._last: dict[int, float] = {}  # sequence index -> when its last output came
        self.outcome: str | None = None

    def output(self, index: int, num_tokens: int) -> None:
        if self.metrics is None or not num_tokens:
            return
        now = time.perf_counter()
        last = self._last.get(index)
        if last is None:
            self.metrics.first_token(now - self.started)
            num_tokens -= 1
        for _ in range(num_tokens):  # tokens that came together share the gap
            self.metrics.inter_token((now - (last or now)) / max(num_tokens, 1))
        self._last[index] = now

    def finish(self, outcome: str, error: BaseException | None = None, prompt_tokens: int = 0,
               generation_tokens: int = 0) -> None:
        """Count the request once (a second call is ignored) and end its span."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        self.span.set_attribute("outcome", outcome)
        if self.metrics is not None:
            self.metrics.request(outcome, prompt_tokens, generation_tokens)
            if outcome == "ok":
                self.metrics.finished(time.perf_counter() - self.started)
        end_span(self.span, error)
