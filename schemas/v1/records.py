"""Records for telemetry: what happened to each request and each placement."""

from __future__ import annotations

import msgspec

from lamina.schemas.v1.base import Id, Message, OpenEnum
from lamina.schemas.v1.generate import Count, Duration, EngineTimings, FinishReason


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

    request_id: Id
    model: Id
    worker_id: Id | None
    outcome: Outcome
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float | None
    e2e_s: float
    inter_token_s: list[float] = []
    attempts: int = 1
    """Submissions: the first, each retry before a worker accepted, each move."""
    moves: Count = 0
    """Times the accepted request moved to another worker mid-stream (``attempts``
    counts these too)."""
    inexact_moves: Count = 0
    """Of ``moves``, those to a worker whose numerics differ from the first worker's (no
    worker like it could take the stream): the rest of it is not what the first worker
    would have produced."""
    accept_s: Duration | None = None
    """From the gateway's first submission to a worker's ``Accepted``: the scheduler's
    decision, any time in its queue, and the hops (None if no worker accepted)."""
    max_tokens: Count | None = None
    """The request's ``max_tokens`` as the client set it (None: up to the context)."""
    n: Count = 1
    """Sequences the client asked for, on the record of a group's first sequence (0 on
    the others: each sequence is a request of its own, the ``n`` is counted once)."""
    timings: EngineTimings | None = None
    """The engine's phases, from the worker that finished the request."""


PLACED = "placed"
"""``PlacementRecord.reason`` of a request that was placed."""
QUEUED = "queued"
"""``PlacementRecord.reason`` of a request put in the scheduler's queue (a second record
follows when it leaves it)."""


class ScoredWorker(msgspec.Struct, kw_only=True):
    """One candidate worker as placement weighed it."""

    worker_id: Id
    overlap_blocks: int
    """Leading blocks of the prompt in its prefix cache."""
    predicted_ttft_s: float
    """Its queued prefill plus this request's uncached tokens over its measured prefill
    rate, plus its running decodes' share of those steps (``scheduler/placement.py``)."""
    kv_usage: float
    """The fraction of its KV blocks in use, counting this request's uncached blocks."""
    num_running: int
    host_blocks: int = 0
    """Of ``overlap_blocks``, those its host tier holds and its device does not: loaded
    back, not computed."""
    disk_blocks: int = 0
    """Of ``overlap_blocks``, those only its disk tier holds: loaded back, slower."""
    fetch_from: Id = ""
    """The worker it would fetch the prompt's leading blocks from, when a transfer
    predicts the earlier first token (``predicted_ttft_s`` counts it); empty: none."""
    fetch_blocks: int = 0
    """The blocks that transfer would carry."""
    prefill: bool = False
    """``fetch_from`` is a prefill worker that computes those blocks first (the
    request's prefill leg; this worker, its decode leg, computes what is left)."""


class PlacementRecord(Message):
    """scheduler → ``events.placement`` for every placement decision."""

    request_id: Id
    worker_id: Id | None
    """None when the request was rejected."""
    reason: Id
    """:data:`PLACED`, :data:`QUEUED` or the ``RejectReason``."""
    candidates: int
    score: float | None = None
    """What the policy minimised for the chosen worker (``kv``: its predicted TTFT in
    seconds; ``load``: its queued work in tokens)."""
    prefix_hit_blocks: int = 0
    """Leading prompt blocks the chosen worker has cached, by the cluster prefix index."""
    attempt: int = 0
    scheduler_id: Id = ""
    """The replica that decided (replicas count each other's placements as pending)."""
    policy: Id = ""
    """``kv``, ``load`` or ``round-robin``."""
    prompt_tokens: int = 0
    predicted_ttft_s: float | None = None
    """The chosen worker's predicted time to first token (any policy)."""
    scored: list[ScoredWorker] = []
    """Every worker that could take the request, as placement weighed it."""
    timestamp_ms: int = 0
    """Wall-clock time of the decision."""
    decision_s: Duration | None = None
    """How long the decision took (reading the registry and the prefix index, scoring)."""
    queued_s: Duration | None = None
    """Set when the request leaves the scheduler's queue: how long it waited there."""
    queue_depth: Count = 0
    """Requests in this replica's queue after the decision."""
    placed_by: Id = ""
    placement_seq: Count = 0
    """The forward's ``GenerateRequest.placed_by`` and ``placement_seq`` (0: none):
    another replica counts the placement as pending until the worker's heartbeat shows
    it received it."""


class ServiceStarted(Message):
    """gateway, scheduler, worker → ``events.service`` once it serves: telemetry counts
    starts (and so restarts) per service, whatever restarted it (and its own itself: it
    may only listen)."""

    service: Id
    """``gateway``, ``scheduler``, ``worker``, ``telemetry`` or ``stage`` (a worker's
    pipeline stage on another host)."""
    instance: Id
    """Its id (a worker's id, a replica's)."""
    restarts: Count = 0
    """How many times its supervisor (``lamina up``) had restarted it before this start;
    0 where no supervisor counts (one that restarts containers counts on its own)."""


class BusHealth(Message):
    """gateway, scheduler, worker → ``events.service`` when its NATS connection's counters
    changed (checked every few seconds): telemetry shows each process's bus errors and
    reconnects (and its own without the bus: it may only listen)."""

    service: Id
    instance: Id
    errors: Count = 0
    """Errors the client reported (refused publishes, slow consumer, a broken socket)."""
    disconnects: Count = 0
    reconnects: Count = 0
    refused: Count = 0
    """Messages refused as not from whom they claim to be (a stream event from a worker
    that does not hold the attempt, a heartbeat on another worker's subject)."""
