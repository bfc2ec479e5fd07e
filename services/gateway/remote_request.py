"""One request's life on the bus, as the gateway sees it: submitted, accepted, streamed,
moved to another worker when its worker is lost.

:meth:`RemoteRequest.start` submits to the scheduler with a reply subject on this gateway's
inbox and waits for a worker's ``Accepted``, retrying retryable rejections and silent
losses with back-off; only then does an HTTP response begin, so a refusal gets a real
status code. A scheduler that queues the request says ``Queued``: the wait for
acceptance then has no accept timer (the scheduler answers within its queue wait), and
closing the request takes it out of the queue. ``overloaded`` and
``deadline_unmeetable`` are not retried here: the client is told when to retry.
:meth:`RemoteRequest.stream` yields the accepted attempt's token events until
``Finished``. When the attempt's worker is lost (it stops heartbeating, or it fails the
request as retryable) the request moves: the prompt plus every token streamed so far is
submitted again, through the same attempt loop, and the new worker's tokens continue the
stream. Each attempt has a reply subject and queue of its own, so nothing a lost attempt
still sends can reach the next; within one attempt the events follow the ``seq`` contract
of ``schemas/v1/generate.py`` (a gap is a lost stream, a 502).

How the request ended (``outcome``) follows from what was recorded, not from assignments
on each path: finished, else failed or rejected when an error ended it (failed once any
worker had accepted it), else cancelled (the client went away).
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

from lamina.libs import spans
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
    PromptLogprobs,
    Queued,
    Rejected,
    RejectReason,
    Tokens,
    Usage,
)
from lamina.schemas.v1.records import Outcome, RequestRecord
from lamina.services.gateway.errors import CLIENT_RETRIES, GenerationError
from lamina.services.gateway.inbox import Inbox, Undeliverable
from lamina.services.gateway.mailbox import Mailbox
from lamina.services.gateway.worker_watch import WorkerWatch

log = logging.getLogger("lamina.gateway")
tracer = spans.Tracer("lamina.gateway")

_LIVENESS_CHECK_S = 0.5  # how often a waiting stream checks its worker's heartbeats


class _WorkerLost(Exception):
    """The accepted attempt cannot finish where it is; the request may move.
    ``handed_off``: its worker moved it on purpose (a drain that moves), so it goes
    again at once, without the backoff that a failure waits."""

    def __init__(self, why: str, handed_off: bool = False) -> None:
        super().__init__(why)
        self.handed_off = handed_off


@dataclass(frozen=True)
class RetryPolicy:
    accept_timeout: float = 5.0
    """Seconds to wait for a worker to accept before resubmitting."""
    stall_timeout: float = 60.0
    """Seconds without any event from an accepted request (whose worker still sends
    heartbeats) before giving up on it. A request waiting in its worker is not silent: the
    worker sends a keep-alive every ``engine_thread.STREAM_KEEPALIVE_S`` (5 s)."""
    max_attempts: int = 3
    """Submissions per request, the first one and every retry or move included."""
    retry_backoff: float = 0.2
    """First retry delay; doubles each attempt."""


@dataclass
class RemoteRequest:
    """One request: submit, accept, stream. Use ``async with`` so it always cleans up."""

    bus: Bus
    inbox: Inbox
    workers: WorkerWatch
    """Whether its worker still serves it (heartbeats)."""
    request: GenerateRequest
    settings: RetryPolicy
    n: int = 1
    """The client's ``n`` for its record (0: a later sequence of a group)."""
    worker_id: str | None = None
    """The worker of the accepted attempt (None until one accepts)."""
    attempts: int = 0
    """Submissions so far."""
    moves: int = 0
    """Times the accepted request moved to another worker."""
    numerics: str = ""
    """``WorkerStats.numerics`` of the worker whose tokens the stream began with."""
    inexact_moves: int = 0
    """Moves that continued the stream on a worker of other numerics."""
    streamed: list[int] = field(default_factory=list)
    """Every token id received so far, across moves."""
    finished: Finished | None = None
    local_finish_reason: FinishReason | None = None
    """Set when the gateway itself ends the request (a stop string matched)."""
    error: GenerationError | None = None
    """What ended the request, when an error did."""
    queued: bool = False
    """Waiting in a scheduler's queue (told by ``Queued``; cancelled there)."""
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    token_gaps: list[float] = field(default_factory=list)
    _last_token_at: float | None = None
    _accepted_at: float = 0.0
    _first_accepted_at: float | None = None
    _subject: str = ""
    _queue: Mailbox | None = None
    _span: Span | None = None

    @property
    def outcome(self) -> Outcome:
        if self.finished is not None or self.local_finish_reason is not None:
            return Outcome.FINISHED
        if self.error is not None:
            return Outcome.FAILED if self.worker_id is not None else Outcome.REJECTED
        return Outcome.CANCELLED

    async def __aenter__(self) -> RemoteRequest:
        r = self.request
        # The request's root span, with the OpenTelemetry GenAI attributes.
        self._span = spans.start(
            tracer,
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

    async def __aexit__(self, *exc: object) -> None:
        self._close_attempt()
        if self.finished is None:
            await self._cancel()
        self._end_span(await self._record())

    # ------------------------------------------------------------------------ attempts
    async def start(self) -> None:
        """Return once a worker accepted the request; raise :class:`GenerationError`
        otherwise."""
        try:
            await self._submit_until_accepted(self.request)
        except GenerationError as exc:
            self.error = exc
            raise

    async def stream(self) -> AsyncIterator[PromptLogprobs | Tokens | Finished]:
        """The stream's events in order, ending with ``Finished``, across moves (a move
        before the first token sends the prompt's logprobs again, from ``start`` 1)."""
        try:
            while True:
                try:
                    async for event in self._attempt_events():
                        yield event
                    return
                except _WorkerLost as lost:
                    await self._move(str(lost), at_once=lost.handed_off)
        except GenerationError as exc:
            self.error = exc
            raise

    async def _move(self, why: str, at_once: bool = False) -> None:
        """Submit the request again, continued after what was streamed, elsewhere
        (``at_once``: without waiting the retry backoff first)."""
        if self.attempts >= self.settings.max_attempts:
            raise GenerationError(503, "service_unavailable", why)
        log.warning("%s; moving request %s", why, self.request.request_id)
        self.moves += 1
        await self._cancel()
        await self._submit_until_accepted(self._resume_request(), at_once)

    async def _submit_until_accepted(self, request: GenerateRequest, at_once: bool = False) -> None:
        """Submit ``request`` until a worker accepts it, within the attempts left (the
        first time without the backoff when ``at_once``)."""
        s = self.settings
        error = GenerationError(503, "service_unavailable", "no engine worker is available")
        while self.attempts < s.max_attempts:
            if self.attempts and not at_once:
                await asyncio.sleep(s.retry_backoff * 2 ** (self.attempts - 1))
            at_once = False
            event = await self._submit(request)
            while isinstance(event, Queued):  # the scheduler answers within its queue wait
                self.queued = True
                event = await self._next_event(s.stall_timeout + (event.max_wait_s or 0.0))
            if event is None and self.queued:  # the scheduler itself went quiet
                await self._cancel()
            match event:
                case Accepted(worker_id=worker_id):
                    self._note_numerics(event.numerics)
                    self.worker_id, self._accepted_at = worker_id, time.monotonic()
                    self._first_accepted_at = self._first_accepted_at or self._accepted_at
                    self.queued = False
                    return
                case None:
                    error = GenerationError(
                        503,
                        "service_unavailable",
                        f"no engine worker accepted the request within {s.accept_timeout:g}s",
                    )
                case Undeliverable():  # nothing listens: retried with back-off, quickly
                    self.queued = False
                    error = GenerationError(
                        503,
                        "service_unavailable",
                        "no scheduler is running (or the worker it chose is gone)",
                        retry_after_s=1.0,
                    )
                case Rejected(retryable=True) if (
                    event.reason not in CLIENT_RETRIES or event.worker_id  # a stale view
                ):
                    self.queued = False
                    error = GenerationError.from_rejected(event)
                case Rejected():
                    self.queued = False
                    raise GenerationError.from_rejected(event)
                case _:
                    raise _unexpected(event)
        raise error

    async def _submit(self, request: GenerateRequest) -> object | None:
        """One attempt: a fresh reply subject, the submission, and its first event (None
        when nothing came within ``accept_timeout``)."""
        self.attempts += 1
        self._close_attempt()
        self._queue = Mailbox()
        self._subject = self.inbox.open(self._queue, request.request_id)
        try:
            await self.bus.publish(
                subjects.SCHED_SUBMIT,
                msgspec.structs.replace(request, attempt=self.attempts - 1),
                reply=self._subject,
                context=trace.set_span_in_context(self._span),
                traced=False,  # the scheduler's span is the request span's child
            )
        except PayloadTooLarge as exc:
            param, size = _largest_part(request)
            raise GenerationError(
                400,
                "invalid_request_error",
                f"the request is too large: {exc.size} bytes as the bus carries it, over its "
                f"{exc.max_payload}-byte limit for one message; its largest part is {param} "
                f"({size} bytes)",
                param,
                "request_too_large",
            ) from exc
        return await self._next_event(self.settings.accept_timeout)

    def _close_attempt(self) -> None:
        """Stop routing events to the current attempt, and its mailbox's timer with it."""
        self.inbox.close(self._subject)
        if self._queue is not None:
            self._queue.close()

    async def _attempt_events(self) -> AsyncIterator[PromptLogprobs | Tokens | Finished]:
        """The accepted attempt's ``PromptLogprobs``, ``Tokens`` and ``Finished``, checked
        against the ``seq`` contract; raise :class:`_WorkerLost` when its worker cannot
        finish it."""
        expected = 1  # Accepted was 0
        heard_at = time.monotonic()
        while True:
            event = await self._next_event(_LIVENESS_CHECK_S)
            if event is None:
                if not self.workers.serving(self.worker_id, self._accepted_at):
                    raise _WorkerLost(f"worker {self.worker_id} stopped serving mid-request")
                if time.monotonic() - heard_at > self.settings.stall_timeout:
                    raise GenerationError(
                        504,
                        "timeout",
                        f"worker {self.worker_id} sent nothing for "
                        f"{self.settings.stall_timeout:g}s",
                    )
                continue
            heard_at = time.monotonic()
            match event:
                case PromptLogprobs() | Tokens() | Finished() | Failed() if event.seq != expected:
                    # Events lost on the way (a bus cut drops what was in flight): what
                    # came before the gap is the client's, so the request moves on from
                    # there, exactly, rather than failing.
                    raise _WorkerLost(
                        f"token stream lost events (got seq {event.seq}, expected {expected})"
                    )
                case PromptLogprobs():
                    expected += 1
                    yield event
                case Tokens(token_ids=[], logprobs=None):  # a keep-alive: it waits there
                    expected += 1
                case Tokens():
                    assert self._queue is not None
                    event, expected = with_queued_tokens(event, expected + 1, self._queue)
                    self._note_tokens(event.token_ids)
                    yield event
                case Finished():
                    self._note_tokens(event.token_ids)
                    self.finished = self._whole_request_usage(event)
                    yield self.finished
                    return
                case Failed(retryable=True):
                    raise _WorkerLost(
                        f"generation failed on worker {self.worker_id}: {event.message}",
                        handed_off=event.reason == RejectReason.DRAINING,
                    )
                case Failed():  # the request itself cannot run (or its deadline passed)
                    raise GenerationError.from_failed(event, self.worker_id)
                case _:
                    raise _unexpected(event)

    def _note_numerics(self, numerics: str) -> None:
        """The accepting worker's numerics: the stream's own until it has tokens; after
        that, a worker of other numerics continues it inexactly (placement chose it only
        because no worker like the first could take it), which is logged and counted."""
        if not self.streamed:
            self.numerics = numerics
        elif numerics != self.numerics:
            self.inexact_moves += 1
            log.warning(
                "request %s continues on a worker of other numerics (%s, began on %s): "
                "the rest of its output is not what the first worker would have produced",
                self.request.request_id,
                numerics or "unknown",
                self.numerics or "unknown",
            )

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
            replayed_output_tokens=done,
            numerics=self.numerics or None,
        )

    def _whole_request_usage(self, finished: Finished) -> Finished:
        """``finished`` with usage counted over the whole request: after a move the last
        worker counts the streamed tokens as prompt."""
        if self.attempts == 1:
            return finished
        usage = Usage(
            prompt_tokens=len(self.request.prompt_token_ids),
            completion_tokens=len(self.streamed),
            cached_tokens=finished.usage.cached_tokens,
        )
        return msgspec.structs.replace(finished, usage=usage)

    async def _cancel(self) -> None:
        """Cancel wherever the request may be: its worker, and the scheduler's queue."""
        subjects_ = [subjects.worker_cancel(self.worker_id)] if self.worker_id else []
        if self.queued:
            subjects_.append(subjects.SCHED_CANCEL)
            self.queued = False
        for subject in subjects_:
            with contextlib.suppress(Exception):
                await self.bus.publish(
                    subject,
                    Cancel(request_id=self.request.request_id),
                    context=trace.set_span_in_context(self._span),
                )

    async def _next_event(self, timeout: float) -> object | None:
        """The next event of the current attempt, or None after ``timeout`` seconds.

        The timeout ends the wait, not the task (no ``asyncio.timeout``): the task waiting
        here is also cancelled from outside when an HTTP client goes away
        (``asgi.ClientWatch``), and a timeout kept out of the cancellation machinery can
        never be mistaken for that, or swallow it.
        """
        assert self._queue is not None
        return await self._queue.get(timeout)

    # ------------------------------------------------------------------------- record
    def _note_tokens(self, token_ids: list[int]) -> None:
        self.streamed += token_ids
        if not token_ids:
            return
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        elif self._last_token_at is not None:
            self.token_gaps.append((now - self._last_token_at) / len(token_ids))
        self._last_token_at = now

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
            moves=self.moves,
            inexact_moves=self.inexact_moves,
            accept_s=None
            if self._first_accepted_at is None
            else self._first_accepted_at - self.started,
            max_tokens=self.request.sampling.max_tokens,
            n=self.n,
            timings=self.finished.timings if self.finished else None,
        )
        with contextlib.suppress(Exception):
            await self.bus.publish(  # in the request's trace, not a span of its own
                subjects.EVENTS_REQUEST,
                record,
                context=trace.set_span_in_context(self._span),
                traced=False,
            )
        return record

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


_LARGE_FIELDS = ("logit_bias", "allowed_token_ids", "bad_words_token_ids", "stop_token_ids")


def _largest_part(request: GenerateRequest) -> tuple[str, int]:
    """The field of ``request`` that takes the most bytes on the wire, as the client named
    it (the prompt, or a sampling field), and its size."""
    parts = {"prompt": request.prompt_token_ids}
    parts |= {name: getattr(request.sampling, name) for name in _LARGE_FIELDS}
    sizes = {name: len(msgspec.json.encode(value)) for name, value in parts.items()}
    name = max(sizes, key=sizes.__getitem__)
    return name, sizes[name]


def with_queued_tokens(event: Tokens, expected: int, queue: Mailbox) -> tuple[Tokens, int]:
    """``event`` as one event with the ``Tokens`` already queued behind it in ``queue``,
    and the ``seq`` expected after them (``expected``: the one after ``event``'s).

    A reader that fell behind (a gateway loop busy with many streams) then sends what came
    meanwhile as one chunk instead of a chunk a token, so it catches up instead of falling
    further behind, as vLLM's API server merges the outputs a slow reader has not taken
    yet; a reader that keeps up finds nothing queued and streams token by token. Only
    events in ``seq`` order merge (a gap is left for the reader to find), and only with
    logprobs alike; keep-alives between them are dropped."""
    token_ids, logprobs = event.token_ids, event.logprobs
    while isinstance(queued := queue.peek(), Tokens) and queued.seq == expected:
        if queued.token_ids and (queued.logprobs is None) != (logprobs is None):
            break
        queue.skip()
        expected += 1
        token_ids = token_ids + queued.token_ids
        if logprobs is not None and queued.logprobs is not None:
            logprobs = logprobs + queued.logprobs
    if expected - 1 == event.seq:
        return event, expected
    merged = msgspec.structs.replace(
        event, seq=expected - 1, token_ids=token_ids, logprobs=logprobs
    )
    return merged, expected


def _unexpected(event: object) -> GenerationError:
    if isinstance(event, BadMessage):
        return GenerationError(
            500, "api_error", f"a service could not decode our message: {event.error}"
        )
    return GenerationError(502, "api_error", f"unexpected {type(event).__name__} event")
