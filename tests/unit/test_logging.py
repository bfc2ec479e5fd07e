"""Log lines carry the trace id of the span they were written in, as text or JSON."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider

from lamina.libs.telemetry_setup import JsonFormatter, TraceFormatter, setup_logging

tracer = TracerProvider().get_tracer("test")


def record(message: str) -> logging.LogRecord:
    return logging.LogRecord("lamina.test", logging.WARNING, __file__, 1, message, (), None)


def test_text_lines_carry_the_trace_id_inside_a_span_and_a_dash_outside():
    formatter = TraceFormatter("gateway")
    with tracer.start_as_current_span("request") as span:
        inside = formatter.format(record("in a request"))
        trace_id = format(span.get_span_context().trace_id, "032x")
    assert f"WARNING gateway [{trace_id}] lamina.test: in a request" in inside
    assert "WARNING gateway [-] lamina.test: idle" in formatter.format(record("idle"))


def test_json_lines_are_objects_with_the_trace_and_span_ids():
    formatter = JsonFormatter("scheduler")
    with tracer.start_as_current_span("request") as span:
        inside = json.loads(formatter.format(record("placed %s")))
        ctx = span.get_span_context()
    assert inside["service"] == "scheduler" and inside["level"] == "WARNING"
    assert inside["logger"] == "lamina.test" and inside["message"] == "placed %s"
    assert inside["trace_id"] == format(ctx.trace_id, "032x")
    assert inside["span_id"] == format(ctx.span_id, "016x")
    assert "trace_id" not in json.loads(formatter.format(record("idle")))


def test_an_unknown_log_format_is_refused():
    with pytest.raises(ValueError, match="text or json"):
        setup_logging("gateway", fmt="xml")
