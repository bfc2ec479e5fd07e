"""KV cache events: what a worker's prefix cache gained and lost, numbered without gaps.

The scheduler keeps a cluster-wide prefix index from these; a gap in ``event_id`` tells it
that it missed something and must resynchronise: it sends ``KvSyncRequest`` to
``worker.<id>.kv.sync`` and the worker answers on the reply subject with its whole cache
as ``KvSnapshot`` parts, the events after ``next_event_id`` applying on top.
"""

from __future__ import annotations

from lamina.schemas.v1.base import Id, Message, OpenEnum


class Medium(OpenEnum):
    """Where a worker holds a cached block: its device pool, its host tier or its disk
    tier (evicted blocks that a hit loads back: cheaper than computing them, dearer than
    a device hit, the disk dearer than the host). A reader that meets ``unknown`` (a
    newer worker's tier) keeps it apart from the others."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    UNKNOWN = "unknown"


class BlockStored(Message, frozen=True):
    """Consecutive full blocks of one sequence became reusable, in ``medium``."""

    event_id: int
    parent_hash: int
    """Hash of the block before the first one here (``ROOT_HASH`` at a sequence start)."""
    block_hashes: list[int]
    """Chained hashes (``lamina.libs.block_hash``), in sequence order."""
    medium: Medium = Medium.DEVICE


class BlockRemoved(Message, frozen=True):
    """Blocks left ``medium``: they can no longer be hit there."""

    event_id: int
    block_hashes: list[int]
    medium: Medium = Medium.DEVICE


class AllBlocksCleared(Message, frozen=True):
    """The whole prefix cache was reset."""

    event_id: int


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(Message):
    """Published on ``worker.<id>.kv``: the events since the last batch, in order."""

    worker_id: Id
    block_size: int
    events: list[KvEvent]
    incarnation: Id = ""
    """Unique to one run of the worker process: a new one means a restarted worker, whose
    cache and event numbering start again from nothing."""


class KvSyncRequest(Message):
    """scheduler → ``worker.<id>.kv.sync``: send me your cache as it is now."""


class KvSnapshot(Message):
    """One part of a worker's answer to ``KvSyncRequest``, on its reply subject: the hashes
    of every cached block as of ``next_event_id`` (the first event the snapshot does not
    cover). Large caches come in several parts, ``last`` on the final one; all parts are
    taken from one consistent state."""

    worker_id: Id
    incarnation: Id
    block_size: int
    next_event_id: int
    block_hashes: list[int]
    """The blocks cached on the device."""
    part: int = 0
    last: bool = True
    host_block_hashes: list[int] = []
    """The blocks in the host tier (some may be on the device as well)."""
    disk_block_hashes: list[int] = []
    """The blocks in the disk tier (some may be in the tiers above as well)."""
