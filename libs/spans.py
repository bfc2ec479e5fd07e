"""Spans whose identity is fixed when their work starts and whose record is made when it
is done: a request's first token does not wait for its spans to be recorded.

Recording a span with the OpenTelemetry SDK (sampler, span object, attribute checks,
processors) took 80-110 µs in a service between requests, against 20 µs in a loop
(``docs/performance.md``), and a request's path made nine of them before its first
token. What the path needs from a span while its work runs is only its identity, to
pass on to the next hop: a :class:`DeferredSpan` is that identity (trace id, a new span
id, the parent's sampled flag) plus what is said about it meanwhile (attributes,
events, status), kept in plain lists. :meth:`DeferredSpan.end` hands it to a recording
thread, which makes the SDK's finished span (``ReadableSpan``) from it in a batch with
others and gives that to the provider's span processors, as the SDK's own span does when
it ends: exporters, limits of the batch processor and all. A finished span made directly
costs a fifth of one made through the SDK's tracer (its sampler, its mutable span and
attribute checks, then a copy at the end) on the services' cores.

:class:`RecordingProvider` is the SDK's provider that also takes these records
(``setup_tracing`` installs it); :class:`Tracer` names the instrumentation scope. A root
span (no parent) asks the provider's sampler as it starts, as the SDK would; a child of a
sampled parent is sampled (the default ``parentbased`` samplers decide the same), and
under an unsampled parent no span is made at all.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.util.types import Attributes

log = logging.getLogger(__name__)


class RecordingProvider(TracerProvider):
    """The SDK's tracer provider, whose span processors also take the records of deferred
    spans (:meth:`record`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._processors: list[SpanProcessor] = []

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        self._processors.append(span_processor)

    def record(self, span: ReadableSpan) -> None:
        """A finished span, to every processor, as the SDK's span gives itself at its end."""
        for processor in self._processors:
            processor.on_end(span)


class Tracer:
    """A named source of spans, the instrumentation scope of those :func:`start` makes:
    deferred ones where a :class:`RecordingProvider` is installed, the installed
    provider's own (a no-op one without an SDK) elsewhere."""

    __slots__ = ("api", "scope")

    def __init__(self, name: str, api: trace.Tracer | None = None) -> None:
        """``api``: the tracer to fall back on (default: the global provider's)."""
        self.scope = InstrumentationScope(name)
        self.api = api or trace.get_tracer(name)


def _new_id(bits: int) -> int:
    while not (value := random.getrandbits(bits)):
        pass
    return value


class DeferredSpan(Span):
    """A span known now (its context can be propagated and parent other spans) and
    recorded after :meth:`end`. Only :func:`start` makes one."""

    def __init__(
        self,
        provider: RecordingProvider,
        scope: InstrumentationScope,
        name: str,
        parent: otel_context.Context,
        kind: SpanKind,
        attributes: Attributes,
        links: Sequence[Link],
        start_ns: int | None,
    ) -> None:
        self._provider, self._scope = provider, scope
        self._name, self._kind, self._links = name, kind, list(links)
        self._attributes = dict(attributes or {})
        self._events: list[tuple[str, Attributes, int]] = []
        self._status: Status | None = None
        self._start_ns = start_ns or time.time_ns()
        self._end_ns = 0
        parent_span = trace.get_current_span(parent).get_span_context()
        if parent_span.is_valid:
            trace_id, flags = parent_span.trace_id, parent_span.trace_flags
            self._parent: SpanContext | None = parent_span
        else:  # a root: the sampler decides now, as the SDK would
            self._parent = None
            trace_id = _new_id(128)
            sampler = provider.sampler
            result = sampler.should_sample(parent, trace_id, name, kind, attributes, links)
            sampled = TraceFlags.SAMPLED if result.decision.is_sampled() else 0
            flags = TraceFlags(TraceFlags.RANDOM_TRACE_ID | sampled)
        self._context = SpanContext(trace_id, _new_id(64), is_remote=False, trace_flags=flags)

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._context.trace_flags.sampled and not self._end_ns

    # What is said about a span after its end is ignored, as the SDK ignores it: the
    # recording thread may be reading it.
    def set_attribute(self, key: str, value: Any) -> None:
        if not self._end_ns:
            self._attributes[key] = value

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        if not self._end_ns:
            self._attributes.update(attributes)

    def add_event(
        self, name: str, attributes: Attributes = None, timestamp: int | None = None
    ) -> None:
        if not self._end_ns:
            self._events.append((name, attributes, timestamp or time.time_ns()))

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if not self._end_ns:
            self._status = status if isinstance(status, Status) else Status(status, description)

    def add_link(self, context: SpanContext, attributes: Attributes = None) -> None:
        if not self._end_ns:
            self._links.append(Link(context, attributes))

    def update_name(self, name: str) -> None:
        if not self._end_ns:
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
        """Give the provider's processors the finished span, with this one's ids, times
        and contents."""
        self._provider.record(
            ReadableSpan(
                self._name,
                context=self._context,
                parent=self._parent,
                resource=self._provider.resource,
                attributes=self._attributes,
                events=[Event(name, attrs, timestamp) for name, attrs, timestamp in self._events],
                links=self._links,
                kind=self._kind,
                status=self._status or Status(StatusCode.UNSET),
                start_time=self._start_ns,
                end_time=self._end_ns,
                instrumentation_scope=self._scope,
            )
        )


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


@contextlib.contextmanager
def within(context: otel_context.Context | None) -> Iterator[None]:
    """``context`` as the current one for a block (None: leave it as it is): work resumed
    for a request later, e.g. from a queue, continues that request's trace."""
    if context is None:
        yield
        return
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


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
                try:
                    self._pending.popleft().record()
                except Exception:  # a processor's fault must not end the recording
                    log.exception("recording a span failed")


_RECORDER = _Recorder()
flush = _RECORDER.flush


def sampled(context: otel_context.Context | None = None) -> bool:
    """Whether ``context`` (default: the current one) is in a sampled trace: only then is
    there a span worth making. An unsampled context is passed on as it is."""
    return trace.get_current_span(context).get_span_context().trace_flags.sampled


def start(
    tracer: Tracer,
    name: str,
    context: otel_context.Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes = None,
    links: Sequence[Link] = (),
    start_time: int | None = None,
) -> Span:
    """A :class:`DeferredSpan` under ``context`` (default: the current one) when the
    process records spans with a :class:`RecordingProvider` (under an unsampled parent, that
    parent's context, made no span of), else the installed provider's own span (a no-op one
    without an SDK)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, RecordingProvider):
        return tracer.api.start_span(
            name,
            context=context,
            kind=kind,
            attributes=attributes,
            links=links,
            start_time=start_time,
        )
    if context is None:
        context = otel_context.get_current()
    parent = trace.get_current_span(context).get_span_context()
    if parent.is_valid and not parent.trace_flags.sampled:
        return NonRecordingSpan(parent)  # recorded by nobody: the context passes on as it is
    return DeferredSpan(provider, tracer.scope, name, context, kind, attributes, links, start_time)
