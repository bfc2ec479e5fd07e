"""Where a gateway's stream events arrive, and who may send them.

Each submission (each attempt of a request) gets a reply subject of its own,
``<inbox>.<attempt>``, with ``attempt`` drawn at random: a worker that served one of this
gateway's requests knows the inbox, not the subjects of the others. The scheduler answers
on that subject (``Queued``, ``Rejected``) and forwards the request with
``<inbox>.<attempt>.<worker id>`` (``subjects.worker_stream``) as its reply subject, which
the bus lets only that worker publish on. An event is believed only when it is for the
attempt's request, from the scheduler before any worker accepted, or from the worker
whose ``Accepted`` (naming itself, on its own subject) opened the stream; everything else
is refused and counted (``Bus.refused``, in ``BusHealth``). The ``seq`` order within the
believed stream is the request's to check (``RemoteRequest``).

A worker may instead send one ``StreamBatch`` for several of this gateway's attempts, on
``<inbox>.batch.<worker id>`` (``subjects.stream_batch``): each of its events is judged
exactly as if it had come on ``<inbox>.<attempt>.<worker id>``, so a batch lets a worker
say nothing it could not say one event at a time.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from nats.aio.msg import Msg

from lamina.libs.bounded import BoundedDict
from lamina.libs.bus import Bus
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import Cancel
from lamina.schemas.v1.errors import BadMessage
from lamina.schemas.v1.generate import Accepted, Queued, Rejected, StreamBatch, StreamEvent

log = logging.getLogger("lamina.gateway")


class Undeliverable:
    """Queued for a submission that reached no subscriber (no scheduler is running, or the
    worker it was forwarded to is gone): NATS's "no responders" status."""


CLOSED_TRACKED = 4096
"""Closed attempts remembered, to tell a late event (stop its worker) from a forged one."""

ATTEMPT_KEY_BYTES = 16
"""Randomness in an attempt's subject: 128 bits, never guessed."""


class EventSink(Protocol):
    """Where an attempt's believed events go (a :class:`~.mailbox.Mailbox`)."""

    def put_nowait(self, item: object) -> None: ...


@dataclass(slots=True)
class _Attempt:
    queue: EventSink
    request_id: str
    worker_id: str | None = None
    """The worker that accepted it (None until one did)."""
    refused: int = 0


class Inbox:
    """This gateway's reply subjects, one subscription for all.

    A worker that streams to a closed attempt is told to stop: the cancel sent when the
    request moved away from it may never have reached it (it was cut off, and is back),
    and it would otherwise generate to ``max_tokens`` for nobody."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.prefix = bus.inbox()
        self._attempts: dict[str, _Attempt] = {}
        self._closed: BoundedDict[str, tuple[str, str] | None] = BoundedDict(CLOSED_TRACKED)
        """Closed attempt key -> (the worker that accepted it, or "" if none had, its
        request id), until a worker was told to stop for it (then None: once per attempt,
        however many late events come)."""
        self._held: Counter[tuple[str, str]] = Counter()
        """(worker, request id) of every open attempt a worker accepted."""

    async def start(self) -> None:
        # Producers (workers) trace their publishes; a CONSUMER span per token is noise.
        await self.bus.subscribe(
            f"{self.prefix}.>",
            StreamEvent | StreamBatch | BadMessage,
            self._route,
            traced=False,
            no_responders=self._undeliverable,
        )

    def open(self, queue: EventSink, request_id: str) -> str:
        """A new reply subject for an attempt of ``request_id``, whose believed events go to
        ``queue``."""
        key = secrets.token_urlsafe(ATTEMPT_KEY_BYTES)
        self._attempts[key] = _Attempt(queue, request_id)
        return f"{self.prefix}.{key}"

    def close(self, subject: str) -> None:
        key = subject.rsplit(".", 1)[-1]
        attempt = self._attempts.pop(key, None)
        if attempt is not None:
            held = (attempt.worker_id, attempt.request_id)
            if attempt.worker_id is not None:
                self._held[held] -= 1
                if not self._held[held]:
                    del self._held[held]
            self._closed[key] = (attempt.worker_id or "", attempt.request_id)

    def _parse(self, subject: str) -> tuple[str, str | None]:
        """``<inbox>.<attempt>[.<worker>]`` -> (attempt key, the worker whose stream subject
        it is; None for the attempt's own subject, the scheduler's)."""
        key, _, worker = subject[len(self.prefix) + 1 :].partition(".")
        return key, worker or None

    async def _undeliverable(self, msg: Msg) -> None:
        attempt = self._attempts.get(self._parse(msg.subject)[0])
        if attempt is not None and attempt.worker_id is None:
            attempt.queue.put_nowait(Undeliverable())

    async def _route(self, event: StreamEvent | StreamBatch | BadMessage, msg: Msg) -> None:
        key, sender = self._parse(msg.subject)
        if not isinstance(event, StreamBatch):
            if not self._deliver(key, sender, event):
                await self._late(key, sender, event)
        elif key == subjects.STREAM_BATCH and sender is not None:  # only a worker batches
            for item in event.events:
                if not self._deliver(item.attempt, sender, item.event):
                    await self._late(item.attempt, sender, item.event)
        else:
            self.bus.refused += 1

    def _deliver(self, key: str, sender: str | None, event: StreamEvent | BadMessage) -> bool:
        """``event`` on attempt ``key``'s subject of ``sender`` (None: the scheduler's);
        False if no attempt of that key is open (:meth:`_late`'s then)."""
        attempt = self._attempts.get(key)
        if attempt is None:
            return False
        if _believed(attempt, event, sender):
            if isinstance(event, Accepted):
                attempt.worker_id = sender
                self._held[(sender, attempt.request_id)] += 1
            attempt.queue.put_nowait(event)
        else:
            self._refuse(attempt, event, sender)
        return True

    def _refuse(self, attempt: _Attempt, event: object, sender: str | None) -> None:
        self.bus.refused += 1
        attempt.refused += 1
        if attempt.refused == 1:  # once per attempt: a forger must not flood the log
            log.warning(
                "refused %s for request %s from %s (the attempt is %s's)",
                type(event).__name__,
                attempt.request_id,
                f"worker {sender}" if sender else "the scheduler's subject",
                attempt.worker_id or "not accepted yet",
            )

    async def _late(self, key: str, sender: str | None, event: object) -> None:
        """An event for an attempt that is not open: a closed one's worker is stopped
        (once); one this gateway never opened (or long forgot) is refused."""
        if key not in self._closed:
            self.bus.refused += 1
            return
        holder = self._closed[key]
        if holder is None or sender is None:
            return
        worker, request_id = holder
        if not worker and isinstance(event, Accepted) and event.worker_id == sender:
            # Accepted after its request was given up (the client left while it waited,
            # or an earlier attempt that timed out): nobody reads its tokens, so stop it.
            worker = sender
        if sender == worker:
            self._closed[key] = None  # once: it stops, or it is gone
            await self._stop(worker, request_id)

    async def _stop(self, worker_id: str, request_id: str) -> None:
        """Cancel ``request_id`` on ``worker_id``, unless a live attempt of the request is
        there again (a cancel names only the request)."""
        if (worker_id, request_id) not in self._held:
            await self.bus.publish(subjects.worker_cancel(worker_id), Cancel(request_id=request_id))


def _believed(attempt: _Attempt, event: StreamEvent | BadMessage, sender: str | None) -> bool:
    """Whether ``event``, on the subject of ``sender`` (None: the scheduler's), may be part
    of ``attempt``'s stream."""
    if isinstance(event, BadMessage):  # a service could not decode our submission
        return attempt.worker_id is None or sender == attempt.worker_id
    if event.request_id != attempt.request_id:
        return False
    if attempt.worker_id is not None:  # the stream is the accepting worker's alone
        return sender == attempt.worker_id
    if sender is None:
        return isinstance(event, Queued | Rejected)
    if isinstance(event, Accepted):
        return event.worker_id == sender
    return isinstance(event, Rejected)
