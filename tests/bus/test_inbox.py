"""The gateway's inbox on a real nats-server: events reach their request's queue; an
``Accepted`` for a request the gateway gave up on makes it cancel that request."""

from __future__ import annotations

import asyncio

from lamina.libs.bus import Bus
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import Cancel
from lamina.schemas.v1.generate import Accepted, Tokens
from lamina.services.gateway.inbox import Inbox


def test_late_acceptance_of_an_abandoned_request_is_cancelled(nats_url):
    async def main() -> tuple[object, Cancel]:
        bus = await Bus.connect(nats_url, "test-inbox")
        inbox = Inbox(bus)
        await inbox.start()
        cancels: asyncio.Queue[Cancel] = asyncio.Queue()

        async def on_cancel(cancel: Cancel, _msg) -> None:
            cancels.put_nowait(cancel)

        await bus.subscribe(subjects.worker_cancel("w-late"), Cancel, on_cancel)
        live: asyncio.Queue = asyncio.Queue()
        subject = inbox.open(live)
        await bus.publish(subject, Accepted(request_id="kept", worker_id="w-late"))
        delivered = await asyncio.wait_for(live.get(), 5)

        abandoned = inbox.open(asyncio.Queue())
        inbox.close(abandoned)  # e.g. the client hung up while the request was queued
        await bus.publish(abandoned, Accepted(request_id="orphan", worker_id="w-late"))
        # The inbox handles its messages in order: had the live request's Accepted made it
        # cancel, that cancel would have come first.
        cancel = await asyncio.wait_for(cancels.get(), 5)
        await bus.drain()
        return delivered, cancel

    delivered, cancel = asyncio.run(main())
    assert delivered == Accepted(request_id="kept", worker_id="w-late")
    assert cancel == Cancel(request_id="orphan")


def test_a_worker_still_streaming_to_a_closed_attempt_is_told_once_to_stop(nats_url):
    """A request moved off a worker that did not hear the cancel (it was cut off, and is
    back): its late tokens reach nobody, and the worker is cancelled again, once; not
    while a live attempt of the same request is on that worker."""

    async def main() -> list[Cancel]:
        bus = await Bus.connect(nats_url, "test-inbox-late")
        inbox = Inbox(bus)
        await inbox.start()
        cancels: list[Cancel] = []

        async def on_cancel(cancel: Cancel, _msg) -> None:
            cancels.append(cancel)

        await bus.subscribe(subjects.worker_cancel("w-cut"), Cancel, on_cancel)
        old, new = inbox.open(asyncio.Queue()), inbox.open(asyncio.Queue())
        inbox.accepted(old, "w-cut", "moved")
        inbox.close(old)  # moved elsewhere (new) while w-cut was unreachable
        inbox.accepted(new, "w-other", "moved")
        for seq in range(3):
            await bus.publish(old, Tokens(request_id="moved", seq=seq, token_ids=[7]))
        # The same request back on w-cut: its old attempt's tokens must not cancel it.
        again, back = inbox.open(asyncio.Queue()), inbox.open(asyncio.Queue())
        inbox.accepted(again, "w-cut", "twice")
        inbox.close(again)
        inbox.accepted(back, "w-cut", "twice")
        await bus.publish(again, Tokens(request_id="twice", seq=5, token_ids=[7]))
        await bus.flush()
        await asyncio.sleep(0.3)  # the inbox handles its messages, its cancels come back
        await bus.drain()
        return cancels

    assert asyncio.run(main()) == [Cancel(request_id="moved")]
