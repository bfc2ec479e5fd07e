"""One request's life on the bus, as seen by the gateway.

``Generation.start()`` submits to the scheduler with a reply subject on this gateway's
inbox and waits for a worker's ``Accepted``, retrying retryable rejections and silent
losses (a worker that died before heartbeats said so) with back-off; only then does an
HTTP response begin, so admission failures get a real status code. ``Generation.stream()``
yields token events until ``Finished``; if the worker stops heartbeating mid-request, the
request migrates (prompt plus streamed tokens, resubmitted) and the stream continues;
closing it early (the client went away) cancels the request on its worker. Events arrive
through one wildcard subscription per gateway (:class:`Inbox`), a fresh subject per
submission.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from lamina.libs.bus import Bus
from lamina.libs.errors import PayloadTooLarge
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import Cancel
from lamina.schemas.v1.errors import BadMessage
from lamina.schemas.v1.generate import (
    Accepted,
    Failed,
    Finished,
    FinishReason,
    GenerateRequest,
    Rejected,
    Tokens,
    Usage,
)
from lamina.schemas.v1.records import Outcome, RequestRecord
from lamina.services.gateway.errors import GenerationError
from lamina.services.gateway.inbox import Inbox

log = logging.getLogger("lamina.gateway")
tracer = trace.get_tracer("lamina.gateway")

_LIVENESS_CHECK_S = 0.5  # how often a waiting stream checks its worker's heartbeats


class _Expired:
    """Queued by a timer when a wait for the next event runs out."""


@dataclass(frozen=True)
class SessionSettings:
    accept_timeout: float = 5.0
    """Seconds to wait for a worker to accept before resubmitting."""
    stall_timeout: float = 60.0
    """Seconds without any event from an accepted request (whose worker still sends
    heartbeats) before giving up on it."""
    max_attempts: int = 3
    """Submissions per request (retryable rejections and silent losses are retried)."""
    retry_backoff: float = 0.2
    """First retry delay; doubles each attempt."""


@dataclass
class Generation:
    """One request: submit, accept, stream. Use ``async with`` so it always cleans up."""

    bus: Bus
    inbox: Inbox
    request: GenerateRequest
    settings: SessionSettings
    worker_id: str | None = None
    finished: Finished | None = None
    attempts: int = 0
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    token_gaps: list[float] = field(default_factory=list)
    outcome: Outcome = Outcome.CANCELLED
    local_finish_reason: FinishReason | None = None
    """Set when the gateway itself ends the request (a stop string matched)."""
    _last_token_at: float | None = None
    _subject: str = ""
    _queue: asyncio.Queue | None = None
    _span: Span | None = None
    _accepted_at: float = 0.0
    streamed: list[int] = field(default_factory=list)
    """Every token id received so far (across migrations)."""
    _submitted: GenerateRequest | None = None

    async def __aenter__(self) -> Generation:
        r = self.request
        # The request's root span, with the OpenTelemetry GenAI attributes.
        self._span = tracer.start_span(
            f"generate {r.model}",
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": "text_completion",
                "gen_ai.request.model": r.model,
                "gen_ai.request.max_tokens": r.sampling.max_tokens or 0,
                "gen_ai.request.temperature": r.sampling.temperature,
                "lamina.request_id": r.request_id,
            },
        )
        return self

    def stop_early(self, reason: FinishReason = FinishReason.STOP) -> None:
        """The gateway finished the request itself; the worker will be told to cancel."""
        self.local_finish_reason = reason
        self.outcome = Outcome.FINISHED

    async def __aexit__(self, *exc: object) -> None:
        self.inbox.close(self._subject)
        if self.finished is None:
            await self._cancel(self.worker_id)
        self._end_span(await self._record())

    def _end_span(self, record: RequestRecord) -> None:
        span = self._span
        span.set_attributes(
            {
                "gen_ai.usage.input_tokens": record.prompt_tokens,
                "gen_ai.usage.output_tokens": record.completion_tokens,
                "gen_ai.response.finish_reasons": [record.finish_reason or record.outcome],
                "lamina.outcome": record.outcome,
                "lamina.attempts": record.attempts,
            }
        )
        if record.worker_id:
            span.set_attribute("lamina.worker_id", record.worker_id)
        if record.ttft_s is not None:
            span.set_attribute("lamina.time_to_first_token_s", record.ttft_s)
        if record.outcome in (Outcome.FAILED, Outcome.REJECTED):
            span.set_status(trace.StatusCode.ERROR)
        span.end()

    async def start(self, first_attempt: int = 0, request: GenerateRequest | None = None) -> None:
        """Return once a worker accepted ``request`` (default: the original one); raise
        :class:`GenerationError` otherwise."""
        self._submitted = request or self.request
        s = self.settings
        error = GenerationError(503, "service_unavailable", "no engine worker is available")
        for attempt in range(first_attempt, s.max_attempts):
            if attempt:
                await asyncio.sleep(s.retry_backoff * 2 ** (attempt - 1))
            self.attempts = attempt + 1
            request = msgspec.structs.replace(self._submitted, attempt=attempt)
            # A fresh subject and queue: whatever an earlier attempt still sends is dropped.
            self.inbox.close(self._subject)
            self._queue = asyncio.Queue()
            self._subject = self.inbox.open(self._queue)
            try:
                await self.bus.publish(
                    subjects.SCHED_SUBMIT,
                    request,
                    reply=self._subject,
                    context=trace.set_span_in_context(self._span),
                )
            except PayloadTooLarge as exc:
                self.outcome = Outcome.REJECTED
                raise GenerationError(
                    400,
                    "invalid_request_error",
                    f"the request is too large to send to a worker: {exc}",
                    "prompt",
                    "request_too_large",
                ) from exc
            event = await self._next_event(s.accept_timeout)
            if event is None:
                error = GenerationError(
                    503,
                    "service_unavailable",
                    f"no engine worker accepted the request within {s.accept_timeout:g}s",
                )
                continue
            match event:
                case Accepted(worker_id=worker_id):
                    self.worker_id = worker_id
                    self._accepted_at = time.monotonic()
                    return
                case Rejected(retryable=True):
                    error = GenerationError.from_rejected(event)
                case Rejected():
                    self.outcome = Outcome.REJECTED
                    raise GenerationError.from_rejected(event)
                case _:
                    raise self._unexpected(event)
        self.outcome = Outcome.REJECTED
        raise error

    async def stream(self) -> AsyncIterator[Tokens | Finished]:
        """Token events in order, ending with ``Finished``."""
        expected = 1
        silent_since = time.monotonic()
        while True:
            event = await self._next_event(_LIVENESS_CHECK_S)
            lost = None
            if event is None and not self.inbox.worker_serving(self.worker_id, self._accepted_at):
                lost = f"worker {self.worker_id} stopped serving mid-request"
            elif isinstance(event, Failed) and event.retryable:
                lost = f"generation failed on worker {self.worker_id}: {event.message}"
            if lost is not None:
                if self.attempts >= self.settings.max_attempts:
                    self.outcome = Outcome.FAILED
                    raise GenerationError(503, "service_unavailable", lost)
                # Migrate: replay the prompt plus what was streamed on another worker; its
                # tokens continue this stream where it stopped.
                log.warning("%s; moving request %s", lost, self.request.request_id)
                await self._cancel(self.worker_id)
                await self.start(first_attempt=self.attempts, request=self._resume_request())
                expected = 1
                silent_since = time.monotonic()
                continue
            if event is None:
                if time.monotonic() - silent_since > self.settings.stall_timeout:
                    self.outcome = Outcome.FAILED
                    raise GenerationError(
                        504,
                        "timeout",
                        f"worker {self.worker_id} sent nothing for "
                        f"{self.settings.stall_timeout:g}s",
                    )
                continue
            silent_since = time.monotonic()
            match event:
                case Tokens() | Finished():
                    if event.seq != expected:
                        self.outcome = Outcome.FAILED
                        raise GenerationError(
                            502,
                            "api_error",
                            f"token stream lost events (got seq {event.seq}, expected {expected})",
                        )
                    expected += 1
                    self._note_tokens(len(event.token_ids))
                    self.streamed += event.token_ids
                    if isinstance(event, Finished):
                        if self._submitted is not self.request:  # migrated: count it all
                            event = msgspec.structs.replace(
                                event,
                                usage=Usage(
                                    prompt_tokens=len(self.request.prompt_token_ids),
                                    completion_tokens=len(self.streamed),
                                    cached_tokens=event.usage.cached_tokens,
                                ),
                            )
                        self.finished = event
                        self.outcome = Outcome.FINISHED
                    yield event
                    if self.finished is not None:
                        return
                case Failed():  # not retryable: the request itself cannot run
                    self.outcome = Outcome.FAILED
                    raise GenerationError(
                        500,
                        "api_error",
                        f"generation failed on worker {self.worker_id}: {event.message}",
                    )
                case _:
                    raise self._unexpected(event)

    def _resume_request(self) -> GenerateRequest:
        """The original request continued after the tokens already streamed."""
        done = len(self.streamed)
        if not done:
            return self.request
        s = self.request.sampling
        sampling = msgspec.structs.replace(
            s,
            max_tokens=None if s.max_tokens is None else s.max_tokens - done,
            min_tokens=max(0, s.min_tokens - done),
        )
        return msgspec.structs.replace(
            self.request,
            prompt_token_ids=self.request.prompt_token_ids + self.streamed,
            sampling=sampling,
        )

    async def _cancel(self, worker_id: str | None) -> None:
        if worker_id is not None:
            with contextlib.suppress(Exception):
                await self.bus.publish(
                    subjects.worker_cancel(worker_id),
                    Cancel(request_id=self.request.request_id),
                    context=trace.set_span_in_context(self._span),
                )

    async def _next_event(self, timeout: float) -> object | None:
        """The next event, or None after ``timeout`` seconds.

        Implemented with a timer that enqueues a marker rather than by cancelling the wait
        (``wait_for``/``asyncio.timeout``): this runs inside the HTTP server's anyio cancel
        scopes, where a cancellation-based timeout was seen to wedge a stream, and it costs
        one timer per event instead of a task.
        """
        marker = _Expired()
        timer = asyncio.get_running_loop().call_later(timeout, self._queue.put_nowait, marker)
        try:
            while True:
                event = await self._queue.get()
                if event is marker:
                    return None
                if not isinstance(event, _Expired):  # a marker left by an earlier wait
                    return event
        finally:
            timer.cancel()

    def _note_tokens(self, count: int) -> None:
        now = time.monotonic()
        if count and self.first_token_at is None:
            self.first_token_at = now
        elif count and self._last_token_at is not None:
            self.token_gaps.append((now - self._last_token_at) / count)
        if count:
            self._last_token_at = now

    def _unexpected(self, event: object) -> GenerationError:
        self.outcome = Outcome.FAILED
        if isinstance(event, BadMessage):
            return GenerationError(
                500, "api_error", f"a service could not decode our message: {event.error}"
            )
        return GenerationError(502, "api_error", f"unexpected {type(event).__name__} event")

    async def _record(self) -> RequestRecord:
        """Publish what happened to this request for telemetry; return the record."""
        usage = self.finished.usage if self.finished else None
        record = RequestRecord(
            request_id=self.request.request_id,
            model=self.request.model,
            worker_id=self.worker_id,
            outcome=self.outcome,
            finish_reason=self.local_finish_reason
            or (self.finished.finish_reason if self.finished else None),
            prompt_tokens=usage.prompt_tokens if usage else len(self.request.prompt_token_ids),
            completion_tokens=usage.completion_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage else 0,
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.started,
            e2e_s=time.monotonic() - self.started,
            inter_token_s=self.token_gaps,
            attempts=max(self.attempts, 1),
        )
        with contextlib.suppress(Exception):
            await self.bus.publish(
                subjects.EVENTS_REQUEST, record, context=trace.set_span_in_context(self._span)
            )
        return record
