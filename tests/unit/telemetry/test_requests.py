"""A request as the gateway records it: timings per sequence, one outcome, a span that carries the
client's trace; and how errors are counted."""

import asyncio

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.errors import InvalidRequestError, OverloadedError
from pdserve.gateway.errors import APIError, UnavailableError, outcome_of
from pdserve.telemetry.requests import RequestRecord
from pdserve.telemetry.tracing import span


class Recorded:
    """A metrics sink that keeps what it is told (GatewayMetrics' methods)."""

    def __init__(self):
        self.ttft, self.itl, self.e2e, self.requests = [], [], [], []

    def first_token(self, s):
        self.ttft.append(s)

    def inter_token(self, s):
        self.itl.append(s)

    def finished(self, s):
        self.e2e.append(s)

    def request(self, outcome, prompt_tokens, generation_tokens):
        self.requests.append((outcome, prompt_tokens, generation_tokens))


@pytest.fixture(scope="module")
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


def test_timings_per_sequence_and_one_outcome(spans):
    m = Recorded()
    rec = RequestRecord("/v1/completions", "r1", {}, m)
    rec.output(0, 1)  # sequence 0's first token
    rec.output(1, 2)  # sequence 1's first output: first token plus one more at once
    rec.output(0, 1)
    rec.output(0, 0)  # the finishing output may carry no token
    assert len(m.ttft) == 2 and len(m.itl) == 2
    rec.finish("ok", None, 10, 4)
    rec.finish("error", RuntimeError("late"))  # counted once
    assert m.requests == [("ok", 10, 4)] and len(m.e2e) == 1


def test_the_clients_trace_is_continued_and_handed_on(spans):
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    rec = RequestRecord("/v1/chat/completions", "r2", {"traceparent": f"00-{trace_id}-{parent}-01"})
    assert rec.trace_context["traceparent"].startswith(f"00-{trace_id}-")
    with span("pdserve.decode", rec.trace_context, request_id="r2-0"):
        pass
    rec.finish("invalid", InvalidRequestError("bad"))
    by_name = {s.name: s for s in spans.get_finished_spans()}
    gateway, decode = by_name["pdserve.gateway"], by_name["pdserve.decode"]
    assert f"{gateway.context.trace_id:032x}" == trace_id and f"{gateway.parent.span_id:016x}" == parent
    assert decode.parent.span_id == gateway.context.span_id
    assert gateway.attributes["outcome"] == "invalid" and not gateway.status.is_ok


@pytest.mark.parametrize("error, outcome", [
    (InvalidRequestError("x"), "invalid"), (APIError(404, "no model", "NotFoundError"), "invalid"),
    (APIError(413, "big", "invalid_request_error"), "invalid"), (APIError(401, "key", "auth"), "rejected"),
    (OverloadedError("full"), "overloaded"), (UnavailableError("gone"), "overloaded"),
    (asyncio.CancelledError(), "aborted"), (RuntimeError("bug"), "error")])
def test_errors_are_counted_by_kind(error, outcome):
    assert outcome_of(error) == outcome
