"""The scheduler's registry: the cluster view, the cluster prefix index, and what was
placed on each worker that its last heartbeat does not show yet, by this replica or
another (pure: no I/O).

A placement is numbered by its placer (``GenerateRequest.placement_seq``) and a heartbeat
reports the last number the worker received from each placer, so a heartbeat taken while
a forward was still on its way does not wipe that forward from the count: the worker
would be sent more than it takes, and refuse the excess.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from lamina.libs.cluster import Clock, ClusterView
from lamina.schemas.v1.kv import KvEventBatch, KvSnapshot
from lamina.schemas.v1.records import PlacementRecord
from lamina.schemas.v1.stats import WorkerStats
from lamina.services.scheduler.prefix_index import PrefixIndex

PENDING_MAX_AGE_S = 10.0
"""A placement no heartbeat ever shows (its forward was lost, or its placer's number
fell out of the worker's report) stops counting after this long."""


@dataclass
class Candidate:
    """A live worker as placement weighs it."""

    stats: WorkerStats
    pending: int = 0
    """Requests placed here that its last heartbeat does not show yet."""
    pending_tokens: int = 0
    """Their uncached prompt tokens: prefill work not yet in its stats."""
    queued_tokens: float = 0.0
    """Prefill tokens queued there now, as a fluid estimate: what its heartbeat reported
    plus what was placed there since, draining at its measured prefill rate."""


@dataclass(frozen=True)
class Placed:
    """One placement a worker's heartbeat does not show yet."""

    placer: str
    seq: int
    """Its number from ``placer`` (0: unnumbered, e.g. a prefill leg: the next heartbeat
    supersedes it)."""
    tokens: int
    at: float


class Registry:
    def __init__(
        self,
        clock: Clock = time.monotonic,
        wall_clock: Clock = time.time,
        prefill_rate_prior: float = 2000.0,
    ) -> None:
        self.view = ClusterView(clock, wall_clock)
        self.index = PrefixIndex()
        self.prefill_rate_prior = prefill_rate_prior
        """Drain rate of a worker's queue before it has measured its own."""
        self.quarantined: set[str] = set()
        """Workers taken out of placement until they answer a ping (one did not accept a
        request it was sent; a forged heartbeat's worker never will)."""
        self._pending: dict[str, list[Placed]] = {}
        self._backlog: dict[str, tuple[float, float]] = {}  # worker -> (tokens, as of when)

    def heartbeat(self, stats: WorkerStats) -> bool:
        """A heartbeat supersedes the estimate of what was placed before it: what it
        shows received stops counting as pending. Returns True when the index should ask
        this worker for a snapshot (never synced, or restarted under the same id)."""
        self.view.heartbeat(stats)
        now = self.view.clock()
        seen = stats.placements_seen
        pending = [
            placed
            for placed in self._pending.pop(stats.worker_id, ())
            if seen is not None
            and placed.seq > seen.get(placed.placer, 0)
            and now - placed.at < PENDING_MAX_AGE_S
        ]
        if pending:
            self._pending[stats.worker_id] = pending
        backlog = stats.num_queued_prefill_tokens + sum(placed.tokens for placed in pending)
        self._backlog[stats.worker_id] = (backlog, now)
        kv = self.index.workers.get(stats.worker_id)
        if kv is not None and kv.incarnation != stats.incarnation:
            self.index.drop(stats.worker_id)  # a new process: its cache starts empty
            kv = None
        return kv is None or not kv.synced

    def kv_events(self, batch: KvEventBatch) -> bool:
        """Apply a worker's KV events; False when it must be asked for a snapshot."""
        if batch.worker_id not in self.view.workers:
            return True  # not heard from yet: its first heartbeat starts a sync
        return self.index.apply(batch.worker_id, batch.incarnation, batch.block_size, batch.events)

    def restore(self, parts: list[KvSnapshot]) -> None:
        """Replace a worker's index entries with its snapshot (all its parts)."""
        first = parts[0]
        hashes = [h for part in parts for h in part.block_hashes]
        host = [h for part in parts for h in part.host_block_hashes]
        disk = [h for part in parts for h in part.disk_block_hashes]
        self.index.restore(
            first.worker_id,
            first.incarnation,
            first.block_size,
            hashes,
            first.next_event_id,
            host,
            disk,
        )

    def assume_synced(self, worker_id: str) -> None:
        """Index a worker that cannot send snapshots from its events alone."""
        entry = self.view.workers.get(worker_id)
        if entry is not None:
            stats = entry.stats
            self.index.assume_synced(worker_id, stats.incarnation, stats.block_size)

    def placed(self, worker_id: str, uncached_tokens: int, placer: str = "", seq: int = 0) -> None:
        """Count a request placed on ``worker_id`` (``seq``-th of ``placer``'s) until a
        heartbeat shows it received."""
        if worker_id not in self.view.workers:
            return
        now = self.view.clock()
        placed = Placed(placer, seq, uncached_tokens, now)
        self._pending.setdefault(worker_id, []).append(placed)
        self._backlog[worker_id] = (self._queued(worker_id, now) + uncached_tokens, now)

    def _queued(self, worker_id: str, now: float) -> float:
        """The worker's backlog now: the last known one less what drained since."""
        tokens, since = self._backlog.get(worker_id, (0.0, now))
        stats = self.view.workers[worker_id].stats
        rate = stats.prefill_tokens_per_s or self.prefill_rate_prior
        return max(0.0, tokens - rate * (now - since))

    def placed_by_peer(self, record: PlacementRecord) -> None:
        """Count another replica's placement, unless the worker's heartbeat since then
        already does (by its number; an unnumbered record's, or an older worker's, by
        the clocks)."""
        entry = self.view.workers.get(record.worker_id or "")
        if entry is None:
            return
        stats, seen = entry.stats, entry.stats.placements_seen
        if record.placement_seq and seen is not None:
            if record.placement_seq <= seen.get(record.placed_by, 0):
                return
        elif record.timestamp_ms <= stats.timestamp_ms:
            return
        cached = min(record.prefix_hit_blocks * stats.block_size, max(record.prompt_tokens - 1, 0))
        tokens = record.prompt_tokens - cached
        self.placed(stats.worker_id, tokens, record.placed_by, record.placement_seq)

    def candidates(self) -> list[Candidate]:
        """Every live worker not quarantined, with what was placed on it since its
        heartbeat. The index forgets workers that are no longer alive (they come back
        through a snapshot)."""
        live = self.view.live()
        alive = {entry.stats.worker_id for entry in live}
        for worker_id in [w for w in self.index.workers if w not in alive]:
            self.index.drop(worker_id)
        now = self.view.clock()
        candidates = []
        for entry in live:
            if entry.stats.worker_id in self.quarantined:
                continue
            pending = self._pending.get(entry.stats.worker_id, ())
            candidates.append(
                Candidate(
                    entry.stats,
                    pending=len(pending),
                    pending_tokens=sum(placed.tokens for placed in pending),
                    queued_tokens=self._queued(entry.stats.worker_id, now),
                )
            )
        return candidates
