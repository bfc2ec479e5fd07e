"""The gateway's inbox on a real nats-server: an attempt's events reach its request only
from the worker that accepted it, for its request, and everything else is refused and
counted; an ``Accepted`` for a request the gateway gave up on makes it cancel that
request, and a worker still streaming to a closed attempt is told once to stop."""

from __future__ import annotations

import asyncio

from lamina.libs.bus import Bus
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import Cancel
from lamina.schemas.v1.generate import (
    Accepted,
    Failed,
    Queued,
    Rejected,
    RejectReason,
    StreamBatch,
    StreamedEvent,
    Tokens,
)
from lamina.services.gateway.inbox import Inbox


async def _inbox(nats_url: str, name: str) -> tuple[Bus, Inbox, list[Cancel]]:
    bus = await Bus.connect(nats_url, name)
    inbox = Inbox(bus)
    await inbox.start()
    cancels: list[Cancel] = []

    async def on_cancel(cancel: Cancel, msg) -> None:
        cancels.append((msg.subject.split(".")[-2], cancel))

    await bus.subscribe(subjects.worker_cancel("*"), Cancel, on_cancel)
    await bus.flush()
    return bus, inbox, cancels


async def _settle(bus: Bus) -> None:
    """Until the inbox has handled what was published (and its cancels came back)."""
    await bus.flush()
    await asyncio.sleep(0.3)


def failed(request_id: str, seq: int = 1) -> Failed:
    return Failed(request_id=request_id, seq=seq, message="x", retryable=False, tokens_sent=False)


def test_only_the_accepting_worker_speaks_for_an_attempt(nats_url):
    async def main() -> tuple[list, int, list]:
        bus, inbox, cancels = await _inbox(nats_url, "test-inbox-forged")
        events: asyncio.Queue = asyncio.Queue()
        attempt = inbox.open(events, "mine")
        by_a, by_b = (subjects.worker_stream(attempt, w) for w in ("w-a", "w-b"))
        forged = [
            (attempt, Tokens(request_id="mine", seq=1, token_ids=[1])),  # scheduler's subject
            (by_b, Accepted(request_id="mine", worker_id="w-a")),  # naming another worker
            (by_a, Tokens(request_id="mine", seq=1, token_ids=[1])),  # before its Accepted
        ]
        believed = [
            (attempt, Queued(request_id="mine", position=0)),
            (by_a, Accepted(request_id="mine", worker_id="w-a")),
        ]
        forged_after = [
            (by_b, failed("mine")),  # not the accepting worker
            (by_b, Accepted(request_id="mine", worker_id="w-b")),
            (by_a, failed("other")),  # not this attempt's request
            (attempt, Rejected(request_id="mine", reason=RejectReason.NO_WORKER, message="x")),
            (subjects.worker_stream(f"{inbox.prefix}.guessed", "w-b"), failed("mine")),
        ]
        for subject, event in [*forged, *believed, *forged_after]:
            await bus.publish(subject, event)
        await bus.publish(by_a, Tokens(request_id="mine", seq=1, token_ids=[7]))
        await _settle(bus)
        got = [events.get_nowait() for _ in range(events.qsize())]
        await bus.drain()
        return got, bus.refused, cancels

    got, refused, cancels = asyncio.run(main())
    assert got == [
        Queued(request_id="mine", position=0),
        Accepted(request_id="mine", worker_id="w-a"),
        Tokens(request_id="mine", seq=1, token_ids=[7]),
    ]
    assert refused == 8
    assert cancels == []  # nothing forged made the gateway cancel anything


def test_attempt_subjects_are_not_guessable(nats_url):
    async def main() -> list[str]:
        bus = await Bus.connect(nats_url, "test-inbox-random")
        inbox = Inbox(bus)
        opened = [inbox.open(asyncio.Queue(), f"r{i}") for i in range(3)]
        await bus.close()
        return opened

    opened = asyncio.run(main())
    keys = [subject.rsplit(".", 1)[-1] for subject in opened]
    assert len(set(keys)) == 3 and all(len(key) >= 20 for key in keys)


def test_late_acceptance_of_an_abandoned_request_is_cancelled(nats_url):
    async def main() -> list:
        bus, inbox, cancels = await _inbox(nats_url, "test-inbox-late-accept")
        abandoned = inbox.open(asyncio.Queue(), "orphan")
        inbox.close(abandoned)  # e.g. the client hung up while the request was queued
        stream = subjects.worker_stream(abandoned, "w-late")
        for _ in range(3):  # told once, however often it says so
            await bus.publish(stream, Accepted(request_id="orphan", worker_id="w-late"))
        # A worker cannot have another one cancelled by naming it.
        await bus.publish(stream, Accepted(request_id="orphan", worker_id="w-other"))
        await _settle(bus)
        await bus.drain()
        return cancels

    assert asyncio.run(main()) == [("w-late", Cancel(request_id="orphan"))]


def test_a_worker_still_streaming_to_a_closed_attempt_is_told_once_to_stop(nats_url):
    """A request moved off a worker that did not hear the cancel (it was cut off, and is
    back): its late tokens reach nobody, and the worker is cancelled again, once; not
    while a live attempt of the same request is on that worker."""

    async def main() -> list:
        bus, inbox, cancels = await _inbox(nats_url, "test-inbox-late")

        async def accepted(request_id: str, worker: str) -> str:
            subject = inbox.open(asyncio.Queue(), request_id)
            accept = Accepted(request_id=request_id, worker_id=worker)
            await bus.publish(subjects.worker_stream(subject, worker), accept)
            return subject

        old = await accepted("moved", "w-cut")
        await _settle(bus)
        inbox.close(old)  # moved elsewhere while w-cut was unreachable
        await accepted("moved", "w-other")
        for seq in range(1, 4):
            tokens = Tokens(request_id="moved", seq=seq, token_ids=[7])
            await bus.publish(subjects.worker_stream(old, "w-cut"), tokens)
        # The same request back on w-cut: its old attempt's tokens must not cancel it.
        again = await accepted("twice", "w-cut")
        await _settle(bus)
        inbox.close(again)
        await accepted("twice", "w-cut")
        await _settle(bus)
        tokens = Tokens(request_id="twice", seq=5, token_ids=[7])
        await bus.publish(subjects.worker_stream(again, "w-cut"), tokens)
        await _settle(bus)
        await bus.drain()
        return cancels

    assert asyncio.run(main()) == [("w-cut", Cancel(request_id="moved"))]


def test_a_batch_is_judged_event_by_event_as_if_each_came_on_its_own_subject(nats_url):
    """A ``StreamBatch`` from worker w-a delivers, in order, the events of the attempts
    w-a accepted (an ``Accepted`` among them opens a stream, as on its own subject); its
    events for an attempt another worker holds, for the wrong request or for an attempt
    never opened are refused one by one; a batch on a subject that is not the batch
    subject of a worker is refused whole; a late event in a batch stops its worker."""

    async def main() -> tuple[list, list, int, list]:
        bus, inbox, cancels = await _inbox(nats_url, "test-inbox-batch")
        mine, theirs = asyncio.Queue(), asyncio.Queue()
        a, b = inbox.open(mine, "mine"), inbox.open(theirs, "theirs")
        closed = inbox.open(asyncio.Queue(), "gone")
        key = {s: s.rsplit(".", 1)[-1] for s in (a, b, closed)}
        await bus.publish(
            subjects.worker_stream(b, "w-b"), Accepted(request_id="theirs", worker_id="w-b")
        )
        await bus.publish(
            subjects.worker_stream(closed, "w-a"), Accepted(request_id="gone", worker_id="w-a")
        )
        await _settle(bus)
        inbox.close(closed)
        batch = StreamBatch(
            events=[
                StreamedEvent(key[a], Accepted(request_id="mine", worker_id="w-a")),
                StreamedEvent(key[b], Tokens(request_id="theirs", seq=1, token_ids=[9])),
                StreamedEvent(key[a], Tokens(request_id="mine", seq=1, token_ids=[1, 2])),
                StreamedEvent(key[a], failed("other", seq=2)),
                StreamedEvent("never-opened", Tokens(request_id="mine", seq=2, token_ids=[3])),
                StreamedEvent(key[closed], Tokens(request_id="gone", seq=1, token_ids=[4])),
                StreamedEvent(key[a], Tokens(request_id="mine", seq=2, token_ids=[3])),
            ]
        )
        await bus.publish(subjects.stream_batch(inbox.prefix, "w-a"), batch)
        await bus.publish(f"{inbox.prefix}.{subjects.STREAM_BATCH}", batch)  # no worker's
        await bus.publish(subjects.worker_stream(a, "w-a"), batch)  # an attempt's subject
        await _settle(bus)
        got = [mine.get_nowait() for _ in range(mine.qsize())]
        others = [theirs.get_nowait() for _ in range(theirs.qsize())]
        await bus.drain()
        return got, others, bus.refused, cancels

    got, others, refused, cancels = asyncio.run(main())
    assert got == [
        Accepted(request_id="mine", worker_id="w-a"),
        Tokens(request_id="mine", seq=1, token_ids=[1, 2]),
        Tokens(request_id="mine", seq=2, token_ids=[3]),
    ]
    assert others == [Accepted(request_id="theirs", worker_id="w-b")]
    assert refused == 3 + 2  # three events of the batch; two batches whole
    assert cancels == [("w-a", Cancel(request_id="gone"))]
