"""The worker's spans: each traced request's time in the engine, each step that served
one, and the KV event batches such a step made.

Requests are traced as their callers decide: untraced ones, or any without a tracing
SDK, cost a set lookup per step here and nothing more.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind

from lamina.libs import spans
from lamina.schemas.v1.generate import GenerateRequest
from lamina.services.engine_worker.engine.batch_scheduler import ScheduledBatch
from lamina.services.engine_worker.streams import Streams

tracer = spans.Tracer("lamina.worker")


def request_span(request: GenerateRequest, worker_id: str, context: Any) -> Span | None:
    """A span for the request's time in this engine, if its caller traced it and this
    process records spans."""
    if not spans.sampled(context):
        return None
    span = spans.start(
        tracer,
        f"serve {request.model}",
        context=context,
        attributes={
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": request.model,
            "gen_ai.request.max_tokens": request.sampling.max_tokens or 0,
            "lamina.request_id": request.request_id,
            "lamina.worker_id": worker_id,
            "lamina.attempt": request.attempt,
            "lamina.replayed_output_tokens": request.replayed_output_tokens,
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
        },
    )
    return span if span.is_recording() else None


@dataclass(frozen=True)
class TracedStep:
    """A step that served traced requests, as its span is made from (after its tokens)."""

    batch: ScheduledBatch
    served: list[Span]  # the traced requests' spans, in the batch's order
    prefills: int  # sequences (traced or not) in their prefill
    started_ns: int
    ended_ns: int


class StepTracer:
    """Which requests are traced, and the spans their steps make."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.traced: set[str] = set()
        """Requests with a span (a superset: ended ones are dropped at the next step)."""

    def start(self) -> int:
        """A step's start time, if a traced request may be in it (0 otherwise)."""
        return time.time_ns() if self.traced else 0

    def requests(
        self, batch: ScheduledBatch, streams: Streams, started_ns: int
    ) -> TracedStep | None:
        """The step's part in each traced request, as events on the request's span (when
        it was first scheduled; each prefill chunk; a preemption). Returns what the step's
        own span needs (:meth:`step`), or None when the step served no traced request."""
        for request in batch.preempted:  # rare: kept right whether traced or not
            stream = streams.get(request.request_id)
            if stream is not None:
                stream.prefilled = stream.scheduled = False  # it starts over when readmitted
                if stream.span is not None:
                    stream.span.add_event("preempted")
        if not self.traced:
            return None
        self.traced &= streams.keys()
        served: list[Span] = []
        prefills = 0
        for request, tokens in zip(batch.requests, batch.num_new_tokens, strict=True):
            stream = streams.get(request.request_id)
            if stream is None:
                continue
            prefill = not stream.prefilled  # a fully cached prompt leaves one token to do
            prefills += prefill
            if stream.span is None:
                continue
            served.append(stream.span)
            if not stream.scheduled:
                stream.scheduled = True
                stream.span.add_event("scheduled")
            if prefill:
                stream.span.add_event(
                    "prefill_chunk",
                    {
                        "lamina.tokens": tokens,
                        "lamina.computed_tokens": request.num_computed_tokens,
                        "lamina.cached_tokens": request.num_cached_tokens,
                    },
                )
        if not served or not started_ns:
            return None
        return TracedStep(batch, served, prefills, started_ns, time.time_ns())

    def step(self, traced: TracedStep, kv_usage: float) -> Any:
        """One ``engine step`` span for the whole step, linked to every traced request it
        served; returns its context (what the step's KV event batch is traced under).

        The step span is a child of the first traced request in the batch (the oldest
        running one: decodes come first), so a single traced request's trace holds all its
        steps; other traced requests reach it through their link."""
        batch, served = traced.batch, traced.served
        step = spans.start(
            tracer,
            "engine step",
            context=trace.set_span_in_context(served[0]),
            start_time=traced.started_ns,
            links=[Link(span.get_span_context()) for span in served],
            attributes={
                "lamina.worker_id": self.worker_id,
                "lamina.batch.tokens": sum(batch.num_new_tokens),
                "lamina.batch.decode_seqs": len(batch) - traced.prefills,
                "lamina.batch.prefill_seqs": traced.prefills,
                "lamina.batch.preempted": len(batch.preempted),
                "lamina.batch.traced_seqs": len(served),
                "lamina.kv_cache_usage": kv_usage,
            },
        )
        step.end(traced.ended_ns)
        return trace.set_span_in_context(step)

    def kv_events(self, step: Any, num_events: int, first_event_id: int) -> Any:
        """A ``kv_events`` span under a traced step (``step``: its context); returns the
        context the batch is published with. The scheduler's next placement links to it,
        so a placement's trace reaches the step that stored the blocks it counted on."""
        span = spans.start(
            tracer,
            f"kv_events {self.worker_id}",
            context=step,
            kind=SpanKind.PRODUCER,
            attributes={
                "lamina.worker_id": self.worker_id,
                "lamina.kv.events": num_events,
                "lamina.kv.first_event_id": first_event_id,
            },
        )
        span.end()
        return trace.set_span_in_context(span)
