"""Logging and tracing set-up shared by every service.

Logs are one line each: ``time level service [trace_id] logger: message``, or one JSON
object each with ``LAMINA_LOG_FORMAT=json``; the trace id ties a log line to the
request's trace. Tracing exports over OTLP/HTTP when the standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) is set (protobuf, or JSON
with ``OTEL_EXPORTER_OTLP_PROTOCOL=http/json``), and to a JSON-lines
file when ``LAMINA_TRACE_FILE`` is (used by the end-to-end tests to capture spans from
several processes); with neither, the no-op tracer costs nothing.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace

from lamina.libs.config import process_env


class TraceFormatter(logging.Formatter):
    """One line per record, ``time level service [trace_id] logger: message``."""

    def __init__(self, service: str) -> None:
        super().__init__(
            "%(asctime)s %(levelname)s " + service + " [%(trace_id)s] %(name)s: %(message)s"
        )

    def format(self, record: logging.LogRecord) -> str:
        ctx = trace.get_current_span().get_span_context()
        record.trace_id = format(ctx.trace_id, "032x") if ctx.is_valid else "-"
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, for log pipelines (``LAMINA_LOG_FORMAT=json``): time,
    level, service, logger, message, and the trace and span ids inside a span."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            entry["trace_id"] = format(ctx.trace_id, "032x")
            entry["span_id"] = format(ctx.span_id, "016x")
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(service: str, level: str | None = None, fmt: str | None = None) -> None:
    """Log to stderr at ``level`` (default ``LAMINA_LOG_LEVEL`` or INFO), as text lines or,
    with ``fmt="json"`` (default ``LAMINA_LOG_FORMAT``), JSON objects."""
    settings = process_env()
    fmt = (fmt or settings.log_format).lower()
    if fmt not in ("text", "json"):
        raise ValueError(f"the log format must be text or json, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TraceFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or settings.log_level).upper())


def setup_tracing(service: str) -> Any:
    """Install an SDK tracer provider if an exporter is configured, and return it (to shut
    down, which flushes); else keep the no-op and return None."""
    otlp = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    )
    trace_file = process_env().trace_file
    if not otlp and not trace_file:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    from lamina.libs.spans import RecordingProvider

    provider = RecordingProvider(resource=Resource.create({"service.name": service}))
    if otlp:
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
    if trace_file:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(trace_file)))
    trace.set_tracer_provider(provider)
    return provider


def _otlp_exporter() -> Any:
    """The OTLP/HTTP exporter of the standard protocol variable: ``http/protobuf`` (the
    default: the SDK's) or ``http/json`` (``libs/otlp_json.py``: encodes in a third of the
    time)."""
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol == "http/json":
        from lamina.libs.otlp_json import OtlpJsonSpanExporter

        return OtlpJsonSpanExporter()
    if protocol != "http/protobuf":
        raise ValueError(
            f"OTLP protocol {protocol!r} is not supported here: http/protobuf or http/json"
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def shutdown_tracing() -> None:
    from lamina.libs.spans import flush

    flush()  # the ended spans the recording thread has not reached yet
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()


class JsonLinesExporter:
    """Appends each finished span as one JSON object per line (several processes may share
    the file: each line is written with a single ``write`` under an append-mode handle)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the exporter
        self._lock = threading.Lock()

    def export(self, spans: Sequence) -> object:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = []
        for span in spans:
            ctx = span.get_span_context()
            lines.append(
                json.dumps(
                    {
                        "name": span.name,
                        "service": span.resource.attributes.get("service.name"),
                        "trace_id": format(ctx.trace_id, "032x"),
                        "span_id": format(ctx.span_id, "016x"),
                        "parent_id": format(span.parent.span_id, "016x") if span.parent else None,
                        "kind": span.kind.name,
                        "start": span.start_time,
                        "end": span.end_time,
                        "attributes": dict(span.attributes or {}),
                        "events": [event.name for event in span.events],
                        "links": [format(link.context.span_id, "016x") for link in span.links],
                    }
                )
            )
        with self._lock:
            self._file.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._file.flush()
        return True
