"""The scheduler's queue of requests that no worker has room for yet (pure: no I/O).

Ordered by priority (lower first), then due time (earliest first; none last), then
arrival. A request is due at its deadline or, sooner, at its arrival plus its TTFT target:
within a priority, the queue serves whoever's first token is needed soonest. Bounded in
requests and in prompt tokens: a request that does not fit is refused at once rather
than queued behind work that cannot drain in time.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from lamina.schemas.v1.generate import GenerateRequest


@dataclass(order=True)
class Waiting:
    """A queued request with its reply subject."""

    key: tuple[int, float, int]
    request: GenerateRequest = field(compare=False)
    reply: str = field(compare=False)
    queued_at: float = field(compare=False)
    """Monotonic time it was queued."""
    context: Any = field(default=None, compare=False)
    """What it arrived in (its trace context), to be sent on in it: opaque here."""


class AdmissionQueue:
    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.tokens = 0
        """Prompt tokens of every queued request."""
        self._heap: list[Waiting] = []
        self._ids: dict[str, Waiting] = {}
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def push(
        self, request: GenerateRequest, reply: str, now: float, now_ms: int, context: Any = None
    ) -> bool:
        """Queue ``request`` (``now``: monotonic seconds, ``now_ms``: Unix ms; ``context``
        comes back with it); False, queueing nothing, when it would exceed a bound."""
        tokens = len(request.prompt_token_ids)
        if len(self) >= self.max_requests or self.tokens + tokens > self.max_tokens:
            return False
        sla = request.sla
        due = min(
            math.inf if sla.deadline_ms is None else sla.deadline_ms,
            math.inf if sla.ttft_target_ms is None else now_ms + sla.ttft_target_ms,
        )
        key = (sla.priority, due, next(self._arrivals))
        waiting = Waiting(key, request, reply, now, context)
        heapq.heappush(self._heap, waiting)
        self._ids[request.request_id] = waiting
        self.tokens += tokens
        return True

    def peek(self) -> Waiting | None:
        self._skip_removed()
        return self._heap[0] if self._heap else None

    def pop(self) -> Waiting:
        self._skip_removed()
        waiting = heapq.heappop(self._heap)
        self._forget(waiting)
        return waiting

    def position(self, request_id: str) -> int:
        """0 for the head of the queue."""
        target = self._ids[request_id]
        return sum(1 for w in self._ids.values() if w.key < target.key)

    def remove(self, request_id: str) -> Waiting | None:
        """Take a request out (its client went away); None if it is not queued."""
        waiting = self._ids.get(request_id)
        if waiting is not None:
            self._forget(waiting)
        return waiting

    def expired(self, now_ms: int, now: float, max_wait_s: float) -> list[Waiting]:
        """Take out every request whose deadline has passed or that waited longer than
        ``max_wait_s``."""
        gone = [
            w
            for w in self._ids.values()
            if (w.request.sla.deadline_ms or math.inf) <= now_ms or now - w.queued_at > max_wait_s
        ]
        for waiting in gone:
            self._forget(waiting)
        return gone

    def _forget(self, waiting: Waiting) -> None:
        # Removed entries stay in the heap until they reach its head (lazy deletion).
        if self._ids.get(waiting.request.request_id) is waiting:
            del self._ids[waiting.request.request_id]
            self.tokens -= len(waiting.request.prompt_token_ids)

    def _skip_removed(self) -> None:
        while self._heap and self._ids.get(self._heap[0].request.request_id) is not self._heap[0]:
            heapq.heappop(self._heap)
