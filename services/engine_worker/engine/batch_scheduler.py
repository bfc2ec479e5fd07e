"""Continuous batching: which requests run in the next step, and how many tokens each.

There is no prefill phase and no decode phase. Every request has ``num_computed_tokens``
catching up with ``num_tokens``; a step gives each scheduled request some tokens to compute
under one token budget: one for a request that is decoding, a chunk of its prompt for one
that is prefilling. Running requests go first, in priority order; when blocks run out the
lowest-priority, latest-arriving running request is preempted (its blocks freed, to be
recomputed later, usually from the prefix cache). Waiting requests are admitted only in a
step that preempted nothing, so a freed block is never handed straight back.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from lamina.services.engine_worker.engine.block_manager import NO_HIT, BlockManager
from lamina.services.engine_worker.engine.request import Request, Status


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: decodes (one new token each) first, then prefill chunks."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    """Each request's block ids (the block manager's, read only)."""
    num_decodes: int = 0
    preempted: list[Request] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)


class BatchScheduler:
    """Waiting heap and running list over one :class:`BlockManager`."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_chunked_prefill: bool = True,
        max_loras: int = 0,
    ) -> None:
        self.blocks = block_manager
        self.max_loras = max_loras
        """Most LoRA adapters among the running requests (the device slots): a waiting
        request of another adapter waits, and those behind it may go first."""
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: list[tuple[tuple[int, float, int], Request]] = []  # heap by sort_key
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prompt_tokens_cached = 0
        """Prompt tokens served from the prefix cache, once per request (first admission)."""

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        heapq.heappush(self.waiting, (request.sort_key, request))

    def remove(self, request: Request) -> None:
        """Take ``request`` out of the queues and free its blocks (finish or abort)."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status is Status.WAITING:
            self.waiting = [entry for entry in self.waiting if entry[1] is not request]
            heapq.heapify(self.waiting)
        self._release(request)
        request.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(
        self, busy: frozenset[str] = frozenset(), most: int | None = None
    ) -> ScheduledBatch:
        """The next step's batch. ``busy``: ids of running requests whose last batch is
        still in flight (pipeline stages): they are neither scheduled nor preempted.
        ``most``: requests in the batch at most (None: ``max_num_seqs`` running)."""
        most = len(self.running) + len(self.waiting) if most is None else most
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        computing: set[int] = set()  # hashes of the blocks this step completes

        self.running.sort(key=lambda r: r.sort_key)
        index = 0
        while index < len(self.running) and budget > 0 and len(chosen) < most:
            request = self.running[index]
            if request.request_id in busy:
                index += 1
                continue
            num_new = min(request.num_step_tokens - request.num_computed_tokens, budget)
            if request.draft:  # a draft the budget cut short is cut to fit
                del request.draft[max(0, num_new - 1) :]
            if not self._allocate_or_preempt(request, num_new, batch.preempted, busy):
                break  # the request itself was the lowest-priority one left
            chosen.append((request, num_new))
            self._note_computing(request, num_new, computing)
            budget -= num_new
            index += 1

        adapters = {r.lora for r in self.running if r.lora is not None}
        deferred = []  # waiting requests whose adapter has no slot this step
        while (
            self.waiting
            and not batch.preempted
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and len(chosen) < most
        ):
            request = self.waiting[0][1]
            lora = request.lora
            if lora is not None and lora not in adapters and len(adapters) >= self.max_loras:
                deferred.append(heapq.heappop(self.waiting))
                continue
            # A request that wants its prompt's logprobs computes the whole prompt.
            wants_logprobs = request.prompt_logprobs is not None
            hit = NO_HIT if wants_logprobs else self.blocks.match_prefix(request)
            if self._being_computed(request, len(hit), computing):
                break  # a running request is computing its next blocks: wait, then share
            num_new = request.num_tokens - len(hit) * self.blocks.block_size
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if self.blocks.allocate(request, num_new, hit) is None:
                break
            heapq.heappop(self.waiting)
            self.blocks.record_prefix_lookup(request, len(hit))
            request.num_computed_tokens = request.num_cached_tokens = (
                len(hit) * self.blocks.block_size
            )
            request.status = Status.RUNNING
            if not request.scheduled_at:  # its first admission
                request.scheduled_at = time.monotonic()
                self.prompt_tokens_cached += request.num_cached_tokens
            self.running.append(request)
            if request.lora is not None:
                adapters.add(request.lora)
            chosen.append((request, num_new))
            self._note_computing(request, num_new, computing)
            budget -= num_new
        for entry in deferred:
            heapq.heappush(self.waiting, entry)

        # Decodes first, shortest first: the attention kernels take the flat batch in that
        # order, and neighbours of similar length share padded attention groups. (A
        # request with a draft computes several tokens: it runs as a prompt chunk does.)
        chosen.sort(key=lambda item: (item[1] != 1, item[0].num_tokens if item[1] == 1 else 0))
        batch.requests = [request for request, _ in chosen]
        batch.num_new_tokens = [n for _, n in chosen]
        batch.block_tables = [self.blocks.block_table(request) for request in batch.requests]
        batch.num_decodes = sum(1 for n in batch.num_new_tokens if n == 1)
        return batch

    def _note_computing(self, request: Request, num_new: int, computing: set[int]) -> None:
        """Add the hashes of the full blocks ``request`` completes this step."""
        if self.blocks.enable_prefix_caching:
            size, start = self.blocks.block_size, request.num_computed_tokens
            computing.update(request.block_hashes[start // size : (start + num_new) // size])

    def _being_computed(self, request: Request, cached_blocks: int, computing: set[int]) -> bool:
        """Whether the first block ``request`` would compute (past its ``cached_blocks``)
        is one a request running this step completes (``computing``): admitted a step
        later, it reads that block from the prefix cache instead (``n`` > 1, or the same
        long prompt sent twice at once: one prefill, not several)."""
        if not computing or request.prompt_logprobs is not None:
            return False
        hashes = request.block_hashes
        return cached_blocks < len(hashes) and hashes[cached_blocks] in computing

    def _allocate_or_preempt(
        self, request: Request, num_new: int, preempted: list[Request], busy: frozenset[str]
    ) -> bool:
        """Allocate for a running request, preempting from the back of ``running`` (past
        the ``busy``) until it fits; False when ``request`` itself had to go."""
        while self.blocks.allocate(request, num_new) is None:
            # Sorted: lowest priority, latest arrival last. ``request`` is not busy.
            last = max(i for i, r in enumerate(self.running) if r.request_id not in busy)
            victim = self.running.pop(last)
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Drop the request's KV; it will be recomputed (prompt plus output so far)."""
        request.draft.clear()
        self._release(request)
        self.num_preemptions += 1
        request.num_preemptions += 1
        self.add(request)

    def _release(self, request: Request) -> None:
        self.blocks.free_request(request)
        request.num_computed_tokens = 0

    def advance(self, batch: ScheduledBatch) -> list[Request]:
        """After ``batch`` ran: its tokens are computed, and the blocks they completed are
        offered to the prefix cache. Returns the requests that have now computed all their
        tokens (and drafts): they sample their next token (or verify their draft)."""
        done = []
        for request, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            request.num_computed_tokens += n
            if request.num_computed_tokens == request.num_step_tokens:
                done.append(request)
            self.blocks.cache_computed_blocks(request)
        return done

    def num_queued_prefill_tokens(self) -> int:
        """Tokens still to prefill: all of each waiting request, the rest of each running
        request's prompt (a decoding request has exactly one token to compute)."""
        waiting = sum(entry[1].num_tokens - entry[1].num_computed_tokens for entry in self.waiting)
        prefilling = sum(
            r.num_tokens - r.num_computed_tokens
            for r in self.running
            if r.num_tokens - r.num_computed_tokens > 1
        )
        return waiting + prefilling
