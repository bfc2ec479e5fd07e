"""W3C trace context on bus messages: ``traceparent``, ``tracestate`` and ``baggage``.

The bus always speaks W3C, whatever ``OTEL_PROPAGATORS`` says: it is our wire, not the
caller's. The HTTP edge, where a caller's own format arrives, uses the configured
propagators (``opentelemetry.propagate``).

Every traced bus message carries its context, and every service reads it from each one
it handles, several times per request. The common message carries only a
``traceparent`` in the form our own services write, so that form is parsed and written
here directly, without the global composite propagator's getter and setter objects (a
fifth less time than ``opentelemetry.propagate``); anything else (a ``tracestate``,
``baggage``, another version, stray whitespace) goes through the W3C propagators
themselves, so the result is always theirs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping

from opentelemetry import baggage, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_TRACECONTEXT = TraceContextTextMapPropagator()
_BAGGAGE = W3CBaggagePropagator()
_VERSION_00 = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_INVALID_TRACE, _INVALID_SPAN = "0" * 32, "0" * 16


def extract(headers: Mapping[str, str] | None) -> Context:
    """The context ``headers`` carry, in a new ``Context`` (empty when they carry none):
    what ``TraceContextTextMapPropagator`` and ``W3CBaggagePropagator`` would extract."""
    if not headers:
        return Context()
    parent = headers.get("traceparent")
    if parent is None or "tracestate" in headers or "baggage" in headers:
        return _full_extract(headers)
    match = _VERSION_00.fullmatch(parent)
    if match is None:
        return _full_extract(headers)  # another version, whitespace, or not valid at all
    trace_id, span_id, flags = match.groups()
    if trace_id == _INVALID_TRACE or span_id == _INVALID_SPAN:
        return Context()
    remote = SpanContext(
        int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16))
    )
    return trace.set_span_in_context(NonRecordingSpan(remote), Context())


def sampled_context(headers: Mapping[str, str] | None) -> SpanContext | None:
    """The span context ``headers`` carry if it is sampled (a trace store holds it), else
    None: what an exemplar or a span link may point at."""
    context = trace.get_current_span(extract(headers)).get_span_context()
    return context if context.trace_flags.sampled else None


def _full_extract(headers: Mapping[str, str]) -> Context:
    return _BAGGAGE.extract(headers, context=_TRACECONTEXT.extract(headers))


def inject(headers: MutableMapping[str, str], context: Context | None = None) -> None:
    """Write the trace context of ``context`` (default: the current one) into
    ``headers``, as ``TraceContextTextMapPropagator`` and ``W3CBaggagePropagator`` would."""
    span_context = trace.get_current_span(context).get_span_context()
    if span_context.is_valid:
        headers["traceparent"] = (
            f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-"
            f"{span_context.trace_flags:02x}"
        )
        if span_context.trace_state:
            headers["tracestate"] = span_context.trace_state.to_header()
    if baggage.get_all(context):
        _BAGGAGE.inject(headers, context)
