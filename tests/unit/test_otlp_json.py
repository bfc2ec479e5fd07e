"""OTLP/JSON export: the same request as the SDK's protobuf encoder, field for field, and
the exporter against a real HTTP receiver."""

from __future__ import annotations

import base64
import http.server
import threading
import time

import msgspec
import pytest
from google.protobuf.json_format import ParseDict
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    StatusCode,
    TraceFlags,
    TraceState,
)

from lamina.libs.otlp_json import OtlpJsonSpanExporter, encode


def made_spans():
    """Spans of every shape the services make, from two resources and three scopes."""
    exporter = InMemorySpanExporter()
    for service in ("gateway", "scheduler"):
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        remote = SpanContext(
            0xABC,
            0xDEF,
            is_remote=True,
            trace_flags=TraceFlags(1),
            trace_state=TraceState([("vendor", "v1")]),
        )
        caller = trace.set_span_in_context(NonRecordingSpan(remote))
        tracer = provider.get_tracer("lamina.bus", "1.2", schema_url="https://example/s")
        with tracer.start_as_current_span("root", caller, kind=SpanKind.SERVER) as root:
            root.set_attributes(
                {
                    "s": "text",
                    "b": True,
                    "i": -(2**40),
                    "f": 0.25,
                    "ss": ["a", "b"],
                    "ii": [1, 2],
                    "ff": (0.5,),
                    "bb": [True],
                }
            )
            root.add_event("first_token", {"n": 1}, timestamp=123)
            root.add_event("bare")
            root.set_status(StatusCode.ERROR, "it failed")
        links = [Link(root.get_span_context(), {"lamina.link": "heartbeat"}), Link(remote)]
        other = provider.get_tracer("lamina.worker")
        for kind in SpanKind:
            other.start_span(f"step {kind.name}", kind=kind, links=links).end()
        provider.get_tracer("plain").start_span("ok").end()
    return exporter.get_finished_spans()


def _ids_to_base64(node):
    """OTLP/JSON writes ids in hex; protobuf's own JSON mapping reads bytes as base64."""
    if isinstance(node, list):
        return [_ids_to_base64(item) for item in node]
    if isinstance(node, dict):
        return {
            key: base64.b64encode(bytes.fromhex(value)).decode()
            if key in ("traceId", "spanId", "parentSpanId")
            else _ids_to_base64(value)
            for key, value in node.items()
        }
    return node


def test_the_json_request_is_the_sdks_protobuf_request():
    spans = made_spans()
    ours = msgspec.json.decode(encode(spans))
    parsed = ParseDict(_ids_to_base64(ours), ExportTraceServiceRequest())
    assert parsed == encode_spans(spans)
    assert parsed.SerializeToString(deterministic=True) == encode_spans(spans).SerializeToString(
        deterministic=True
    )
    first = ours["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert first["traceId"] == f"{0xABC:032x}" and first["parentSpanId"] == f"{0xDEF:016x}"
    assert first["startTimeUnixNano"].isdigit()  # 64-bit integers travel as strings


def test_an_attribute_of_another_type_is_refused():
    from lamina.libs.otlp_json import _value

    with pytest.raises(TypeError, match="object"):
        _value(object())


class Receiver:
    """A real HTTP receiver that answers each POST with the next status of ``statuses``."""

    def __init__(self, statuses: list[int], protocol: str = "HTTP/1.1") -> None:
        self.statuses, self.requests = statuses, []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = protocol  # 1.1: keep-alive, as a collector answers

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.requests.append((self.path, dict(self.headers), body))
                self.send_response(receiver.statuses.pop(0) if receiver.statuses else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def test_the_exporter_posts_json_with_the_configured_headers_and_retries(monkeypatch):
    receiver = Receiver([503, 200, 400])
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url + "/")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=a%20b, authorization=Bearer t")
    exporter = OtlpJsonSpanExporter()
    spans = made_spans()
    # 503 first: tried again after a second, then taken.
    assert exporter.export(spans) == SpanExportResult.SUCCESS
    assert len(receiver.requests) == 2
    path, headers, body = receiver.requests[-1]
    assert path == "/v1/traces" and headers["Content-Type"] == "application/json"
    assert headers["x-tenant"] == "a b" and headers["authorization"] == "Bearer t"
    assert body == encode(spans)
    # 400: refused for good, not tried again.
    assert exporter.export(spans) == SpanExportResult.FAILURE
    assert len(receiver.requests) == 3
    receiver.server.shutdown()
    exporter.shutdown()


def test_a_receiver_that_closes_each_connection_costs_no_retry_wait():
    receiver = Receiver([], protocol="HTTP/1.0")  # closes after each answer
    exporter = OtlpJsonSpanExporter(receiver.url + "/v1/traces")
    spans = made_spans()[:2]
    started = time.monotonic()
    assert all(exporter.export(spans) == SpanExportResult.SUCCESS for _ in range(3))
    assert time.monotonic() - started < 1.0 and len(receiver.requests) == 3  # a retry waits 1 s
    receiver.server.shutdown()


def test_a_receiver_that_is_not_there_fails_the_batch_within_the_timeout(caplog):
    exporter = OtlpJsonSpanExporter("http://127.0.0.1:9/v1/traces", timeout=1.5)
    started = time.monotonic()
    assert exporter.export(made_spans()[:1]) == SpanExportResult.FAILURE
    assert time.monotonic() - started < 3
    # The warning says where it sent and why nothing answered.
    assert "http://127.0.0.1:9/v1/traces" in caplog.text and "refused" in caplog.text
