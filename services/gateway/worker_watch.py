"""The workers as a gateway hears their heartbeats (``WorkerStats``): whether the one
holding a request still serves it, so that a request on a dead worker fails (or moves) in
seconds rather than after ``stall_timeout``."""

from __future__ import annotations

from nats.aio.msg import Msg

from lamina.libs.bus import Bus
from lamina.libs.cluster import ClusterView
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.stats import WorkerStats


class WorkerWatch:
    """Every worker's latest heartbeat, by the cluster's one liveness rule
    (``lamina.libs.cluster``)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.cluster = ClusterView()

    async def start(self) -> None:
        await self.bus.subscribe(
            subjects.WORKER_STATS_ALL, WorkerStats, self._on_stats, traced=False
        )

    async def _on_stats(self, stats: WorkerStats, msg: Msg) -> None:
        if stats.worker_id == subjects.sender_worker(msg.subject):  # not one posing as another
            self.cluster.heartbeat(stats)
        else:
            self.bus.refused += 1

    def serving(self, worker_id: str, since: float) -> bool:
        """Whether the worker holding a request (accepted at ``since``) still serves it:
        alive and not failed."""
        return self.cluster.serving(worker_id, since)
