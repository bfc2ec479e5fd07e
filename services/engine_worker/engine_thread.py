"""The engine on its own thread, fed by a command queue, reporting through a callback.

The engine is synchronous and not thread-safe, so only this thread touches it (bar
``Engine.validate``, which reads only configuration). The asyncio side submits commands
(add, cancel, call) through a thread-safe queue; the thread steps the engine whenever it
has work and hands each step's wire events, grouped in one list, to ``emit`` (which must
be thread-safe: the service wraps ``loop.call_soon_threadsafe``).

The thread also builds the engine. Torch's OpenMP runtime keeps a pool of worker threads
for every thread that ever ran a parallel op, and once pools and their owners outnumber
the cores it stops spinning between parallel regions and sleeps instead (libgomp's
throttled spin): with the engine built on an executor thread and stepped on this one,
each parallel op ran slower (``docs/performance.md``, "Stack overhead").
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, StatusCode

from lamina.libs import spans
from lamina.schemas.v1.generate import (
    Failed,
    Finished,
    GenerateRequest,
    PromptLogprobs,
    RejectReason,
    TokenLogprob,
    Tokens,
    Usage,
)
from lamina.schemas.v1.kv import KvEventBatch
from lamina.services.engine_worker.engine import Engine, EngineStats, RequestOutput
from lamina.services.engine_worker.errors import InvalidRequestError
from lamina.services.engine_worker.request import PromptLogprob
from lamina.services.engine_worker.scheduler import ScheduledBatch

log = logging.getLogger("lamina.worker.engine")
tracer = spans.Tracer("lamina.worker")

Outgoing = tuple[str, Any, Any]  # (subject, message, trace context or None)
_STATS_PERIOD_S = 0.1
STREAM_KEEPALIVE_S = 5.0
"""Most seconds a stream goes without an event. A request waiting in the engine (behind
``max_num_seqs`` running ones, or in a long prefill) is sent an empty ``Tokens`` this
often, so that its gateway knows it waits and is not lost: the gateway's stall timeout
counts silence from a worker that still heartbeats."""
_KEEPALIVE_CHECK_S = 1.0
HANDOFF_WAIT_S = 0.002
"""Most seconds :meth:`EngineThread.submit` blocks the event loop handing a request to an
idle engine thread (it normally takes tens of microseconds)."""


@dataclass
class _Stream:
    """Where one request's events go, and how many have gone."""

    reply: str
    context: Any
    """The trace context its events carry: its span here, when it is traced."""
    seq: int = 1  # 0 was Accepted
    span: Span | None = None
    """The worker's side of the request, from the engine taking it to its end."""
    scheduled: bool = False
    """It has run in a step since it was (re)admitted."""
    prefilled: bool = False
    """It has produced a token since it was (re)admitted: its steps now are decodes."""
    tokens_sent: bool = False
    """Any output has gone to its client (what a ``Failed`` tells)."""
    sent_at: float = field(default_factory=time.monotonic)
    """When its last event went (``Accepted`` was sent as it was added)."""

    def end(self, status: str, **attributes: Any) -> None:
        """End the span (if any) with how the request ended here."""
        if self.span is None:
            return
        self.span.set_attributes({"lamina.end": status, **attributes})
        if status in ("failed", "deadline_exceeded"):
            self.span.set_status(StatusCode.ERROR, status)
        self.span.end()
        self.span = None


@dataclass(frozen=True)
class _TracedStep:
    """A step that served traced requests, as its span is made from (after its tokens)."""

    batch: ScheduledBatch
    served: list[Span]  # the traced requests' spans, in the batch's order
    prefills: int  # sequences (traced or not) in their prefill
    started_ns: int
    ended_ns: int


def _request_span(request: GenerateRequest, worker_id: str, context: Any) -> Span | None:
    """A span for the request's time in this engine, if its caller traced it and this
    process records spans (requests are traced as their callers decide: untraced ones,
    or any without a tracing SDK, cost nothing here)."""
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


_PROMPT_LOGPROB_PAIRS = 8192
"""(token, logprob) pairs per ``PromptLogprobs`` message: about 250 KB of JSON, well
under the bus's smallest usual ``max_payload`` (1 MB)."""


def _prompt_logprobs(
    request_id: str, stream: _Stream, logprobs: list[PromptLogprob]
) -> list[PromptLogprobs]:
    """A request's prompt logprobs as messages, numbered from ``stream.seq`` on."""
    width = 1 + max((len(top) for _, _, top in logprobs), default=0)
    per_message = max(1, _PROMPT_LOGPROB_PAIRS // width)
    messages = []
    for start in range(0, len(logprobs), per_message):
        part = logprobs[start : start + per_message]
        messages.append(
            PromptLogprobs(
                request_id=request_id,
                seq=stream.seq,
                start=start + 1,
                logprobs=[TokenLogprob(lp, top) for lp, _, top in part],
                ranks=[rank for _, rank, _ in part],
            )
        )
        stream.seq += 1
    return messages


@dataclass
class _Add:
    request: GenerateRequest
    reply: str
    context: Any
    taken: threading.Event | None = None  # set once the engine has the request
    grammar: Any = None  # its structured output constraint, compiled


@dataclass
class _Cancel:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Engine], None]
    done: threading.Event = field(default_factory=threading.Event)


class EngineThread(threading.Thread):
    """Owns the engine; see the module docstring."""

    def __init__(
        self,
        make_engine: Callable[[], Engine],
        worker_id: str,
        kv_subject: str,
        emit: Callable[[list[Outgoing]], None],
        handoff_wait: float = HANDOFF_WAIT_S,
        keepalive_s: float = STREAM_KEEPALIVE_S,
        on_step_failure: Callable[[str], None] = lambda reason: None,
        on_death: Callable[[str], None] = lambda reason: None,
        incarnation: str = "",
    ) -> None:
        super().__init__(name="engine", daemon=True)
        self._make_engine = make_engine
        self.engine: Engine | None = None
        """Set by the thread once built (see :meth:`wait_ready`)."""
        self.worker_id = worker_id
        self.kv_subject = kv_subject
        self.incarnation = incarnation
        """Put on every ``KvEventBatch`` (see ``WorkerStats.incarnation``)."""
        self.emit = emit
        self.stats: EngineStats | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._traced: set[str] = set()
        """Requests with a span (a superset: ended ones are dropped at the next step)."""
        self._deadlines: dict[str, int] = {}  # request id -> Unix ms, for those that have one
        self._stopping = threading.Event()
        self._stats_at = 0.0
        self._keepalive_at = 0.0
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._idle = False  # the thread is (about to be) blocked on an empty queue
        self._handoff_wait = handoff_wait
        self.keepalive_s = keepalive_s
        """Most seconds a stream goes without an event (:data:`STREAM_KEEPALIVE_S`)."""
        self.on_step_failure = on_step_failure
        """Called (on this thread) with the reason after a step raised and every request
        in the engine was failed."""
        self.on_death = on_death
        """Called once with the reason when the thread can no longer serve: it raised out
        of its loop, or :meth:`declare_wedged` found it stuck. What it held was failed."""
        self.beat = time.monotonic()
        """When the thread last went round its loop (at least every ``_STATS_PERIOD_S``
        while it is idle, once per step while it is busy)."""
        self._dead = False

    # ---------------------------------------------------------------- called from asyncio
    def submit(
        self, request: GenerateRequest, reply: str, context: Any = None, grammar: Any = None
    ) -> None:
        """Queue ``request`` (already validated; ``grammar``: its constraint, compiled).

        When the engine thread is idle, wait (at most ``handoff_wait`` s) until it has
        added the request. Woken by the queue, it still needs the GIL, which this thread
        would otherwise keep through the rest of its loop iteration (publishing
        ``Accepted``, flushing the socket). Blocked here, it lends the engine the GIL at
        once, which shortens the time from receipt to ``add_request`` and so to the first
        token. A busy engine takes the request at its next step; nothing waits then.
        """
        with self._lock:
            self._pending_adds += 1
        taken = threading.Event() if self._idle else None
        self._commands.put(_Add(request, reply, context, taken, grammar))
        if taken is not None:
            taken.wait(self._handoff_wait)

    def cancel(self, request_id: str) -> None:
        self._commands.put(_Cancel(request_id))

    def replies(self) -> list[tuple[str, str]]:
        """``(request id, reply subject)`` of every request the thread streams, as of now
        (a copy, safe to take from another thread)."""
        return [(rid, stream.reply) for rid, stream in list(self._streams.items())]

    def call(self, fn: Callable[[Engine], None]) -> threading.Event:
        """Run ``fn(engine)`` on the engine thread; the returned event is set after."""
        command = _Call(fn)
        self._commands.put(command)
        return command.done

    @property
    def built(self) -> bool:
        """Whether the thread has finished building the engine (or failed to)."""
        return self._ready.is_set()

    def wait_ready(self) -> Engine:
        """Block until the thread has built the engine; re-raise what stopped it if not."""
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error
        assert self.engine is not None
        return self.engine

    @property
    def idle(self) -> bool:
        """Whether the thread is waiting for commands (no work in the engine)."""
        return self._idle

    @property
    def num_requests(self) -> int:
        """Requests submitted and not yet finished (queued commands included)."""
        with self._lock:
            return self._pending_adds + len(self._streams)

    def stop(self) -> None:
        self._stopping.set()
        self._commands.put(None)

    def declare_wedged(self, reason: str) -> None:
        """The thread is stuck (no loop iteration for too long): fail what it held, as
        the dead thread would have, and stop it should it ever come back."""
        self._stopping.set()
        self._die(reason)

    # ------------------------------------------------------------------ the engine thread
    def run(self) -> None:
        try:
            self.engine = self._make_engine()
            self.stats = self.engine.stats()
        except BaseException as exc:  # handed to wait_ready's caller
            self._startup_error = exc
            return
        finally:
            self._ready.set()
        try:
            self._serve()
        except BaseException as exc:  # whatever ends the thread ends the worker's service
            log.exception("the engine thread died")
            self._die(f"the engine thread died: {type(exc).__name__}: {exc}")

    def _serve(self) -> None:
        while not self._stopping.is_set():
            self.beat = time.monotonic()
            busy = self.engine.has_work()
            self._drain_commands(block=not busy)
            if self.engine.has_work():
                started = time.time_ns() if self._traced else 0
                try:
                    outputs = self.engine.step()
                except Exception:  # a bug in a step must not leave clients hanging
                    log.exception("engine step failed")
                    self._fail_all("engine step failed")
                    self.on_step_failure("engine step failed")
                    continue
                traced = self._trace_requests(self.engine.last_batch, started)
                self._emit_outputs(outputs, traced)
                self._stop_expired()
                self._keep_alive()
            self._refresh_stats()

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._dead:
                return
            self._dead = True
        self._fail_all(reason)
        self._fail_queued(reason)
        self.on_death(reason)

    def _fail_queued(self, reason: str) -> None:
        """Answer the commands nobody will run: queued requests fail as retryable."""
        batch: list[Outgoing] = []
        with contextlib.suppress(queue.Empty):
            while True:
                match self._commands.get_nowait():
                    case _Add(request, reply, context, taken):
                        failed = Failed(
                            request_id=request.request_id,
                            seq=1,
                            message=reason,
                            retryable=True,
                            tokens_sent=False,
                        )
                        batch.append((reply, failed, context))
                        if taken is not None:
                            taken.set()
                    case _Call(done=done):
                        done.set()
        with self._lock:
            self._pending_adds = 0
        if batch:
            self.emit(batch)

    @property
    def dead(self) -> bool:
        """Whether the thread has stopped serving for good (see ``on_death``)."""
        return self._dead

    def _drain_commands(self, block: bool) -> None:
        try:
            command = None
            if block:
                self._idle = True
                try:
                    command = self._commands.get(timeout=_STATS_PERIOD_S)
                finally:
                    self._idle = False
            while True:
                if command is not None:
                    self._apply(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            return

    def _apply(self, command: Any) -> None:
        match command:
            case _Add(request, reply, context, taken, grammar):
                try:
                    with self._lock:
                        self._add(request, reply, context, grammar)
                        self._pending_adds -= 1
                finally:
                    if taken is not None:
                        taken.set()
            case _Cancel(request_id):
                if self.engine.abort(request_id):
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        stream.end("cancelled")
            case _Call(fn, done):
                try:
                    fn(self.engine)
                    if kv := self._kv_events():  # e.g. a reset: tell the scheduler now,
                        self.emit(kv)  # not after the next request's step
                finally:
                    done.set()

    def _add(self, request: GenerateRequest, reply: str, context: Any, grammar: Any) -> None:
        """Queue a request the service has validated and already answered ``Accepted``.
        If the engine refuses it after all, that request fails alone."""
        rid = request.request_id
        old = self._streams.get(rid)
        if old is not None and request.attempt > 0:
            # A resubmission of a request still running here: its gateway lost sight of
            # this worker (a bus outage) and moved it, and the move came back here. The
            # gateway reads only the new attempt's subject: the old run is dropped.
            self.engine.abort(rid)
            del self._streams[rid]
            old.end("superseded")
        try:
            sla = request.sla
            self.engine.add_request(
                rid,
                request.prompt_token_ids,
                request.sampling,
                priority=sla.priority,
                deadline_ms=sla.deadline_ms,
                replayed=request.replayed_output_tokens,
                grammar=grammar,
            )
        except Exception as exc:  # a duplicate id, or a bug: the request's own failure
            if not isinstance(exc, InvalidRequestError):
                log.exception("adding request %s failed", rid)
            message = exc.message if isinstance(exc, InvalidRequestError) else repr(exc)
            failed = Failed(
                request_id=rid, seq=1, message=message, retryable=False, tokens_sent=False
            )
            self.emit([(reply, failed, context)])
            return
        span = _request_span(request, self.worker_id, context)
        if span is not None:
            context = trace.set_span_in_context(span, context)
            self._traced.add(rid)
        self._streams[rid] = _Stream(reply, context, span=span)
        if request.sla.deadline_ms is not None:
            self._deadlines[rid] = request.sla.deadline_ms

    def _stop_expired(self) -> None:
        """Stop every request whose deadline has passed: its blocks are freed at once and
        its client told why (``Failed``, ``deadline_exceeded``)."""
        if not self._deadlines:  # the common case: nothing to look at each step
            return
        now_ms = time.time() * 1000
        batch: list[Outgoing] = []
        for rid, deadline_ms in list(self._deadlines.items()):
            stream = self._streams.get(rid)
            if stream is None:  # it ended some other way
                del self._deadlines[rid]
            elif deadline_ms < now_ms:
                del self._deadlines[rid]
                self.engine.abort(rid)
                del self._streams[rid]
                stream.end("deadline_exceeded")
                failed = Failed(
                    request_id=rid,
                    seq=stream.seq,
                    message="the request's deadline passed while it ran",
                    retryable=False,
                    tokens_sent=stream.tokens_sent,
                    reason=RejectReason.DEADLINE_EXCEEDED,
                )
                batch.append((stream.reply, failed, stream.context))
        if batch:
            self.emit(batch)

    def _keep_alive(self) -> None:
        """An empty ``Tokens`` (a keep-alive) to every stream silent for ``keepalive_s``
        (looked for at most once a second, or each keep-alive period if shorter)."""
        now = time.monotonic()
        if now - self._keepalive_at < min(_KEEPALIVE_CHECK_S, self.keepalive_s):
            return
        self._keepalive_at = now
        batch: list[Outgoing] = []
        for rid, stream in self._streams.items():
            if now - stream.sent_at >= self.keepalive_s:
                batch.append(
                    (
                        stream.reply,
                        Tokens(request_id=rid, seq=stream.seq, token_ids=[]),
                        stream.context,
                    )
                )
                stream.seq += 1
                stream.sent_at = now
        if batch:
            self.emit(batch)

    def _trace_requests(self, batch: ScheduledBatch | None, started_ns: int) -> _TracedStep | None:
        """The step's part in each traced request, as events on the request's span (when
        it was first scheduled, what it waited; each prefill chunk; a preemption). Returns
        what the step's own span needs, made once its tokens are on their way
        (:meth:`_trace_step`), or ``None`` when the step served no traced request; then
        nothing here costs more than a set lookup."""
        if batch is None:
            return None
        for request in batch.preempted:  # rare: kept right whether traced or not
            stream = self._streams.get(request.request_id)
            if stream is not None:
                stream.prefilled = stream.scheduled = False  # it starts over when readmitted
                if stream.span is not None:
                    stream.span.add_event("preempted")
        if not self._traced:
            return None
        self._traced &= self._streams.keys()
        served: list[Span] = []
        prefills = 0
        for request, tokens in zip(batch.requests, batch.num_new_tokens, strict=True):
            stream = self._streams.get(request.request_id)
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
        return _TracedStep(batch, served, prefills, started_ns, time.time_ns())

    def _trace_step(self, traced: _TracedStep) -> Any:
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
                "lamina.kv_cache_usage": self.engine.blocks.usage,
            },
        )
        step.end(traced.ended_ns)
        return trace.set_span_in_context(step)

    def _emit_outputs(self, outputs: list[RequestOutput], traced: _TracedStep | None) -> None:
        """Each request's new tokens (or its end) to its reply inbox, then the step's KV
        events. A traced step's span, and its KV events' under it, are made after its
        tokens have been handed on: the first token does not wait for them."""
        batch: list[Outgoing] = []
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            logprobs = None
            if out.new_logprobs is not None:
                logprobs = [TokenLogprob(lp, top) for lp, top in out.new_logprobs]
            if not stream.tokens_sent and stream.span is not None:
                stream.span.add_event("first_token")
            stream.prefilled = stream.tokens_sent = True
            stream.sent_at = now
            if out.prompt_logprobs is not None:
                for message in _prompt_logprobs(out.request_id, stream, out.prompt_logprobs):
                    batch.append((stream.reply, message, stream.context))
            if out.error is not None:
                del self._streams[out.request_id]
                stream.end("failed", **{"error.type": out.error[:200]})
                message = Failed(
                    request_id=out.request_id,
                    seq=stream.seq,
                    message=out.error,
                    retryable=False,
                    tokens_sent=stream.tokens_sent,
                )
            elif out.finished:
                del self._streams[out.request_id]
                stream.end(
                    "finished",
                    **{
                        "gen_ai.response.finish_reasons": [str(out.finish_reason)],
                        "gen_ai.usage.output_tokens": out.num_output_tokens,
                        "lamina.cached_tokens": out.num_cached_tokens,
                    },
                )
                message = Finished(
                    request_id=out.request_id,
                    seq=stream.seq,
                    finish_reason=out.finish_reason,
                    usage=Usage(
                        prompt_tokens=out.num_prompt_tokens,
                        completion_tokens=out.num_output_tokens,
                        cached_tokens=out.num_cached_tokens,
                    ),
                    token_ids=out.new_token_ids,
                    logprobs=logprobs,
                    timings=out.timings,
                )
            else:
                message = Tokens(
                    request_id=out.request_id,
                    seq=stream.seq,
                    token_ids=out.new_token_ids,
                    logprobs=logprobs,
                )
            stream.seq += 1
            batch.append((stream.reply, message, stream.context))
        if traced is not None:
            if batch:
                self.emit(batch)
            batch = self._kv_events(self._trace_step(traced))
        else:
            batch += self._kv_events()
        if batch:
            self.emit(batch)

    def _kv_events(self, step: Any = None) -> list[Outgoing]:
        """The prefix cache's events since the last call, as one message (or none).

        Made by a traced step (``step``: its context), the batch is traced too, as a
        ``kv_events`` span under the step: the scheduler's next placement links to it, so a
        placement's trace reaches the step that stored the blocks it counted on.
        """
        events = self.engine.take_kv_events()
        if not events:
            return []
        batch = KvEventBatch(
            worker_id=self.worker_id,
            block_size=self.engine.config.block_size,
            events=events,
            incarnation=self.incarnation,
        )
        context = None
        if step is not None:
            span = spans.start(
                tracer,
                f"kv_events {self.worker_id}",
                context=step,
                kind=SpanKind.PRODUCER,
                attributes={
                    "lamina.worker_id": self.worker_id,
                    "lamina.kv.events": len(events),
                    "lamina.kv.first_event_id": events[0].event_id,
                },
            )
            span.end()
            context = trace.set_span_in_context(span)
        return [(self.kv_subject, batch, context)]

    def _fail_all(self, reason: str) -> None:
        """Fail every request the engine holds, as retryable: another worker may run it."""
        batch: list[Outgoing] = []
        for rid, stream in list(self._streams.items()):
            with contextlib.suppress(Exception):  # a dead engine may not abort cleanly
                self.engine.abort(rid)
            stream.end("failed", **{"error.type": reason[:200]})
            batch.append(
                (
                    stream.reply,
                    Failed(
                        request_id=rid,
                        seq=stream.seq,
                        message=reason,
                        retryable=True,
                        tokens_sent=stream.tokens_sent,
                    ),
                    stream.context,
                )
            )
        self._streams.clear()
        self.emit(batch)

    def _refresh_stats(self) -> None:
        now = time.monotonic()
        if now - self._stats_at >= _STATS_PERIOD_S:
            self.stats = self.engine.stats()  # one reference swap: safe to read elsewhere
            self._stats_at = now
