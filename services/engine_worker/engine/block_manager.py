"""The paged KV pool: fixed-size blocks, reference counts, each request's block table and
the prefix cache. This is the only writer of a request's blocks: callers read a table with
:meth:`BlockManager.block_table`, and :meth:`BlockManager.allocate` returns what it added.

A block is in one of three states: in use (``ref_count > 0``), free and cached (its hash is
in ``cached``: a later request with the same prefix can take it back), or free and empty.
Free blocks sit in one LRU queue; allocation takes from the front, so empty blocks are
placed there and cached ones at the back in the order they were released, and a cached
block is only evicted (with a ``BlockRemoved`` event) when it is reused for something else.
"""

from __future__ import annotations

from collections import OrderedDict

from lamina.libs.block_hash import ROOT_HASH
from lamina.services.engine_worker.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
)
from lamina.services.engine_worker.engine.request import Request


class BlockManager:
    """Allocates KV blocks to requests and keeps the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
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

    def match_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of ``request``.

        At least one token is always left to compute, since the step that computes the last
        prompt token is the one that produces the first output token's logits.
        """
        if not self.enable_prefix_caching:
            return []
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:limit]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # -------------------------------------------------------------------------- allocation
    def allocate(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Blocks for ``num_new_tokens`` more tokens of ``request``: the block ids added to
        its table (``[]`` when its blocks already hold them), or None, changing nothing,
        when too few are free.

        For a request being admitted, ``cached_blocks`` is its prefix hit (from
        :meth:`match_prefix`): those blocks are shared, first in its table, and its
        computed tokens (the caller's to advance) will start after them.
        """
        cached_blocks = cached_blocks or []
        table = self._tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        have = len(table) + len(cached_blocks)
        need = max(self.blocks_needed(num_computed + num_new_tokens) - have, 0)
        revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if need + revived > len(self.free):
            return None
        for block_id in cached_blocks:
            if self.ref_counts[block_id] == 0:
                del self.free[block_id]
            self.ref_counts[block_id] += 1
        added = cached_blocks + [self._take_free_block() for _ in range(need)]
        if added:
            self._tables[request.request_id] = table + added
        return added

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
        self.ref_counts[block_id] = 1
        return block_id

    def free_request(self, request: Request) -> None:
        """Release every block of ``request``; cached ones stay reusable until evicted.

        Blocks are released tail first, so a request's last blocks are evicted before its
        first ones (a later request is likelier to share the start of a prompt).
        """
        for block_id in reversed(self._tables.pop(request.request_id, [])):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free[block_id] = None
                if self.block_hash[block_id] is None:
                    self.free.move_to_end(block_id, last=False)
        self._num_registered.pop(request.request_id, None)

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
        run_parent = ROOT_HASH
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
                run_parent = request.block_hashes[index - 1] if index else ROOT_HASH
            self.cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash
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

    def snapshot(self) -> tuple[list[int], int]:
        """Every cached block's hash, and the id of the first event the list does not
        cover (events not yet taken are already reflected in it)."""
        return list(self.cached), self._next_event_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use stay with their requests."""
        self.cached.clear()
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
