"""The cluster prefix index: stored, removed and cleared blocks; gaps, snapshots and the
events buffered meanwhile; dead and restarted workers; one walk over a prompt."""

from __future__ import annotations

from lamina.libs.block_hash import ROOT_HASH, hash_blocks
from lamina.schemas.v1.kv import AllBlocksCleared, BlockRemoved, BlockStored, Medium
from lamina.services.scheduler.prefix_index import PrefixIndex

BS = 4
PROMPT = list(range(100, 120))  # 5 full blocks
HASHES = hash_blocks(PROMPT, BS)


def stored(event_id: int, hashes: list[int], parent: int = ROOT_HASH) -> BlockStored:
    return BlockStored(event_id=event_id, parent_hash=parent, block_hashes=hashes)


def test_overlap_counts_each_workers_leading_blocks_in_one_walk():
    index = PrefixIndex()
    assert index.apply("a", "i1", BS, [stored(0, HASHES[:3])])
    assert index.apply("b", "i1", BS, [stored(0, HASHES)])
    assert index.apply("c", "i1", BS, [stored(0, HASHES[1:])])  # no first block: no prefix
    got = index.overlap(PROMPT, ["a", "b", "c", "unknown"])
    assert got == {"a": 3, "b": 5, "c": 0, "unknown": 0}
    # A different prompt sharing the first two blocks.
    other = [*PROMPT[:8], 1, 2, 3, 4]
    assert index.overlap(other, ["a", "b"]) == {"a": 2, "b": 2}
    assert len(index) == 3 + 5 + 4


def test_removed_and_cleared_blocks_stop_matching():
    index = PrefixIndex()
    index.apply("a", "i1", BS, [stored(0, HASHES)])
    index.apply("b", "i1", BS, [stored(0, HASHES)])
    assert index.apply("a", "i1", BS, [BlockRemoved(event_id=1, block_hashes=HASHES[2:3])])
    assert index.overlap(PROMPT, ["a", "b"]) == {"a": 2, "b": 5}
    assert index.apply("b", "i1", BS, [AllBlocksCleared(event_id=1)])
    assert index.overlap(PROMPT, ["a", "b"]) == {"a": 2, "b": 0}
    # Removing a hash the worker does not hold leaves the other workers' entries alone.
    index.apply("b", "i1", BS, [BlockRemoved(event_id=2, block_hashes=HASHES[:1])])
    assert index.overlap(PROMPT, ["a"]) == {"a": 2}


def test_a_block_counts_while_the_worker_holds_it_on_its_device_or_in_its_host_tier():
    index = PrefixIndex()
    host, device = Medium.HOST, Medium.DEVICE
    events = [
        stored(0, HASHES[:3]),
        # Block 2 evicted to the host tier, then dropped from it; block 1 evicted to the
        # tier and loaded back (held in both), then evicted from the device again.
        BlockRemoved(event_id=1, block_hashes=HASHES[2:3]),
        BlockStored(event_id=2, parent_hash=HASHES[1], block_hashes=HASHES[2:3], medium=host),
        BlockRemoved(event_id=3, block_hashes=HASHES[1:2]),
        BlockStored(event_id=4, parent_hash=HASHES[0], block_hashes=HASHES[1:2], medium=host),
        BlockStored(event_id=5, parent_hash=HASHES[0], block_hashes=HASHES[1:2], medium=device),
    ]
    assert index.apply("a", "i1", BS, events)
    # Blocks 0 and 1 on its device, block 2 only in its host tier.
    assert index.overlap_by_medium(PROMPT, ["a"]) == {"a": (3, 1, 0)}
    assert index.apply("a", "i1", BS, [BlockRemoved(event_id=6, block_hashes=HASHES[1:2])])
    assert index.overlap_by_medium(PROMPT, ["a"]) == {"a": (3, 2, 0)}  # block 1: the tier's
    gone = BlockRemoved(event_id=7, block_hashes=HASHES[2:3], medium=host)
    assert index.apply("a", "i1", BS, [gone])
    assert index.overlap(PROMPT, ["a"]) == {"a": 2}
    # A snapshot says which blocks are where.
    index.restore("b", "i1", BS, HASHES[:1], 0, host_block_hashes=HASHES[:4])
    assert index.overlap_by_medium(PROMPT, ["a", "b"]) == {"a": (2, 1, 0), "b": (4, 3, 0)}
    assert index.apply("b", "i1", BS, [BlockRemoved(event_id=0, block_hashes=HASHES[:1])])
    assert index.overlap_by_medium(PROMPT, ["b"]) == {"b": (4, 4, 0)}


def test_a_block_only_the_disk_tier_holds_counts_apart_from_the_host_tiers():
    index = PrefixIndex()
    host, disk = Medium.HOST, Medium.DISK
    events = [
        stored(0, HASHES[:3]),
        # Block 2 evicted to the host tier, then passed down to the disk tier.
        BlockRemoved(event_id=1, block_hashes=HASHES[2:3]),
        BlockStored(event_id=2, parent_hash=HASHES[1], block_hashes=HASHES[2:3], medium=host),
        BlockRemoved(event_id=3, block_hashes=HASHES[2:3], medium=host),
        BlockStored(event_id=4, parent_hash=HASHES[1], block_hashes=HASHES[2:3], medium=disk),
        # Block 1 evicted to the host tier (held there and on the disk after a reload).
        BlockRemoved(event_id=5, block_hashes=HASHES[1:2]),
        BlockStored(event_id=6, parent_hash=HASHES[0], block_hashes=HASHES[1:2], medium=disk),
        BlockStored(event_id=7, parent_hash=HASHES[0], block_hashes=HASHES[1:2], medium=host),
    ]
    assert index.apply("a", "i1", BS, events)
    assert index.overlap_by_medium(PROMPT, ["a"]) == {"a": (3, 1, 1)}
    gone = BlockRemoved(event_id=8, block_hashes=HASHES[2:3], medium=disk)
    assert index.apply("a", "i1", BS, [gone])
    assert index.overlap_by_medium(PROMPT, ["a"]) == {"a": (2, 1, 0)}
    # A snapshot's disk part, and a tier this index does not know (a newer worker's),
    # charged as the slowest it knows.
    index.restore("b", "i1", BS, HASHES[:1], 0, HASHES[1:2], disk_block_hashes=HASHES[2:3])
    assert index.overlap_by_medium(PROMPT, ["b"]) == {"b": (3, 1, 1)}
    unknown = BlockStored(
        event_id=0, parent_hash=HASHES[2], block_hashes=HASHES[3:4], medium=Medium.UNKNOWN
    )
    assert index.apply("b", "i1", BS, [unknown])
    assert index.overlap_by_medium(PROMPT, ["b"]) == {"b": (4, 1, 2)}


def test_a_gap_drops_the_worker_until_its_snapshot_and_keeps_later_events():
    index = PrefixIndex()
    index.apply("a", "i1", BS, [stored(0, HASHES[:1])])
    # Events 1 and 2 are lost; 3 arrives.
    assert not index.apply("a", "i1", BS, [stored(3, HASHES[3:4], HASHES[2])])
    assert index.overlap(PROMPT, ["a"]) == {"a": 0}  # unsynced: nothing is trusted
    # Event 4 arrives while the snapshot is on its way: buffered, not applied yet.
    assert index.apply("a", "i1", BS, [stored(4, HASHES[4:5], HASHES[3])])
    assert index.overlap(PROMPT, ["a"]) == {"a": 0}
    # The snapshot covers everything before event 4: the first four blocks.
    index.restore("a", "i1", BS, HASHES[:4], next_event_id=4)
    assert index.overlap(PROMPT, ["a"]) == {"a": 5}  # event 4 applied on top
    assert index.workers["a"].next_event_id == 5
    assert index.apply("a", "i1", BS, [BlockRemoved(event_id=5, block_hashes=HASHES[4:])])
    assert index.overlap(PROMPT, ["a"]) == {"a": 4}


def test_a_replica_that_starts_late_needs_a_snapshot():
    index = PrefixIndex()
    assert not index.apply("a", "i1", BS, [stored(17, HASHES[:2])])
    index.restore("a", "i1", BS, HASHES[:2], next_event_id=18)
    assert index.overlap(PROMPT, ["a"]) == {"a": 2}


def test_events_a_snapshot_already_covers_are_skipped():
    index = PrefixIndex()
    index.restore("a", "i1", BS, HASHES[:2], next_event_id=5)
    # Events 3 and 4 were in flight when the snapshot was taken: already in it.
    assert index.apply("a", "i1", BS, [BlockRemoved(event_id=4, block_hashes=HASHES[:2])])
    assert index.overlap(PROMPT, ["a"]) == {"a": 2}


def test_a_restarted_worker_starts_empty_and_a_dead_one_is_dropped():
    index = PrefixIndex()
    index.apply("a", "i1", BS, [stored(0, HASHES)])
    index.apply("b", "i1", BS, [stored(0, HASHES)])
    # A new incarnation numbers its events from 0 again: not a gap.
    assert index.apply("a", "i2", BS, [stored(0, HASHES[:1])])
    assert index.overlap(PROMPT, ["a", "b"]) == {"a": 1, "b": 5}
    index.drop("b")
    assert index.overlap(PROMPT, ["a", "b"]) == {"a": 1, "b": 0}
    assert len(index) == 1
    # Its slot is reused without inheriting anything.
    index.apply("c", "i1", BS, [stored(0, HASHES[:2])])
    assert index.overlap(PROMPT, ["a", "c"]) == {"a": 1, "c": 2}


def test_workers_with_other_block_sizes_are_walked_at_their_own():
    index = PrefixIndex()
    index.apply("small", "i1", 4, [stored(0, hash_blocks(PROMPT, 4))])
    index.apply("large", "i1", 8, [stored(0, hash_blocks(PROMPT, 8)[:1])])
    assert index.overlap(PROMPT, ["small", "large"]) == {"small": 5, "large": 1}
