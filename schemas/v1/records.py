"""Records for telemetry: what happened to each request and each placement."""

from __future__ import annotations

from lamina.schemas.v1.base import Message, OpenEnum
from lamina.schemas.v1.generate import FinishReason


class Outcome(OpenEnum):
    """How a request ended, as the gateway saw it."""

    FINISHED = "finished"
    """Generated to a finish reason."""
    REJECTED = "rejected"
    """Never ran: refused, or no worker took it."""
    FAILED = "failed"
    """Broke after a worker accepted it."""
    CANCELLED = "cancelled"
    """The client went away first."""
    UNKNOWN = "unknown"
    """An outcome this peer does not know; counted under that name."""


class RequestRecord(Message):
    """gateway → ``events.request`` when a request ends, one way or another."""

    request_id: str
    model: str
    worker_id: str | None
    outcome: Outcome
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float | None
    e2e_s: float
    inter_token_s: list[float] = []
    attempts: int = 1


PLACED = "placed"
"""``PlacementRecord.reason`` of a request that was placed."""


class PlacementRecord(Message):
    """scheduler → ``events.placement`` for every placement decision."""

    request_id: str
    worker_id: str | None
    """None when the request was rejected."""
    reason: str
    """:data:`PLACED` or the ``RejectReason``."""
    candidates: int
    score: float | None = None
    prefix_hit_blocks: int = 0
    attempt: int = 0
