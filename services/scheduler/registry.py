"""The scheduler's registry: the cluster view, plus what this replica placed on each worker
since its last heartbeat (pure: no I/O)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from lamina.libs.cluster import Clock, ClusterView
from lamina.schemas.v1.stats import WorkerStats


@dataclass
class Candidate:
    """A live worker as placement weighs it."""

    stats: WorkerStats
    pending: int = 0
    """Requests placed here since its last heartbeat (not yet in its stats)."""
    pending_tokens: int = 0
    """Their prompt tokens."""


class Registry:
    def __init__(self, clock: Clock = time.monotonic, wall_clock: Clock = time.time) -> None:
        self.view = ClusterView(clock, wall_clock)
        self._pending: dict[str, Candidate] = {}

    def heartbeat(self, stats: WorkerStats) -> None:
        """A heartbeat supersedes the estimate of what was placed before it."""
        self.view.heartbeat(stats)
        self._pending.pop(stats.worker_id, None)

    def placed(self, worker_id: str, prompt_tokens: int) -> None:
        entry = self.view.workers[worker_id]
        pending = self._pending.setdefault(worker_id, Candidate(entry.stats))
        pending.pending += 1
        pending.pending_tokens += prompt_tokens

    def candidates(self) -> list[Candidate]:
        """Every live worker, with what was placed on it since its heartbeat."""
        return [
            self._pending.get(entry.stats.worker_id) or Candidate(entry.stats)
            for entry in self.view.live()
        ]
