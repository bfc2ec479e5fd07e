"""The gateway's inbox on a real nats-server: events reach their request's queue; an
``Accepted`` for a request the gateway gave up on makes it cancel that request."""

from __future__ import annotations

import asyncio

from lamina.libs.bus import Bus
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import Cancel
from lamina.schemas.v1.generate import Accepted
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
