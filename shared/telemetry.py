"""OpenTelemetry setup and trace-context propagation through message headers."""

from __future__ import annotations

import logging

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger("switchboard.telemetry")


def setup_tracing(service: str, otlp_endpoint: str = "") -> TracerProvider:
    """Install an SDK tracer provider; spans are exported only when an OTLP endpoint is set."""
    provider = TracerProvider(resource=Resource.create({"service.name": f"switchboard-{service}"}))
    if otlp_endpoint:
        _add_otlp_exporter(provider, otlp_endpoint)
    trace.set_tracer_provider(provider)
    return provider


def _add_otlp_exporter(provider: TracerProvider, endpoint: str) -> None:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("otlpEndpoint is set but opentelemetry-exporter-otlp-proto-http is not installed; no spans exported")
        return
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject(span: trace.Span | None = None) -> dict[str, str]:
    """``span``'s (default: the current span's) context as W3C headers (``traceparent``…)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span) if span is not None else None)
    return carrier


def start_span(name: str, headers: dict[str, str] | None, **attributes) -> trace.Span:
    """A span continuing the trace carried in a message's headers (a new trace when there is none); with no
    headers at all (None), a child of the current span (the gateway's HTTP server span)."""
    parent = extract(headers) if headers is not None else None
    return trace.get_tracer("switchboard").start_span(name, context=parent, attributes=attributes)


def start_server_span(name: str, headers: dict[str, str], **attributes) -> trace.Span:
    """An HTTP server's span, continuing the client's trace from its request headers (``traceparent``)."""
    return trace.get_tracer("switchboard").start_span(name, context=extract(headers), kind=trace.SpanKind.SERVER,
                                                      attributes=attributes)


def end_span(span: trace.Span | None, error: str | None = None, **attributes) -> None:
    if span is None:
        return
    span.set_attributes(attributes)
    if error:
        span.set_status(trace.Status(trace.StatusCode.ERROR, error))
    span.end()


def extract(headers: dict[str, str] | None) -> context.Context:
    return propagate.extract(headers or {})
