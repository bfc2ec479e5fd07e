"""Spans whose identity is fixed when their work starts and whose record is made when it
is done: a request's first token does not wait for its spans to be recorded.

Recording a span with the OpenTelemetry SDK (sampler, span object, attribute checks,
processors) took 80-110 µs in a service between requests, against 20 µs in a loop
(``docs/performance.md``), and a request's path made nine of them before its first
token. What the path needs from a span while its work runs is only its identity, to
pass on to the next hop: a :class:`DeferredSpan` is that identity (trace id, a new span
id, the parent's sampled flag) plus what is said about it meanwhile (attributes,
events, status), kept in plain lists. :meth:`DeferredSpan.end` hands it to a recording
thread, which records it through the SDK in a batch with others, under the span id it
already gave out and with its real start and event times.

The span id travels to the SDK through :class:`ReservedIds`, the provider's id generator
(``setup_tracing`` installs it): ``end`` reserves the id for the one span it makes. A
root span (no parent) asks the provider's sampler as it starts, as the SDK would; a
child has its parent's sampled flag (the default ``parentbased`` samplers decide the
same).
"""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import (
    Link,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.util.types import Attributes


class ReservedIds(RandomIdGenerator):
    """Random ids, except the ids reserved for the span being recorded on this thread."""

    def __init__(self) -> None:
        self._reserved = threading.local()

    def reserve(self, trace_id: int, span_id: int) -> None:
        self._reserved.ids = (trace_id, span_id)

    def release(self) -> None:
        self._reserved.ids = None

    def generate_trace_id(self) -> int:
        ids = getattr(self._reserved, "ids", None)
        return ids[0] if ids else super().generate_trace_id()

    def generate_span_id(self) -> int:
        ids = getattr(self._reserved, "ids", None)
        if ids:
            self._reserved.ids = None  # one span only
            return ids[1]
        return super().generate_span_id()


def _new_id(bits: int) -> int:
    while not (value := random.getrandbits(bits)):
        pass
    return value


class DeferredSpan(Span):
    """A span known now (its context can be propagated and parent other spans) and
    recorded after :meth:`end`. Only :func:`start` makes one."""

    def __init__(
        self,
        tracer: trace.Tracer,
        ids: ReservedIds,
        name: str,
        parent: otel_context.Context,
        kind: SpanKind,
        attributes: Attributes,
        links: Sequence[Link],
        start_ns: int | None,
    ) -> None:
        self._tracer, self._ids, self._parent = tracer, ids, parent
        self._name, self._kind, self._links = name, kind, links
        self._attributes = dict(attributes or {})
        self._events: list[tuple[str, Attributes, int]] = []
        self._status: Status | None = None
        self._start_ns = start_ns or time.time_ns()
        self._end_ns = 0
        parent_span = trace.get_current_span(parent).get_span_context()
        if parent_span.is_valid:
            trace_id, flags = parent_span.trace_id, parent_span.trace_flags
        else:  # a root: the sampler decides now, as the SDK would
            trace_id = _new_id(128)
            sampler = trace.get_tracer_provider().sampler
            result = sampler.should_sample(parent, trace_id, name, kind, attributes, links)
            sampled = TraceFlags.SAMPLED if result.decision.is_sampled() else 0
            flags = TraceFlags(TraceFlags.RANDOM_TRACE_ID | sampled)
        self._context = SpanContext(trace_id, _new_id(64), is_remote=False, trace_flags=flags)

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._context.trace_flags.sampled and not self._end_ns

    def set_attribute(self, key: str, value: Any) -> None:
        self._attributes[key] = value

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        self._attributes.update(attributes)

    def add_event(
        self, name: str, attributes: Attributes = None, timestamp: int | None = None
    ) -> None:
        self._events.append((name, attributes, timestamp or time.time_ns()))

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        self._status = status if isinstance(status, Status) else Status(status, description)

    def update_name(self, name: str) -> None:
        self._name = name

    def record_exception(self, exception: BaseException, *args: Any, **kwargs: Any) -> None:
        self.add_event(
            "exception",
            {"exception.type": type(exception).__name__, "exception.message": str(exception)},
        )

    def end(self, end_time: int | None = None) -> None:
        """End the span now (or at ``end_time``, ns); the recording thread records it."""
        if self._end_ns:
            return
        self._end_ns = end_time or time.time_ns()
        if self._context.trace_flags.sampled:
            _RECORDER.add(self)

    def record(self) -> None:
        """Make the SDK's span, with this one's ids, times and contents."""
        self._ids.reserve(self._context.trace_id, self._context.span_id)
        try:
            span = self._tracer.start_span(
                self._name,
                context=self._parent,
                kind=self._kind,
                attributes=self._attributes,
                links=self._links,
                start_time=self._start_ns,
            )
        finally:
            self._ids.release()
        for name, attributes, timestamp in self._events:
            span.add_event(name, attributes, timestamp)
        if self._status is not None:
            span.set_status(self._status)
        span.end(self._end_ns)


class Current:
    """``span`` as the current span for a block (over ``context``, default the current
    one), ended after it; an exception escaping the block is recorded on it. What the
    SDK's ``start_as_current_span`` does, without its two generator-based context
    managers: this runs for every traced message."""

    __slots__ = ("_context", "_span", "_token")

    def __init__(self, span: Span, context: otel_context.Context | None = None) -> None:
        self._span, self._context = span, context

    def __enter__(self) -> Span:
        self._token = otel_context.attach(trace.set_span_in_context(self._span, self._context))
        return self._span

    def __exit__(self, kind: type | None, exc: BaseException | None, _tb: object) -> None:
        otel_context.detach(self._token)
        if exc is not None and self._span.is_recording():
            self._span.record_exception(exc)
            self._span.set_status(Status(StatusCode.ERROR, f"{kind.__name__}: {exc}"))
        self._span.end()


RECORD_PERIOD_S = 1.0
"""How often the recording thread records the spans ended since its last turn."""
RECORD_BATCH = 512
"""Ended spans that wake the recording thread before its period is up."""


class _Recorder:
    """Records ended spans on a thread of its own, in batches: every ``RECORD_PERIOD_S``,
    or sooner once ``RECORD_BATCH`` are waiting. A span's record then costs its request
    nothing: on a machine whose cores the engine is computing on, even work done after
    a request's message has gone (the scheduler's, once it has forwarded it) slowed that
    request's prefill by as much (``docs/performance.md``). A batch costs the requests
    in flight while it is recorded, as the SDK's batch exporter's thread already does."""

    def __init__(self) -> None:
        self._pending: collections.deque[DeferredSpan] = collections.deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, span: DeferredSpan) -> None:
        self._pending.append(span)
        if self._thread is None:
            self._start()
        if len(self._pending) >= RECORD_BATCH:
            self._wake.set()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="lamina-span-recorder", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait(RECORD_PERIOD_S)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        """Record every ended span now (the thread's turn, and at shutdown before the
        provider's own flush)."""
        with self._lock:
            for _ in range(len(self._pending)):  # what has ended so far, no more
                self._pending.popleft().record()


_RECORDER = _Recorder()
flush = _RECORDER.flush


def start(
    tracer: trace.Tracer,
    name: str,
    context: otel_context.Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes = None,
    links: Sequence[Link] = (),
    start_time: int | None = None,
) -> Span:
    """A :class:`DeferredSpan` under ``context`` (default: the current one) when the
    process records spans with :class:`ReservedIds`, else the tracer's own span (a no-op
    one without an SDK)."""
    ids = getattr(trace.get_tracer_provider(), "id_generator", None)
    if not isinstance(ids, ReservedIds):
        return tracer.start_span(
            name,
            context=context,
            kind=kind,
            attributes=attributes,
            links=links,
            start_time=start_time,
        )
    if context is None:
        context = otel_context.get_current()
    return DeferredSpan(tracer, ids, name, context, kind, attributes, links, start_time)
