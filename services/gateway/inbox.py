"""Where a gateway's stream events and worker heartbeats arrive."""

from __future__ import annotations

import asyncio
import itertools
import time

from nats.aio.msg import Msg

from lamina.libs.bus import Bus
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import Cancel
from lamina.schemas.v1.errors import BadMessage
from lamina.schemas.v1.generate import Accepted, StreamEvent
from lamina.schemas.v1.stats import WorkerStats
from lamina.services.scheduler.registry import MISSED_HEARTBEATS

_DEFAULT_HEARTBEAT_S = 0.5  # WorkerConfig.stats_interval's default


class Inbox:
    """This gateway's reply subjects, ``<inbox>.<n>`` with a fresh ``n`` per submission
    (late events of an abandoned attempt land nowhere), one subscription for all; and the
    workers' heartbeats, so a request on a dead worker fails (or moves) in seconds
    rather than after ``stall_timeout``."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.prefix = bus.inbox()
        self._queues: dict[str, asyncio.Queue] = {}
        self._keys = itertools.count()
        self._heartbeats: dict[str, tuple[float, float]] = {}  # id -> (last seen, interval)

    async def start(self) -> None:
        # Producers (workers) trace their publishes; a CONSUMER span per token is noise.
        await self.bus.subscribe(
            f"{self.prefix}.*", StreamEvent | BadMessage, self._route, traced=False
        )
        await self.bus.subscribe(
            subjects.WORKER_STATS_ALL, WorkerStats, self._on_stats, traced=False
        )

    async def _on_stats(self, stats: WorkerStats, msg: Msg) -> None:
        self._heartbeats[stats.worker_id] = (time.monotonic(), stats.heartbeat_interval_s)

    def worker_alive(self, worker_id: str | None, since: float) -> bool:
        """False once a worker missed 3 heartbeats. A worker never heard from counts from
        ``since`` (when it accepted the request) with the default interval: a live worker
        heartbeats every half second, so silence that long is evidence enough."""
        last, interval = self._heartbeats.get(worker_id or "", (since, _DEFAULT_HEARTBEAT_S))
        return time.monotonic() - last <= MISSED_HEARTBEATS * interval

    def open(self, queue: asyncio.Queue) -> str:
        """A new reply subject whose events go to ``queue``."""
        key = str(next(self._keys))
        self._queues[key] = queue
        return f"{self.prefix}.{key}"

    def close(self, subject: str) -> None:
        self._queues.pop(subject.rsplit(".", 1)[-1], None)

    async def _route(self, event: StreamEvent | BadMessage, msg: Msg) -> None:
        queue = self._queues.get(msg.subject.rsplit(".", 1)[-1])
        if queue is not None:
            queue.put_nowait(event)
        elif isinstance(event, Accepted):
            # Accepted after its request was given up (the client left while it waited,
            # or an earlier attempt that timed out): nobody reads its tokens, so stop it.
            await self.bus.publish(
                subjects.worker_cancel(event.worker_id), Cancel(request_id=event.request_id)
            )
