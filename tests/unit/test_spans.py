"""Deferred spans: the identity given out at the start is the one recorded at the end."""

from __future__ import annotations

import time

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import SpanKind, StatusCode

from lamina.libs import otlp_json, spans


@pytest.fixture
def recorded(monkeypatch):
    """A provider as the services install it (a real SDK's ``RecordingProvider``), and
    what it exports."""
    exporter = InMemorySpanExporter()

    def install(sampler=None):
        provider = spans.RecordingProvider(sampler=sampler)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
        return spans.Tracer("test")

    install.exporter = exporter
    return install


def test_a_span_is_recorded_under_the_ids_it_gave_out(recorded):
    tracer = recorded()
    root = spans.start(tracer, "root", kind=SpanKind.SERVER, attributes={"a": 1})
    assert isinstance(root, spans.DeferredSpan) and root.is_recording()
    child = spans.start(tracer, "child", trace.set_span_in_context(root), start_time=123)
    child.add_event("first_token", {"n": 1}, timestamp=456)
    child.set_attributes({"b": 2})
    child.set_status(StatusCode.ERROR, "failed")
    child.add_link(root.get_span_context(), {"why": "linked later"})  # after its start
    assert recorded.exporter.get_finished_spans() == ()  # nothing recorded while running
    child.end(789)
    root.set_attribute("c", 3)
    root.end()
    assert not root.is_recording()
    spans.flush()
    by_name = {s.name: s for s in recorded.exporter.get_finished_spans()}
    made_root, made_child = by_name["root"], by_name["child"]
    assert made_root.context == root.get_span_context()
    assert made_child.context == child.get_span_context()
    assert made_child.parent.span_id == root.get_span_context().span_id
    assert made_root.parent is None and made_root.kind == SpanKind.SERVER
    assert dict(made_root.attributes) == {"a": 1, "c": 3}
    assert (made_child.start_time, made_child.end_time) == (123, 789)
    assert [(e.name, dict(e.attributes), e.timestamp) for e in made_child.events] == [
        ("first_token", {"n": 1}, 456)
    ]
    assert made_child.status.status_code == StatusCode.ERROR
    (link,) = made_child.links
    assert link.context == root.get_span_context()
    assert dict(link.attributes) == {"why": "linked later"}
    assert made_child.status.description == "failed"
    assert made_root.instrumentation_scope.name == "test"
    assert made_root.resource.attributes["service.name"].startswith("unknown_service")
    # Both exporters take them as they take the SDK's own spans.
    request = encode_spans([made_root, made_child])
    assert [s.name for s in request.resource_spans[0].scope_spans[0].spans] == ["root", "child"]
    assert b'"name":"child"' in otlp_json.encode([made_child])
    root.set_attribute("late", 1)  # after its end: ignored, as the SDK ignores it
    root.add_event("late")
    root.add_link(child.get_span_context())
    assert "late" not in made_root.attributes and not made_root.events and not made_root.links
    root.end()  # a second end records nothing more
    spans.flush()
    assert len(recorded.exporter.get_finished_spans()) == 2


def test_the_sampler_decides_a_root_and_its_children_follow(recorded):
    tracer = recorded(ParentBased(ALWAYS_OFF))
    root = spans.start(tracer, "root")
    assert not root.get_span_context().trace_flags.sampled and root.get_span_context().is_valid
    assert not spans.sampled(trace.set_span_in_context(root))
    # Under an unsampled parent no span is made: the parent's context passes on as it is.
    child = spans.start(tracer, "child", trace.set_span_in_context(root))
    assert not child.is_recording() and not isinstance(child, spans.DeferredSpan)
    assert child.get_span_context() == root.get_span_context()
    child.end()
    root.end()
    spans.flush()
    assert recorded.exporter.get_finished_spans() == ()


def test_the_recording_thread_records_ended_spans_in_batches(recorded):
    tracer = recorded()
    names = [f"span {i}" for i in range(3)]
    for name in names:
        spans.start(tracer, name).end()
    deadline = time.monotonic() + 5 * spans.RECORD_PERIOD_S
    while len(recorded.exporter.get_finished_spans()) < len(names):
        assert time.monotonic() < deadline, "the recording thread did not record them"
        time.sleep(0.05)
    assert sorted(s.name for s in recorded.exporter.get_finished_spans()) == names


def test_under_another_provider_a_span_is_its_own(monkeypatch):
    provider = TracerProvider()
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    span = spans.start(spans.Tracer("test", provider.get_tracer("test")), "plain")
    assert not isinstance(span, spans.DeferredSpan) and span.is_recording()
