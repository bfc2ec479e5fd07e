"""Records for telemetry: what happened to each request and each placement."""

from __future__ import annotations

from lamina.schemas.v1.base import Message


class RequestRecord(Message):
    """gateway → ``events.request`` when a request ends, one way or another."""

    request_id: str
    model: str
    worker_id: str | None
    outcome: str
    """``finished``, ``rejected``, ``failed`` or ``cancelled``."""
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float | None
    e2e_s: float
    inter_token_s: list[float] = []
    attempts: int = 1


class PlacementRecord(Message):
    """scheduler → ``events.placement`` for every placement decision."""

    request_id: str
    worker_id: str | None
    """None when the request was rejected."""
    reason: str
    """``placed`` or the rejection reason."""
    candidates: int
    score: float | None = None
    prefix_hit_blocks: int = 0
    attempt: int = 0
