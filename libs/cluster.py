"""The cluster's workers as heartbeats show them, and the one liveness rule (pure: no I/O).

The scheduler places by it, the gateway migrates requests by it, telemetry reports it:
if their rules differed, a gateway could move requests off a worker the scheduler still
places on. So all three keep a :class:`ClusterView` fed with every ``WorkerStats``.

A worker is *alive* while its last heartbeat is at most :data:`MISSED_HEARTBEATS` of its
own heartbeat intervals old; it *serves* while it is alive and not ``failed`` (a failed
worker still heartbeats, to say so, but holds nothing); a dead worker is forgotten
:data:`FORGET_AFTER_S` seconds after it died.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from lamina.schemas.v1.stats import WorkerState, WorkerStats

MISSED_HEARTBEATS = 3
"""A worker is dead after this many of its heartbeat intervals without a heartbeat."""
FORGET_AFTER_S = 60.0
"""A dead worker is dropped this many seconds after it was declared dead."""
DEFAULT_HEARTBEAT_S = 0.5
"""A worker's heartbeat interval until its first heartbeat says otherwise (the worker's
``stats_interval`` default)."""

Clock = Callable[[], float]


@dataclass
class WorkerEntry:
    """A worker's latest heartbeat and when it arrived."""

    stats: WorkerStats
    last_seen: float
    """Monotonic seconds (the view's clock)."""
    last_seen_ms: int
    """Wall-clock milliseconds since the epoch."""

    def dead_for(self, now: float) -> float:
        """Seconds since the worker was declared dead; zero or less while it is alive."""
        return now - self.last_seen - MISSED_HEARTBEATS * self.stats.heartbeat_interval_s

    def alive(self, now: float) -> bool:
        return self.dead_for(now) <= 0


class ClusterView:
    """Every known worker's latest heartbeat, with liveness from an injectable clock."""

    def __init__(self, clock: Clock = time.monotonic, wall_clock: Clock = time.time) -> None:
        self.clock = clock
        self.wall_clock = wall_clock
        self.workers: dict[str, WorkerEntry] = {}

    def heartbeat(self, stats: WorkerStats) -> WorkerEntry:
        """Record ``stats`` as its worker's latest."""
        entry = WorkerEntry(stats, self.clock(), int(self.wall_clock() * 1000))
        self.workers[stats.worker_id] = entry
        return entry

    def serving(self, worker_id: str, since: float) -> bool:
        """Whether ``worker_id`` is alive and not failed. A worker never heard from is
        given one window from ``since`` (when it took a request) at the default interval:
        a live worker heartbeats that often, so silence that long is evidence enough."""
        entry = self.workers.get(worker_id)
        now = self.clock()
        if entry is None:
            return now - since <= MISSED_HEARTBEATS * DEFAULT_HEARTBEAT_S
        return entry.alive(now) and entry.stats.state != WorkerState.FAILED

    def live(self) -> list[WorkerEntry]:
        """The workers alive now, after forgetting the long-dead ones."""
        return [entry for entry, alive in self.snapshot() if alive]

    def snapshot(self) -> list[tuple[WorkerEntry, bool]]:
        """``(entry, alive)`` per worker, sorted by id, after forgetting long-dead ones."""
        now = self.clock()
        for worker_id, entry in list(self.workers.items()):
            if entry.dead_for(now) > FORGET_AFTER_S:
                del self.workers[worker_id]
        return [(self.workers[w], self.workers[w].alive(now)) for w in sorted(self.workers)]
