"""The paged KV pool: fixed-size blocks, reference counts, each request's block table and
the prefix cache. This is the only writer of a request's blocks: callers read a table with
:meth:`BlockManager.block_table`, and :meth:`BlockManager.allocate` returns what it added.

A block is in one of three states: in use (``ref_count > 0``), free and cached (its hash is
in ``cached``: a later request with the same prefix can take it back), or free and empty.
Free blocks sit in one LRU queue; allocation takes from the front, so empty blocks are
placed there and cached ones at the back in the order they were released, and a cached
block is only evicted (with a ``BlockRemoved`` event) when it is reused for something else.

With lower tiers (``kv_tier.py``: host memory, then local disk), an evicted block is
saved one tier down first (what that tier evicts goes one lower still), and a prefix
whose blocks are in a lower tier is a hit too: each such block is loaded into a fresh
device block before the step that reads it runs. This is the only place that decides
what moves between the tiers; :meth:`BlockManager.take_moves` hands a step's moves to
the ranks, which copy their own share.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from lamina.services.engine_worker.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
)
from lamina.services.engine_worker.engine.kv_tier import DEVICE, TierIndex
from lamina.services.engine_worker.engine.request import Request


@dataclass(frozen=True)
class PrefixHit:
    """The cached prefix of a request, block by block in token order: each block's hash,
    and the device block that holds it, or None where a lower tier does (a load)."""

    hashes: list[int] = field(default_factory=list)
    blocks: list[int | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.hashes)

    @property
    def loads(self) -> list[int]:
        """The hashes that come from a lower tier."""
        return [h for h, b in zip(self.hashes, self.blocks, strict=True) if b is None]


NO_HIT = PrefixHit()


NO_MOVES = np.zeros((4, 0), dtype=np.int64)
"""A step's moves between the tiers when there are none (``StepInput.moves``)."""


class BlockManager:
    """Allocates KV blocks to requests and keeps the prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        tiers: list[TierIndex] | None = None,
    ):
        self.num_blocks = num_blocks
        self.tiers = (tiers or []) if enable_prefix_caching else []
        """The lower tiers' bookkeeping, fastest first (none: an evicted block is gone)."""
        self.parent_of: dict[int, int] = {}
        """A cached block's hash -> the hash before it (what its events name)."""
        self._moves: list[tuple[int, int, int, int]] = []
        """The next step's moves: (source tier, its block or slot, target tier, ...)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._tables: dict[str, list[int]] = {}  # request id -> block ids, in token order
        self._num_registered: dict[str, int] = {}  # request id -> blocks offered to the cache
        self._events: list[KvEvent] = []
        self._next_event_id = 0
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which served from the cache

    # ----------------------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def block_table(self, request: Request) -> list[int]:
        """``request``'s block ids in token order (read only; empty when it holds none)."""
        return self._tables.get(request.request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def tier(self, number: int) -> TierIndex | None:
        """Lower tier ``number`` (``kv_tier.HOST``, ``DISK``), if this pool has it."""
        return next((t for t in self.tiers if t.number == number), None)

    def holder(self, block_hash: int) -> TierIndex | None:
        """The fastest lower tier that holds ``block_hash``, if any."""
        return next((t for t in self.tiers if block_hash in t), None)

    def match_prefix(self, request: Request) -> PrefixHit:
        """The longest cached prefix of ``request``, each block on the device or in a
        lower tier.

        At least one token is always left to compute, since the step that computes the last
        prompt token is the one that produces the first output token's logits.
        """
        if not self.enable_prefix_caching:
            return NO_HIT
        limit = (request.num_tokens - 1) // self.block_size
        hit = PrefixHit()
        for block_hash in request.block_hashes[:limit]:
            block_id = self.cached.get(block_hash)
            if block_id is None and self.holder(block_hash) is None:
                break
            hit.hashes.append(block_hash)
            hit.blocks.append(block_id)
        return hit

    # -------------------------------------------------------------------------- allocation
    def allocate(
        self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT
    ) -> list[int] | None:
        """Blocks for ``num_new_tokens`` more tokens of ``request``: the block ids added to
        its table (``[]`` when its blocks already hold them), or None, changing nothing,
        when too few are free.

        For a request being admitted, ``hit`` is its prefix hit (from
        :meth:`match_prefix`): its device blocks are shared and its lower tiers' blocks
        loaded into fresh ones, first in its table, and its computed tokens (the caller's
        to advance) will start after them.
        """
        table = self._tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(hit) * self.block_size
        have = len(table) + len(hit)
        need = max(self.blocks_needed(num_computed + num_new_tokens) - have, 0)
        on_device = [b for b in hit.blocks if b is not None]
        revived = sum(1 for b in on_device if self.ref_counts[b] == 0)
        loads = hit.loads
        if need + revived + len(loads) > len(self.free):
            return None
        for block_id in on_device:  # first: taking free blocks must not evict them
            if self.ref_counts[block_id] == 0:
                del self.free[block_id]
            self.ref_counts[block_id] += 1
        # Pinned before any block is taken: no save this step displaces them.
        sources = {h: (tier, tier.take(h)) for h in loads if (tier := self.holder(h))}
        prefix = [
            self._load(h, *sources[h]) if b is None else b
            for h, b in zip(hit.hashes, hit.blocks, strict=True)
        ]
        added = prefix + [self._take_free_block() for _ in range(need)]
        if added:
            self._tables[request.request_id] = table + added
        return added

    def _load(self, block_hash: int, tier: TierIndex, slot: int) -> int:
        """A fresh device block that the step loads ``block_hash`` into from ``tier``'s
        ``slot``, cached (and in use) from now on."""
        block_id = self._take_free_block()
        parent = tier.parent(block_hash)
        self.cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        self.parent_of[block_hash] = parent
        self._moves.append((tier.number, slot, DEVICE, block_id))
        tier.loads += 1
        self._emit(
            BlockStored(event_id=self._event_id(), parent_hash=parent, block_hashes=[block_hash])
        )
        return block_id

    def record_prefix_lookup(self, request: Request, num_hit_blocks: int) -> None:
        """Count an admitted request's prompt against the prefix cache hit ratio."""
        if self.enable_prefix_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += num_hit_blocks * self.block_size

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block_id] = None
            self._emit(BlockRemoved(event_id=self._event_id(), block_hashes=[block_hash]))
            parent = self.parent_of.pop(block_hash)
            if self.tiers:
                self._save(0, (DEVICE, block_id), block_hash, parent)
        self.ref_counts[block_id] = 1
        return block_id

    def _save(self, level: int, source: tuple[int, int], block_hash: int, parent: int) -> None:
        """Save a block leaving ``source`` (its tier, block or slot) to ``tiers[level]``,
        unless that tier holds it already (the tiers keep what they load back); where
        every slot there is in use by this step, one tier lower (below the last, it is
        gone). What the save displaces goes one tier lower in turn (its copy out is made
        first: ``kv_tier.MOVE_ORDER``)."""
        tier = self.tiers[level]
        if block_hash in tier:
            return
        placed = tier.put(block_hash, parent)
        if placed is None:
            if level + 1 < len(self.tiers):
                self._save(level + 1, source, block_hash, parent)
            return
        slot, displaced = placed
        if displaced is not None:
            gone, gone_parent = displaced
            self._emit(
                BlockRemoved(event_id=self._event_id(), block_hashes=[gone], medium=tier.medium)
            )
            if level + 1 < len(self.tiers):
                self._save(level + 1, (tier.number, slot), gone, gone_parent)
        self._moves.append((*source, tier.number, slot))
        tier.saves += 1
        self._emit(
            BlockStored(
                event_id=self._event_id(),
                parent_hash=parent,
                block_hashes=[block_hash],
                medium=tier.medium,
            )
        )

    def adopt(self, parent_hash: int, hashes: list[int]) -> list[tuple[int, int]]:
        """Cache blocks computed elsewhere (``Engine.import_blocks``): for each of
        ``hashes``, a sequence's consecutive blocks after ``parent_hash``, that is not
        cached yet, a free block for its KV, cached and free (most recently used) from now
        on. Stops when every block free at the start is taken. Returns ``(index in
        hashes, block id)`` of each, for the caller to write before any step runs."""
        if not self.enable_prefix_caching:
            return []
        placed: list[tuple[int, int]] = []
        run: list[int] = []
        run_parent = parent = parent_hash
        room = len(self.free)
        for index, block_hash in enumerate(hashes):
            if block_hash in self.cached or len(placed) == room:
                self._flush_stored(run_parent, run)
                run = []
                if block_hash not in self.cached:
                    break
            else:
                block_id = self._take_free_block()
                self.ref_counts[block_id] = 0
                self.free[block_id] = None  # at the back: the most recently used
                self.cached[block_hash] = block_id
                self.block_hash[block_id] = block_hash
                self.parent_of[block_hash] = parent
                if not run:
                    run_parent = parent
                run.append(block_hash)
                placed.append((index, block_id))
            parent = block_hash
        self._flush_stored(run_parent, run)
        return placed

    def take_moves(self) -> np.ndarray:
        """The moves between tiers that the next step must make before it runs (it
        reuses the blocks saved from, and reads the blocks loaded into), as a ``(4, n)``
        int64 array (``StepInput.moves``)."""
        if not self._moves:
            return NO_MOVES
        moves = np.asarray(self._moves, dtype=np.int64).T.copy()
        self._moves = []
        for tier in self.tiers:
            tier.step_taken()
        return moves

    def free_request(self, request: Request) -> None:
        """Release every block of ``request``; cached ones stay reusable until evicted.

        Blocks are released tail first, so a request's last blocks are evicted before its
        first ones (a later request is likelier to share the start of a prompt).
        """
        self._release(self._tables.pop(request.request_id, []))
        self._num_registered.pop(request.request_id, None)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release ``request``'s blocks past the first ``num_tokens`` tokens' (those a
        rejected draft was computed into: never full of known tokens, so never cached)."""
        table = self._tables.get(request.request_id, [])
        keep = self.blocks_needed(num_tokens)
        if len(table) > keep:
            self._release(table[keep:])
            del table[keep:]

    def _release(self, block_ids: list[int]) -> None:
        """Drop a reference to each block, tail first; a block no one holds is free."""
        for block_id in reversed(block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free[block_id] = None
                if self.block_hash[block_id] is None:
                    self.free.move_to_end(block_id, last=False)

    # ------------------------------------------------------------------------ prefix cache
    def cache_computed_blocks(self, request: Request) -> None:
        """Offer ``request``'s newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        first = self._num_registered.get(request.request_id, 0)
        last = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        if last <= first:
            return
        run: list[int] = []  # consecutive newly stored hashes
        run_parent = request.root_hash
        table = self._tables[request.request_id]
        for index in range(first, last):
            block_hash = request.block_hashes[index]
            block_id = table[index]
            if block_hash in self.cached or self.block_hash[block_id] is not None:
                # Already cached (a prefix hit, or an identical block of another request).
                self._flush_stored(run_parent, run)
                run = []
                continue
            if not run:
                run_parent = request.block_hashes[index - 1] if index else request.root_hash
            self.cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash
            self.parent_of[block_hash] = (
                request.block_hashes[index - 1] if index else request.root_hash
            )
            run.append(block_hash)
        self._flush_stored(run_parent, run)
        self._num_registered[request.request_id] = last

    def _flush_stored(self, parent_hash: int, block_hashes: list[int]) -> None:
        if block_hashes:
            self._emit(
                BlockStored(
                    event_id=self._event_id(), parent_hash=parent_hash, block_hashes=block_hashes
                )
            )

    def snapshot(self) -> tuple[list[int], dict[str, list[int]], int]:
        """Every cached block's hash on the device, every one in each lower tier (by its
        medium), and the id of the first event the lists do not cover (events not yet
        taken are already reflected in them)."""
        tiered = {tier.medium: tier.hashes() for tier in self.tiers}
        return list(self.cached), tiered, self._next_event_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash, in every tier; blocks in use stay with their
        requests (moves already decided still run: they touch no hash)."""
        self.cached.clear()
        self.parent_of.clear()
        for tier in self.tiers:
            tier.forget()
        self.block_hash = [None] * self.num_blocks
        # All free blocks are now empty: their order no longer matters.
        self._emit(AllBlocksCleared(event_id=self._event_id()))

    # ------------------------------------------------------------------------------ events
    def _event_id(self) -> int:
        self._next_event_id += 1
        return self._next_event_id - 1

    def _emit(self, event: KvEvent) -> None:
        self._events.append(event)

    def take_events(self) -> list[KvEvent]:
        """KV events since the last call, numbered without gaps."""
        events, self._events = self._events, []
        return events
