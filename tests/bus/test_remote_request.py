"""A gateway ``RemoteRequest`` on a real nats-server against a scripted peer that answers
``sched.submit`` as a scheduler and its workers would: retries, moves, the ``seq``
contract, and the outcome each way of ending leaves in the ``RequestRecord``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from lamina.libs.bus import Bus
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import Cancel
from lamina.schemas.v1.generate import (
    Accepted,
    Failed,
    Finished,
    FinishReason,
    GenerateRequest,
    Queued,
    Rejected,
    RejectReason,
    Sampling,
    Tokens,
    Usage,
)
from lamina.schemas.v1.records import Outcome, RequestRecord
from lamina.services.gateway.errors import GenerationError
from lamina.services.gateway.inbox import Inbox
from lamina.services.gateway.remote_request import RemoteRequest, RetryPolicy
from lamina.services.gateway.worker_watch import WorkerWatch

PROMPT = [5, 6, 7]
SETTINGS = RetryPolicy(accept_timeout=1.0, max_attempts=3, retry_backoff=0.01)
Script = Callable[[GenerateRequest], list[object]]


def accept(worker: str, numerics: str = "") -> Script:
    return lambda r: [Accepted(request_id=r.request_id, worker_id=worker, numerics=numerics)]


def then(*scripts: Script) -> Script:
    return lambda r: [event for script in scripts for event in script(r)]


def tokens(seq: int, *ids: int) -> Script:
    return lambda r: [Tokens(request_id=r.request_id, seq=seq, token_ids=list(ids))]


def finished(seq: int, completion: int) -> Script:
    def events(r: GenerateRequest) -> list[object]:
        usage = Usage(prompt_tokens=len(r.prompt_token_ids), completion_tokens=completion)
        return [
            Finished(
                request_id=r.request_id, seq=seq, finish_reason=FinishReason.LENGTH, usage=usage
            )
        ]

    return events


def failed(seq: int, retryable: bool) -> Script:
    return lambda r: [
        Failed(
            request_id=r.request_id,
            seq=seq,
            message="the engine thread died",
            retryable=retryable,
            tokens_sent=seq > 1,
        )
    ]


def queued() -> Script:
    return lambda r: [Queued(request_id=r.request_id, position=0)]


def overloaded(worker_id: str = "") -> Script:
    """The scheduler's queue is full, or (``worker_id``) a worker placed on a stale view
    holds its most."""
    return lambda r: [
        Rejected(
            request_id=r.request_id,
            reason=RejectReason.OVERLOADED,
            message="queue full",
            retryable=True,
            retry_after_s=2.5,
            worker_id=worker_id,
        )
    ]


def rejected(retryable: bool) -> Script:
    return lambda r: [
        Rejected(
            request_id=r.request_id,
            reason=RejectReason.DRAINING if retryable else RejectReason.INVALID_REQUEST,
            message="no",
            retryable=retryable,
            param=None if retryable else "prompt",
        )
    ]


@dataclass
class Run:
    events: list[Tokens | Finished] = field(default_factory=list)
    error: GenerationError | None = None
    submitted: list[GenerateRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    record: RequestRecord | None = None


def run(
    nats_url: str, scripts: list[Script], max_tokens: int = 10, hang_up_when_queued: bool = False
) -> Run:
    """One request through ``RemoteRequest``; the n-th submission gets ``scripts[n]``.
    ``hang_up_when_queued``: the client goes away once the request is queued."""

    async def main() -> Run:
        result = Run()
        peer = await Bus.connect(nats_url, "test-generation-peer")
        records: asyncio.Queue[RequestRecord] = asyncio.Queue()

        async def on_submit(request: GenerateRequest, msg) -> None:
            result.submitted.append(request)
            subject = msg.reply  # the scheduler's, until a worker accepts on its own
            for event in scripts[len(result.submitted) - 1](request):
                if isinstance(event, Accepted):
                    subject = subjects.worker_stream(msg.reply, event.worker_id)
                await peer.publish(subject, event)

        async def on_cancel(cancel: Cancel, msg) -> None:
            result.cancelled.append(msg.subject.split(".")[-2])

        async def on_queue_cancel(cancel: Cancel, msg) -> None:
            result.cancelled.append("queue")

        async def on_record(record: RequestRecord, msg) -> None:
            records.put_nowait(record)

        await peer.subscribe(subjects.SCHED_SUBMIT, GenerateRequest, on_submit)
        await peer.subscribe(subjects.worker_cancel("*"), Cancel, on_cancel)
        await peer.subscribe(subjects.SCHED_CANCEL, Cancel, on_queue_cancel)
        await peer.subscribe(subjects.EVENTS_REQUEST, RequestRecord, on_record)
        await peer.flush()
        bus = await Bus.connect(nats_url, "test-generation-gateway")
        inbox, workers = Inbox(bus), WorkerWatch(bus)
        await inbox.start()
        await workers.start()
        request = GenerateRequest(
            request_id="r1",
            model="tiny",
            prompt_token_ids=PROMPT,
            sampling=Sampling(max_tokens=max_tokens, min_tokens=3),
        )
        try:
            async with RemoteRequest(bus, inbox, workers, request, SETTINGS) as remote:
                if hang_up_when_queued:  # as a disconnect cancels the HTTP handler
                    started = asyncio.create_task(remote.start())
                    while not remote.queued:
                        await asyncio.sleep(0.01)
                    started.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await started
                else:
                    await remote.start()
                    async for event in remote.stream():
                        result.events.append(event)
        except GenerationError as exc:
            result.error = exc
        result.record = await asyncio.wait_for(records.get(), 5)
        await bus.drain()
        await peer.flush()  # the gateway's cancels have arrived
        await peer.drain()
        return result

    return asyncio.run(main())


def test_a_retryable_failure_moves_the_request_and_the_stream_continues(nats_url):
    result = run(
        nats_url,
        [
            then(accept("w1"), tokens(1, 40, 41), failed(2, retryable=True)),
            then(accept("w2"), tokens(1, 42), finished(2, completion=1)),
        ],
    )
    assert result.error is None
    assert [e.token_ids for e in result.events] == [[40, 41], [42], []]
    first, moved = result.submitted
    assert (first.attempt, moved.attempt) == (0, 1)
    # The move replays the prompt plus what was streamed, for what is left.
    assert moved.prompt_token_ids == [*PROMPT, 40, 41]
    assert (moved.sampling.max_tokens, moved.sampling.min_tokens) == (8, 1)
    # Usage counts the whole request, not the last worker's share.
    assert result.events[-1].usage == Usage(prompt_tokens=3, completion_tokens=3)
    assert "w1" in result.cancelled and "w2" not in result.cancelled
    record = result.record
    assert (record.outcome, record.worker_id, record.attempts) == (Outcome.FINISHED, "w2", 2)
    assert (record.prompt_tokens, record.completion_tokens) == (3, 3)


INT8, FP32 = "cpu/float32/int8/auto", "cpu/float32/float32/auto"


@pytest.mark.parametrize(("second", "inexact"), [(INT8, 0), (FP32, 1)])
def test_a_move_asks_for_the_first_workers_numerics_and_counts_a_move_without(
    nats_url, second, inexact
):
    """A moved stream names the numerics it began with (placement prefers workers like
    that); continued on a worker of other numerics, the move is counted as inexact."""
    result = run(
        nats_url,
        [
            then(accept("w1", INT8), tokens(1, 40), failed(2, retryable=True)),
            then(accept("w2", second), tokens(1, 42), finished(2, completion=1)),
        ],
    )
    assert result.error is None
    first, moved = result.submitted
    assert (first.numerics, moved.numerics) == (None, INT8)
    assert (result.record.moves, result.record.inexact_moves) == (1, inexact)


def test_a_retry_before_any_token_takes_the_accepting_workers_numerics(nats_url):
    result = run(
        nats_url,
        [
            then(accept("w1", INT8), failed(1, retryable=True)),
            then(accept("w2", FP32), tokens(1, 42), finished(2, completion=1)),
        ],
    )
    assert result.error is None and result.record.inexact_moves == 0
    assert result.submitted[1].numerics is None  # nothing streamed: nothing to continue


def test_retryable_rejections_are_retried_then_reported(nats_url):
    result = run(nats_url, [rejected(retryable=True)] * 3)
    assert result.error.status == 503 and result.error.code == "draining"
    assert len(result.submitted) == 3
    assert (result.record.outcome, result.record.attempts) == (Outcome.REJECTED, 3)
    assert result.record.worker_id is None


def test_a_final_rejection_is_not_retried(nats_url):
    result = run(nats_url, [rejected(retryable=False)])
    assert (result.error.status, result.error.param) == (400, "prompt")
    assert len(result.submitted) == 1
    assert result.record.outcome == Outcome.REJECTED


def test_a_request_that_fails_on_every_worker_fails_after_max_attempts(nats_url):
    lost = then(accept("w1"), tokens(1, 40), failed(2, retryable=True))
    result = run(nats_url, [lost] * 3)
    assert result.error.status == 503 and "the engine thread died" in result.error.message
    assert len(result.submitted) == 3
    # Each move continued from everything streamed before it.
    assert [len(r.prompt_token_ids) for r in result.submitted] == [3, 4, 5]
    assert (result.record.outcome, result.record.attempts) == (Outcome.FAILED, 3)
    assert result.record.completion_tokens == 0  # nothing finished, so no usage


def test_an_accepted_request_that_breaks_fails(nats_url):
    result = run(nats_url, [then(accept("w1"), tokens(1, 40), failed(2, retryable=False))])
    assert result.error.status == 500
    assert len(result.submitted) == 1
    assert (result.record.outcome, result.record.worker_id) == (Outcome.FAILED, "w1")


def test_a_gap_in_the_token_stream_moves_the_request_on_from_before_it(nats_url):
    """Events lost in flight (seq 2 never came): what arrived before the gap stands, and
    the request moves on from there, as after a lost worker."""
    result = run(
        nats_url,
        [
            then(accept("w1"), tokens(1, 40), tokens(3, 99)),
            then(accept("w2"), tokens(1, 41), finished(2, completion=1)),
        ],
    )
    assert result.error is None
    assert [e.token_ids for e in result.events] == [[40], [41], []]
    moved = result.submitted[1]
    assert moved.prompt_token_ids == [*PROMPT, 40] and moved.replayed_output_tokens == 1
    assert "w1" in result.cancelled


def test_a_move_that_finds_no_worker_is_a_failure_not_a_rejection(nats_url):
    lost = then(accept("w1"), tokens(1, 40), failed(2, retryable=True))
    result = run(nats_url, [lost, rejected(retryable=True), rejected(retryable=True)])
    assert result.error.code == "draining"
    assert [e.token_ids for e in result.events] == [[40]]  # the client saw output
    assert (result.record.outcome, result.record.attempts) == (Outcome.FAILED, 3)


def test_a_queued_request_waits_for_its_worker_without_resubmitting(nats_url):
    result = run(nats_url, [then(queued(), accept("w1"), tokens(1, 40), finished(2, 1))])
    assert result.error is None and len(result.submitted) == 1
    assert (result.record.outcome, result.record.worker_id) == (Outcome.FINISHED, "w1")


def test_an_overloaded_cluster_is_not_retried_at_once_and_says_when(nats_url):
    result = run(nats_url, [overloaded()] * 3)
    assert len(result.submitted) == 1  # the client retries, after Retry-After
    assert (result.error.status, result.error.code) == (429, "overloaded")
    assert result.error.retry_after_s == 2.5
    assert result.record.outcome == Outcome.REJECTED


def test_a_workers_refusal_on_a_stale_view_is_submitted_again_not_told_the_client(nats_url):
    """A worker that holds its most refuses a request placed on a stale view; the
    scheduler would have queued it, and does once asked again."""
    served = then(accept("w2"), tokens(1, 40), finished(2, 1))
    result = run(nats_url, [overloaded("w1"), then(queued(), served)])
    assert result.error is None and len(result.submitted) == 2
    assert (result.record.outcome, result.record.worker_id) == (Outcome.FINISHED, "w2")
    # Within the attempts: then the client hears it, as from a scheduler.
    result = run(nats_url, [overloaded("w1")] * 3)
    assert len(result.submitted) == 3
    assert (result.error.status, result.error.retry_after_s) == (429, 2.5)


def test_a_client_that_hangs_up_while_queued_takes_the_request_out_of_the_queue(nats_url):
    result = run(nats_url, [queued()], hang_up_when_queued=True)
    assert result.cancelled == ["queue"]
    assert result.record.outcome == Outcome.CANCELLED


def test_with_no_scheduler_the_answer_is_a_fast_503_with_retry_after(nats_url):
    """NATS answers a submit nobody receives with a "no responders" status: retried with
    back-off, then a 503, without waiting out the accept timeout."""

    async def main() -> tuple[GenerationError, float, int]:
        bus = await Bus.connect(nats_url, "test-no-scheduler")
        inbox, workers = Inbox(bus), WorkerWatch(bus)
        await inbox.start()
        request = GenerateRequest(request_id="r-alone", model="tiny", prompt_token_ids=PROMPT)
        started = time.monotonic()
        slow_accept = RetryPolicy(accept_timeout=30.0, max_attempts=3, retry_backoff=0.01)
        try:
            async with RemoteRequest(bus, inbox, workers, request, slow_accept) as remote:
                with pytest.raises(GenerationError) as refused:
                    await remote.start()
            return refused.value, time.monotonic() - started, remote.attempts
        finally:
            await bus.drain()

    error, elapsed, attempts = asyncio.run(main())
    assert (error.status, error.retry_after_s, attempts) == (503, 1.0, 3)
    assert elapsed < 15  # far under one 30 s accept timeout


def test_a_keep_alive_counts_in_the_sequence_and_is_not_streamed(nats_url):
    result = run(
        nats_url, [then(accept("w1"), tokens(1), tokens(2, 40), tokens(3), finished(4, 1))]
    )
    assert result.error is None
    assert [e.token_ids for e in result.events] == [[40], []]
