"""Deferred spans: the identity given out at the start is the one recorded at the end."""

from __future__ import annotations

import time

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import SpanKind, StatusCode

from lamina.libs import spans


@pytest.fixture
def recorded(monkeypatch):
    """A provider as the services install it (a real SDK, ``ReservedIds``), and what it
    exports."""
    exporter = InMemorySpanExporter()

    def install(sampler=None):
        provider = TracerProvider(id_generator=spans.ReservedIds(), sampler=sampler)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
        return provider.get_tracer("test")

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
    assert made_child.status.description == "failed"
    root.end()  # a second end records nothing more
    spans.flush()
    assert len(recorded.exporter.get_finished_spans()) == 2


def test_the_sampler_decides_a_root_and_its_children_follow(recorded):
    tracer = recorded(ParentBased(ALWAYS_OFF))
    root = spans.start(tracer, "root")
    child = spans.start(tracer, "child", trace.set_span_in_context(root))
    assert not root.get_span_context().trace_flags.sampled and not child.is_recording()
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


def test_without_reserved_ids_a_span_is_the_tracers_own(monkeypatch):
    provider = TracerProvider()
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    span = spans.start(provider.get_tracer("test"), "plain")
    assert not isinstance(span, spans.DeferredSpan) and span.is_recording()
