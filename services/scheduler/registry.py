"""The worker registry, kept from heartbeats alone (pure: no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from lamina.schemas.v1.stats import WorkerStats

#: A worker is dead after this many heartbeat intervals without one.
MISSED_HEARTBEATS = 3


@dataclass
class WorkerEntry:
    stats: WorkerStats
    last_seen: float  # monotonic seconds
    pending: int = 0
    """Requests placed here since its last heartbeat (not yet in its stats)."""
    pending_tokens: int = 0

    def alive(self, now: float) -> bool:
        return now - self.last_seen <= MISSED_HEARTBEATS * self.stats.heartbeat_interval_s


class Registry:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerEntry] = {}

    def heartbeat(self, stats: WorkerStats, now: float) -> None:
        entry = self.workers.get(stats.worker_id)
        if entry is None:
            self.workers[stats.worker_id] = WorkerEntry(stats, now)
        else:
            entry.stats, entry.last_seen = stats, now
            entry.pending = entry.pending_tokens = 0

    def live(self, now: float) -> list[WorkerEntry]:
        return [w for w in self.workers.values() if w.alive(now)]

    def forget_dead(self, now: float, grace: float = 60.0) -> None:
        """Drop workers silent for ``grace`` seconds beyond being declared dead."""
        for worker_id, entry in list(self.workers.items()):
            if now - entry.last_seen > grace + MISSED_HEARTBEATS * entry.stats.heartbeat_interval_s:
                del self.workers[worker_id]
