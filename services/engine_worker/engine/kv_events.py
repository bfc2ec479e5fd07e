"""What the prefix cache gained and lost, numbered without gaps (``BlockManager``).

The worker publishes them, as the wire's messages of the same names and fields, for the
scheduler's cluster-wide prefix index (``lamina.schemas.v1.kv``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Medium = Literal["device", "host", "disk"]
"""Where a cached block is: the device pool, or a lower tier (``kv_tier.py``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockStored:
    """Consecutive full blocks of one sequence became reusable, in ``medium``."""

    event_id: int
    parent_hash: int
    """Hash of the block before the first one here (``ROOT_HASH`` at a sequence start)."""
    block_hashes: list[int]
    """Chained hashes (``lamina.libs.block_hash``), in sequence order."""
    medium: Medium = "device"


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockRemoved:
    """Blocks left ``medium``: they can no longer be hit there."""

    event_id: int
    block_hashes: list[int]
    medium: Medium = "device"


@dataclass(frozen=True, slots=True, kw_only=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""

    event_id: int


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
