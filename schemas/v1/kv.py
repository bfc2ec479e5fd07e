"""KV cache events: what a worker's prefix cache gained and lost, numbered without gaps.

The scheduler keeps a cluster-wide prefix index from these; a gap in ``event_id`` tells it
that it missed something and must resynchronise.
"""

from __future__ import annotations

from lamina.schemas.v1.base import Message


class BlockStored(Message, frozen=True):
    """Consecutive full blocks of one sequence became reusable."""

    event_id: int
    parent_hash: int
    """Hash of the block before the first one here (``ROOT_HASH`` at a sequence start)."""
    block_hashes: list[int]
    """Chained hashes (``lamina.libs.block_hash``), in sequence order."""


class BlockRemoved(Message, frozen=True):
    """Blocks were evicted and can no longer be hit."""

    event_id: int
    block_hashes: list[int]


class AllBlocksCleared(Message, frozen=True):
    """The whole prefix cache was reset."""

    event_id: int


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(Message):
    """Published on ``worker.<id>.kv``: the events since the last batch, in order."""

    worker_id: str
    block_size: int
    events: list[KvEvent]
