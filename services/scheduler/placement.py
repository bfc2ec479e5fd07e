"""Admission and placement policy (pure: no I/O).

Placement today is least queued work: a worker's score is the prefill tokens it has
queued plus a decode-equivalent charge per running and waiting request, plus what has
been placed on it since its last heartbeat. KV-aware placement comes later and will add
a prefix-overlap term.
"""

from __future__ import annotations

from dataclasses import dataclass

from lamina.schemas.v1.generate import GenerateRequest, RejectReason, context_overflow
from lamina.schemas.v1.stats import WorkerState
from lamina.services.scheduler.registry import Candidate

#: Prefill tokens one queued request is taken to be worth when comparing load.
REQUEST_WEIGHT_TOKENS = 64


@dataclass(frozen=True)
class Decision:
    worker_id: str | None
    reason: RejectReason | None
    """None when placed."""
    message: str
    candidates: int
    score: float | None = None
    retryable: bool = True


def load_score(entry: Candidate) -> float:
    s = entry.stats
    return (
        s.num_queued_prefill_tokens
        + entry.pending_tokens
        + REQUEST_WEIGHT_TOKENS * (s.num_running + s.num_waiting + entry.pending)
    )


def place(request: GenerateRequest, live: list[Candidate]) -> Decision:
    """Pick the ready worker serving ``request.model`` with the least queued work."""
    if not live:
        return Decision(None, RejectReason.NO_WORKER, "no engine worker is alive", 0)
    serving = [w for w in live if w.stats.model == request.model]
    if not serving:
        models = sorted({w.stats.model for w in live})
        return Decision(
            None,
            RejectReason.MODEL_NOT_FOUND,
            f"no worker serves model {request.model!r}; available: {models}",
            0,
            retryable=False,
        )
    ready = [w for w in serving if w.stats.state == WorkerState.READY]
    if not ready:
        states = ", ".join(sorted({w.stats.state for w in serving}))
        message = f"no worker for this model is ready (their states: {states})"
        return Decision(None, RejectReason.NO_WORKER, message, len(serving))
    prompt, wanted = len(request.prompt_token_ids), request.sampling.max_tokens
    fits = [w for w in ready if not context_overflow(prompt, wanted, w.stats.max_model_len)]
    if not fits:
        longest = max(w.stats.max_model_len for w in ready)
        return Decision(
            None,
            RejectReason.INVALID_REQUEST,
            context_overflow(prompt, wanted, longest) or "",
            len(ready),
            retryable=False,
        )
    best = min(fits, key=lambda w: (load_score(w), w.stats.worker_id))
    return Decision(best.stats.worker_id, None, "", len(fits), load_score(best))
