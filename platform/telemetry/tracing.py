"""OpenTelemetry traces: one trace per request, across the gateway, the routers and both pools.

Every process that handles requests calls `setup_tracing` once with the config's `telemetry`
section. The gateway starts a request's span from the client's `traceparent` header (if any); the
trace context then travels inside `GenerateRequest.trace_context` (W3C headers as a dict), so the
routing, prefill, KV-transfer and decode spans in other processes join the same trace.

Spans here are never made "current": they live across `await`s and async-generator `yield`s,
where attaching a context in one task and detaching it in another breaks OpenTelemetry's
context. Each span names its parent explicitly (a carrier dict). With traces off, OpenTelemetry's
default provider makes every span a no-op. Imports no Ray.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

if TYPE_CHECKING:
    from pdserve.config import TelemetryConfig

log = logging.getLogger(__name__)

_provider = None  # this process's TracerProvider, once set up


def setup_tracing(config: "TelemetryConfig", component: str) -> None:
    """Install this process's tracer provider (first call wins; traces 'none' installs nothing)."""
    global _provider
    if config.traces == "none" or _provider is not None:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if config.traces == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint)
    else:
        exporter = ConsoleSpanExporter()
    resource = Resource.create({"service.name": config.service_name, "pdserve.component": component})
    _provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
    _provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=config.export_delay_ms))
    trace.set_tracer_provider(_provider)
    log.info("tracing %s spans to %s", component, config.otlp_endpoint or config.traces)


def flush_traces(timeout_s: float = 5.0) -> None:
    """Export what is buffered now (a replica about to stop)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def _tracer() -> trace.Tracer:
    return trace.get_tracer("pdserve")


def start_span(name: str, parent: Mapping[str, str] | None = None, kind: SpanKind = SpanKind.INTERNAL,
               **attributes: Any) -> Span:
    """A span under the trace context in `parent` (W3C headers; none or empty: a new trace).
    The caller ends it (`end_span`)."""
    context = propagate.extract(parent) if parent else None
    return _tracer().start_span(name, context=context, kind=kind,
                                attributes={k: v for k, v in attributes.items() if v is not None})


def end_span(span: Span, error: BaseException | None = None) -> None:
    if error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()


@contextmanager
def span(name: str, parent: Mapping[str, str] | None = None, **attributes: Any) -> Iterator[Span]:
    """`start_span` ... `end_span`, recording an exception that leaves the block (cancellation too)."""
    s = start_span(name, parent, **attributes)
    try:
        yield s
    except BaseException as e:
        end_span(s, e)
        raise
    end_span(s)


def carrier(span: Span) -> dict[str, str]:
    """The W3C headers (traceparent, tracestate) that make spans elsewhere children of `span`;
    empty when tracing is off."""
    headers: dict[str, str] = {}
    propagate.inject(headers, context=trace.set_span_in_context(span))
    return headers
