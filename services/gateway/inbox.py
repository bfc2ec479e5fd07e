"""Where a gateway's stream events and worker heartbeats arrive."""

from __future__ import annotations

import asyncio
import itertools

from nats.aio.msg import Msg

from lamina.libs.bounded import BoundedDict
from lamina.libs.bus import Bus
from lamina.libs.cluster import ClusterView
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import Cancel
from lamina.schemas.v1.errors import BadMessage
from lamina.schemas.v1.generate import Accepted, StreamEvent
from lamina.schemas.v1.stats import WorkerStats


class Undeliverable:
    """Queued for a submission that reached no subscriber (no scheduler is running, or the
    worker it was forwarded to is gone): NATS's "no responders" status."""


ABANDONED_TRACKED = 4096
"""Closed attempts remembered, to stop a worker that still streams to one."""


class Inbox:
    """This gateway's reply subjects, ``<inbox>.<n>`` with a fresh ``n`` per submission
    (late events of an abandoned attempt land nowhere), one subscription for all; and the
    workers' heartbeats, so a request on a dead worker fails (or moves) in seconds
    rather than after ``stall_timeout``.

    A worker that streams to a closed attempt is told to stop: the cancel sent when the
    request moved away from it may never have reached it (it was cut off, and is back),
    and it would otherwise generate to ``max_tokens`` for nobody."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.prefix = bus.inbox()
        self._queues: dict[str, asyncio.Queue] = {}
        self._accepted: dict[str, tuple[str, str]] = {}
        """Open reply subject key -> (worker, request id) of the attempt it accepted."""
        self._abandoned: BoundedDict[str, tuple[str, str]] = BoundedDict(ABANDONED_TRACKED)
        """The same, for attempts closed since."""
        self._keys = itertools.count()
        self.cluster = ClusterView()

    async def start(self) -> None:
        # Producers (workers) trace their publishes; a CONSUMER span per token is noise.
        await self.bus.subscribe(
            f"{self.prefix}.*",
            StreamEvent | BadMessage,
            self._route,
            traced=False,
            no_responders=self._undeliverable,
        )
        await self.bus.subscribe(
            subjects.WORKER_STATS_ALL, WorkerStats, self._on_stats, traced=False
        )

    async def _on_stats(self, stats: WorkerStats, msg: Msg) -> None:
        if stats.worker_id == subjects.sender_worker(msg.subject):  # not one posing as another
            self.cluster.heartbeat(stats)

    def worker_serving(self, worker_id: str, since: float) -> bool:
        """Whether the worker holding a request (accepted at ``since``) still serves it:
        alive and not failed, by the cluster's one rule (``lamina.libs.cluster``)."""
        return self.cluster.serving(worker_id, since)

    def open(self, queue: asyncio.Queue) -> str:
        """A new reply subject whose events go to ``queue``."""
        key = str(next(self._keys))
        self._queues[key] = queue
        return f"{self.prefix}.{key}"

    def accepted(self, subject: str, worker_id: str, request_id: str) -> None:
        """The attempt on ``subject`` was accepted by ``worker_id``."""
        self._accepted[_key(subject)] = (worker_id, request_id)

    def close(self, subject: str) -> None:
        key = _key(subject)
        self._queues.pop(key, None)
        if (holder := self._accepted.pop(key, None)) is not None:
            self._abandoned[key] = holder

    def _queue_of(self, subject: str) -> asyncio.Queue | None:
        return self._queues.get(_key(subject))

    async def _undeliverable(self, msg: Msg) -> None:
        queue = self._queue_of(msg.subject)
        if queue is not None:
            queue.put_nowait(Undeliverable())

    async def _route(self, event: StreamEvent | BadMessage, msg: Msg) -> None:
        queue = self._queue_of(msg.subject)
        if queue is not None:
            queue.put_nowait(event)
        elif isinstance(event, Accepted):
            # Accepted after its request was given up (the client left while it waited,
            # or an earlier attempt that timed out): nobody reads its tokens, so stop it.
            await self._stop(event.worker_id, event.request_id)
        elif (holder := self._abandoned.pop(_key(msg.subject), None)) is not None:
            await self._stop(*holder)  # once: it stops, or it is gone

    async def _stop(self, worker_id: str, request_id: str) -> None:
        """Cancel ``request_id`` on ``worker_id``, unless a live attempt of the request is
        there again (a cancel names only the request)."""
        if (worker_id, request_id) not in self._accepted.values():
            await self.bus.publish(subjects.worker_cancel(worker_id), Cancel(request_id=request_id))


def _key(subject: str) -> str:
    """``<inbox>.<n>`` -> ``n``."""
    return subject.rsplit(".", 1)[-1]
