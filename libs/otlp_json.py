"""Spans exported over OTLP/HTTP in its JSON encoding (``OTEL_EXPORTER_OTLP_PROTOCOL=http/json``).

The SDK's exporter speaks only ``http/protobuf``, and builds each span's protobuf message
in Python: ~100 µs a span on the 2-core machine, the largest part of what a recorded span
costs (``docs/performance.md``), and paid on the cores a request's prefill computes on.
The same payload in OTLP's JSON encoding, built as plain dicts and written by ``msgspec``,
takes about a third of that. Every OpenTelemetry Collector takes both encodings on its
OTLP/HTTP port (4318); the standard variable picks this one.

:func:`encode` is the ``ExportTraceServiceRequest`` the SDK's encoder builds, in the OTLP
JSON form: lowerCamelCase field names, trace and span ids as hex (not protobuf's base64),
64-bit integers as decimal strings, enums as numbers; tested field for field against the
SDK's protobuf encoding of the same spans (``tests/unit/test_otlp_json.py``).

Configuration is the standard one: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the whole URL)
or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``/v1/traces`` appended), ``..._HEADERS``
(``key=value`` pairs, comma-separated, URL-encoded) and ``..._TIMEOUT`` (seconds, as the
Python SDK reads it). Not supported: compression and client certificates (the SDK's
protobuf exporter has them).
"""

from __future__ import annotations

import base64
import http.client
import logging
import os
import time
import urllib.parse
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Link, SpanContext

log = logging.getLogger(__name__)

_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # SpanFlags: what the SDK's encoder sets
_RETRYABLE = frozenset({429, 502, 503, 504})
_encoder = msgspec.json.Encoder()


def _value(value: Any) -> dict[str, Any]:
    """An ``AnyValue``."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode()}
    if isinstance(value, Mapping):
        return {"kvlistValue": {"values": _attributes(value)}}
    if isinstance(value, Sequence):
        return {"arrayValue": {"values": [_value(v) for v in value]}}
    if value is None:
        return {}
    raise TypeError(f"an attribute cannot be a {type(value).__name__}")


def _attributes(attributes: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return [{"key": key, "value": _value(v)} for key, v in attributes.items()] if attributes else []


def _flags(context: SpanContext | None) -> int:
    return (
        _HAS_IS_REMOTE | _IS_REMOTE if context is not None and context.is_remote else _HAS_IS_REMOTE
    )


def _link(link: Link) -> dict[str, Any]:
    context = link.context
    out: dict[str, Any] = {
        "traceId": f"{context.trace_id:032x}",
        "spanId": f"{context.span_id:016x}",
        "attributes": _attributes(link.attributes),
        "flags": _flags(context),
    }
    if link.dropped_attributes:
        out["droppedAttributesCount"] = link.dropped_attributes
    return out


def _event(event: Event) -> dict[str, Any]:
    out: dict[str, Any] = {
        "timeUnixNano": str(event.timestamp),
        "name": event.name,
        "attributes": _attributes(event.attributes),
    }
    if event.dropped_attributes:
        out["droppedAttributesCount"] = event.dropped_attributes
    return out


def _span(span: ReadableSpan) -> dict[str, Any]:
    context = span.get_span_context()
    out: dict[str, Any] = {
        "traceId": f"{context.trace_id:032x}",
        "spanId": f"{context.span_id:016x}",
        "name": span.name,
        "kind": span.kind.value + 1,  # the API's INTERNAL is 0; OTLP's is 1 (0: unspecified)
        "startTimeUnixNano": str(span.start_time),
        "endTimeUnixNano": str(span.end_time),
        "attributes": _attributes(span.attributes),
        "flags": _flags(span.parent),
    }
    if context.trace_state:
        out["traceState"] = context.trace_state.to_header()
    if span.parent is not None:
        out["parentSpanId"] = f"{span.parent.span_id:016x}"
    if span.events:
        out["events"] = [_event(event) for event in span.events]
    if span.links:
        out["links"] = [_link(link) for link in span.links]
    status = span.status
    out["status"] = {"code": status.status_code.value}
    if status.description:
        out["status"]["message"] = status.description
    for field, count in (
        ("droppedAttributesCount", span.dropped_attributes),
        ("droppedEventsCount", span.dropped_events),
        ("droppedLinksCount", span.dropped_links),
    ):
        if count:
            out[field] = count
    return out


def encode(spans: Sequence[ReadableSpan]) -> bytes:
    """An ``ExportTraceServiceRequest`` in OTLP's JSON encoding: spans grouped by resource,
    then by instrumentation scope, as the SDK's protobuf encoder groups them."""
    grouped: dict[Any, dict[Any, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for span in spans:
        grouped[span.resource][span.instrumentation_scope].append(_span(span))
    resource_spans = []
    for resource, by_scope in grouped.items():
        scope_spans = []
        for scope, encoded in by_scope.items():
            entry: dict[str, Any] = {"scope": {}, "spans": encoded}
            if scope is not None:
                entry["scope"] = {"name": scope.name, "attributes": _attributes(scope.attributes)}
                if scope.version:
                    entry["scope"]["version"] = scope.version
                if scope.schema_url:
                    entry["schemaUrl"] = scope.schema_url
            scope_spans.append(entry)
        item: dict[str, Any] = {
            "resource": {"attributes": _attributes(resource.attributes)},
            "scopeSpans": scope_spans,
        }
        if resource.schema_url:
            item["schemaUrl"] = resource.schema_url
        resource_spans.append(item)
    return _encoder.encode({"resourceSpans": resource_spans})


def _env(name: str) -> str | None:
    """A trace exporter setting: the ``_TRACES_`` variable, else the general one."""
    return os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or os.environ.get(
        f"OTEL_EXPORTER_OTLP_{name}"
    )


def _headers(text: str | None) -> dict[str, str]:
    headers = {}
    for pair in (text or "").split(","):
        key, sep, value = pair.partition("=")
        if sep and key.strip():
            headers[urllib.parse.unquote(key.strip())] = urllib.parse.unquote(value.strip())
    return headers


class OtlpJsonSpanExporter(SpanExporter):
    """Exports batches over OTLP/HTTP as JSON, on one kept-alive connection; a batch the
    receiver refuses for now (429, 502-504, or no connection) is tried again with backoff
    (1, 2, 4 ... s) within the timeout, as the OTLP specification asks."""

    def __init__(
        self,
        endpoint: str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> None:
        if endpoint is None:
            endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or (
                os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318").rstrip("/")
                + "/v1/traces"
            )
        url = urllib.parse.urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"an OTLP/HTTP endpoint is an http(s) URL, not {endpoint!r}")
        self._url = url
        self._path = url.path or "/v1/traces"
        self._headers = {
            **_headers(_env("HEADERS")),
            **(headers or {}),
            "Content-Type": "application/json",
        }
        self._timeout = timeout if timeout is not None else float(_env("TIMEOUT") or 10)
        self._connection: http.client.HTTPConnection | None = None
        self._shut_down = False
        self._last_error = ""
        """Why the last post got no answer (a refused connection, a timeout)."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shut_down:
            return SpanExportResult.FAILURE
        body = encode(spans)
        deadline, backoff = time.monotonic() + self._timeout, 1.0
        while True:
            status = self._post(body, max(0.1, deadline - time.monotonic()))
            if status is not None and 200 <= status < 300:
                return SpanExportResult.SUCCESS
            if (status is not None and status not in _RETRYABLE) or self._shut_down:
                log.warning("OTLP receiver refused %d spans: HTTP %s", len(spans), status)
                return SpanExportResult.FAILURE
            if time.monotonic() + backoff > deadline:
                why = f"HTTP {status}" if status is not None else self._last_error
                log.warning(
                    "OTLP export of %d spans to %s failed (%s); dropped",
                    len(spans),
                    self._url.geturl(),
                    why,
                )
                return SpanExportResult.FAILURE
            time.sleep(backoff)
            backoff *= 2

    def _post(self, body: bytes, timeout: float) -> int | None:
        """The response's status, or None when there was no answer. A kept connection the
        receiver has closed meanwhile is made again at once, for one more try."""
        for fresh in (self._connection is None, True):
            if fresh:
                self._close()
                kind = (
                    http.client.HTTPSConnection
                    if self._url.scheme == "https"
                    else http.client.HTTPConnection
                )
                self._connection = kind(self._url.hostname, self._url.port, timeout=timeout)
            try:
                self._connection.timeout = timeout
                self._connection.request("POST", self._path, body, self._headers)
                response = self._connection.getresponse()
                response.read()
                if response.will_close:
                    self._close()
                return response.status
            except (OSError, http.client.HTTPException) as exc:
                self._close()
                self._last_error = f"no answer: {type(exc).__name__}: {exc}"
                if fresh:
                    return None
        return None

    def _close(self) -> None:
        if self._connection is not None:
            self._connection.close()
        self._connection = None

    def shutdown(self) -> None:
        self._shut_down = True
        self._close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
