"""Block manager: exact block ids, sharing, eviction order and KV events."""

from __future__ import annotations

from lamina.libs.block_hash import ROOT_HASH
from lamina.services.engine_worker.engine.block_manager import (
    NO_HIT,
    NO_MOVES,
    BlockManager,
    PrefixHit,
)
from lamina.services.engine_worker.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from lamina.services.engine_worker.engine.kv_tier import DEVICE, DISK, HOST, TierIndex
from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.engine_worker.engine.request import Request

BS = 4


def req(request_id: str, tokens: list[int]) -> Request:
    r = Request(request_id, tokens, SamplingParams(), max_tokens=16)
    r.update_block_hashes(BS)
    return r


def compute_all(bm: BlockManager, r: Request, hit: PrefixHit = NO_HIT) -> None:
    """Admit ``r`` (with its prefix hit), pretend its tokens were computed, cache them."""
    assert bm.allocate(r, r.num_tokens - len(hit) * BS, hit) is not None
    r.num_computed_tokens = r.num_tokens
    bm.cache_computed_blocks(r)


def test_allocation_takes_lowest_free_ids_in_order():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", list(range(10)))  # 3 blocks
    assert bm.allocate(a, 10) == [0, 1, 2]  # what it added
    assert bm.block_table(a) == [0, 1, 2]
    assert bm.num_free_blocks == 5
    assert bm.allocate(a, 2) == []  # 12 tokens still fit in 3 blocks
    assert bm.block_table(a) == [0, 1, 2]
    a.num_computed_tokens = 12
    assert bm.allocate(a, 1) == [3]
    assert bm.block_table(a) == [0, 1, 2, 3]


def test_allocation_fails_without_side_effects():
    bm = BlockManager(num_blocks=2, block_size=BS)
    a = req("a", list(range(9)))
    assert bm.allocate(a, 9) is None
    assert bm.block_table(a) == [] and bm.num_free_blocks == 2


def test_prefix_hit_shares_blocks_and_keeps_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", list(range(12)))
    compute_all(bm, a)
    b = req("b", list(range(12)))  # identical: the last block must still be computed
    hit = bm.match_prefix(b)
    assert hit.blocks == [0, 1]
    assert bm.allocate(b, 4, hit) == [0, 1, 3]
    assert bm.block_table(b) == [0, 1, 3]
    assert b.num_computed_tokens == 0  # the scheduler advances it, not the block manager
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    c = req("c", [*range(8), 99, 98])
    assert bm.match_prefix(c).blocks == [0, 1]
    assert bm.match_prefix(req("d", [5, *range(1, 12)])).blocks == []


def test_freed_blocks_stay_cached_and_are_evicted_lru_tail_first():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = req("a", list(range(8)))  # blocks 0, 1 (both full, cached)
    compute_all(bm, a)
    b = req("b", list(range(100, 110)))  # blocks 2, 3 cached; 4 partial (not cached)
    compute_all(bm, b)
    bm.free_request(a)
    bm.free_request(b)
    assert bm.num_free_blocks == 6
    # Empty blocks first (5 never used, 4 partial), then cached blocks oldest-freed first,
    # each request's tail before its head.
    assert list(bm.free) == [4, 5, 1, 0, 3, 2]
    bm.take_events()
    c = req("c", list(range(200, 216)))  # 4 blocks: reuses 4, 5, then evicts 1, 0
    assert bm.allocate(c, 16) == [4, 5, 1, 0]
    assert [type(e) for e in bm.take_events()] == [BlockRemoved, BlockRemoved]
    assert bm.match_prefix(req("a2", [*range(8), 7])).blocks == []  # a's prefix is gone
    assert bm.match_prefix(req("b2", list(range(100, 110)))).blocks == [2, 3]  # b's survives


def test_cache_hit_revives_a_free_block():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(9)))
    compute_all(bm, a)
    bm.free_request(a)
    b = req("b", list(range(9)))
    hit = bm.match_prefix(b)
    assert hit.blocks == [0, 1]
    assert bm.allocate(b, 1, hit) == [0, 1, 2]
    assert 0 not in bm.free and 1 not in bm.free
    assert bm.ref_counts == [1, 1, 1, 0]


def test_kv_events_are_numbered_without_gaps():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(8)))
    compute_all(bm, a)
    bm.free_request(a)
    b = req("b", list(range(50, 66)))
    assert bm.allocate(b, 16) is not None  # evicts both of a's blocks
    bm.reset_prefix_cache()
    events = bm.take_events()
    assert [e.event_id for e in events] == [0, 1, 2, 3]
    stored, removed1, removed2, cleared = events
    assert stored == BlockStored(event_id=0, parent_hash=ROOT_HASH, block_hashes=a.block_hashes)
    assert isinstance(removed1, BlockRemoved) and isinstance(removed2, BlockRemoved)
    assert {removed1.block_hashes[0], removed2.block_hashes[0]} == set(a.block_hashes)
    assert cleared == AllBlocksCleared(event_id=3)
    assert bm.take_events() == []


def test_stored_event_names_its_parent_when_extending_a_sequence():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", list(range(6)))
    compute_all(bm, a)  # block 0 full
    a.token_ids += [6, 7, 8]
    a.update_block_hashes(BS)
    assert bm.allocate(a, 3) == [2]
    a.num_computed_tokens = 9
    bm.cache_computed_blocks(a)
    first, second = bm.take_events()
    assert first.block_hashes == a.block_hashes[:1]
    assert second == BlockStored(
        event_id=1, parent_hash=a.block_hashes[0], block_hashes=a.block_hashes[1:2]
    )


def test_freeing_drops_the_table():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(8)))
    compute_all(bm, a)
    bm.free_request(a)
    assert bm.block_table(a) == [] and bm.ref_counts == [0, 0, 0, 0]
    bm.free_request(a)  # twice is harmless
    assert bm.ref_counts == [0, 0, 0, 0]


def test_prefix_caching_off_never_caches():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    a = req("a", list(range(8)))
    compute_all(bm, a)
    bm.free_request(a)
    assert bm.match_prefix(req("b", list(range(9)))).blocks == []
    assert bm.take_events() == [] and bm.cached == {}


# ------------------------------------------------------------------------- lower tiers
def test_evicted_blocks_go_to_the_host_tier_and_a_prefix_there_is_loaded_back():
    bm = BlockManager(num_blocks=4, block_size=BS, tiers=[TierIndex(3)])
    host = bm.tier(HOST)
    a = req("a", list(range(12)))  # 3 blocks
    compute_all(bm, a)
    bm.free_request(a)
    bm.take_events()
    b = req("b", list(range(100, 116)))
    compute_all(bm, b)  # 4 blocks: a's 3 are evicted (tail first) and saved
    moves = bm.take_moves()
    # (source tier, device block, target tier, slot)
    assert moves.T.tolist() == [[DEVICE, 2, HOST, 0], [DEVICE, 1, HOST, 1], [DEVICE, 0, HOST, 2]]
    events = bm.take_events()
    assert [(type(e).__name__, e.medium) for e in events[:2]] == [
        ("BlockRemoved", "device"),
        ("BlockStored", "host"),
    ]
    assert bm.take_moves() is NO_MOVES  # taken once
    bm.free_request(b)
    again = req("a2", [*range(12), 50])
    hit = bm.match_prefix(again)
    assert hit.blocks == [None, None, None] and len(hit.loads) == 3
    added = bm.allocate(again, 1, hit)
    assert added is not None and len(added) == 4
    moves = bm.take_moves()
    # b's blocks, evicted to make room for the loads, found every slot pinned by this
    # step's loads: dropped, as without a tier. The tier keeps what it loaded back.
    assert moves[0].tolist() == [HOST] * 3 and moves[2].tolist() == [DEVICE] * 3
    assert moves[1].tolist() == [2, 1, 0]  # slots, in the prompt's order
    assert moves[3].tolist() == added[:3]
    assert host.loads == 3
    assert len(host) == 3 and all(h in host for h in again.block_hashes[:3])


def test_the_host_tiers_least_recently_used_blocks_go_down_to_the_disk_tier():
    bm = BlockManager(num_blocks=4, block_size=BS, tiers=[TierIndex(2, HOST), TierIndex(8, DISK)])
    host, disk = bm.tier(HOST), bm.tier(DISK)
    a = req("a", list(range(12)))  # 3 blocks
    compute_all(bm, a)
    bm.free_request(a)
    b = req("b", list(range(100, 116)))
    compute_all(bm, b)  # evicts a's 3, tail first
    a0, a1, a2 = a.block_hashes[:3]
    # a2 and a1 fill the host tier; its slots are written this step, so a0 goes on down.
    assert bm.take_moves().T.tolist() == [
        [DEVICE, 2, HOST, 0],
        [DEVICE, 1, HOST, 1],
        [DEVICE, 0, DISK, 0],
    ]
    bm.free_request(b)
    bm.take_events()
    c = req("c", list(range(200, 204)))
    compute_all(bm, c)  # evicts b's last block
    b3 = b.block_hashes[3]
    # A later step: b3 displaces a2, the host tier's least recently used block, which
    # goes down to the disk tier (copied out of its slot before b3 is saved into it).
    assert bm.take_moves().T.tolist() == [[HOST, 0, DISK, 1], [DEVICE, 0, HOST, 0]]
    assert host.hashes() == [a1, b3] and disk.hashes() == [a0, a2]
    events = [(type(e).__name__, e.medium, e.block_hashes) for e in bm.take_events()]
    assert events[:4] == [
        ("BlockRemoved", "device", [b3]),
        ("BlockRemoved", "host", [a2]),
        ("BlockStored", "disk", [a2]),
        ("BlockStored", "host", [b3]),
    ]
    # a's whole prefix is a hit, each block loaded from the fastest tier holding it.
    bm.free_request(c)
    again = req("a2", [*range(12), 50])
    hit = bm.match_prefix(again)
    assert hit.blocks == [None, None, None]
    added = bm.allocate(again, 1, hit)
    assert added is not None
    loads = [m for m in bm.take_moves().T.tolist() if m[2] == DEVICE]
    assert loads == [
        [DISK, 0, DEVICE, added[0]],
        [HOST, 1, DEVICE, added[1]],
        [DISK, 1, DEVICE, added[2]],
    ]
    assert (host.loads, disk.loads) == (1, 2)


def test_with_no_host_tier_the_device_pools_evicted_blocks_go_to_the_disk_tier():
    bm = BlockManager(num_blocks=4, block_size=BS, tiers=[TierIndex(4, DISK)])
    a = req("a", list(range(12)))
    compute_all(bm, a)
    bm.free_request(a)
    b = req("b", list(range(100, 116)))
    compute_all(bm, b)
    assert [m[::2] for m in bm.take_moves().T.tolist()] == [[DEVICE, DISK]] * 3
    bm.free_request(b)
    again = req("a2", [*range(12), 50])
    added = bm.allocate(again, 1, bm.match_prefix(again))
    assert added is not None
    loads = [m for m in bm.take_moves().T.tolist() if m[2] == DEVICE]
    assert [(m[0], m[3]) for m in loads] == [(DISK, block) for block in added[:3]]
    assert bm.tier(DISK).loads == 3
    snapshot = bm.snapshot()[1]
    assert set(snapshot) == {"disk"} and set(again.block_hashes[:3]) <= set(snapshot["disk"])


def test_a_full_tier_reuses_its_least_recently_used_slot_but_never_one_a_step_moves():
    tier = TierIndex(2)
    assert tier.put(1, 0) == (0, None)
    assert tier.put(2, 1) == (1, None)
    assert tier.put(3, 2) is None  # both slots written this step
    tier.step_taken()
    assert tier.take(1) == 0  # a load: most recently used, and pinned
    assert tier.put(3, 2) == (1, (2, 1))  # displaces 2 (after 1), the least recently used
    assert 2 not in tier and tier.hashes() == [1, 3]


def test_adopted_blocks_are_cached_free_and_never_displace_each_other():
    bm = BlockManager(num_blocks=3, block_size=BS)
    hashes = req("a", list(range(16))).block_hashes  # 4 blocks, room for 3
    placed = bm.adopt(ROOT_HASH, hashes)
    assert [index for index, _ in placed] == [0, 1, 2]
    assert bm.num_free_blocks == 3 and bm.match_prefix(req("b", list(range(13)))).blocks == [
        b for _, b in placed
    ]
    (stored,) = bm.take_events()
    assert (stored.parent_hash, stored.block_hashes) == (ROOT_HASH, hashes[:3])
    assert bm.adopt(ROOT_HASH, hashes[:3]) == []  # already cached
