"""Worker heartbeats: the engine's contract with placement, admission and telemetry."""

from __future__ import annotations

from lamina.schemas.v1.base import Message, OpenEnum


class WorkerState(OpenEnum):
    """Where a worker is in its life; the worker's transitions are in
    ``engine_worker/lifecycle.py``. Only a ``ready`` worker takes new requests."""

    STARTING = "starting"
    """Loading its model; heartbeats so the cluster sees it coming."""
    READY = "ready"
    """Taking requests."""
    DRAINING = "draining"
    """Finishing what it accepted, taking nothing new (cordoned, or shutting down)."""
    DEGRADED = "degraded"
    """An engine step failed; takes nothing new until an operator sends ``Resume``."""
    FAILED = "failed"
    """Its engine thread is dead or wedged: what it held was failed as retryable; it
    never takes work again (restart it)."""
    UNKNOWN = "unknown"
    """A state this peer does not know: not ready, so nothing is placed there."""


class WorkerStats(Message, gc=False):
    """Published on ``worker.<id>.stats`` every 0.5 s and on state changes."""

    worker_id: str
    model: str
    device: str
    state: WorkerState
    block_size: int
    total_kv_blocks: int
    free_kv_blocks: int
    kv_cache_usage: float
    prefix_cache_hit_ratio: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    timestamp_ms: int
    heartbeat_interval_s: float = 0.5
    state_reason: str = ""
    """Why the worker is in its state when that is not obvious (``degraded``, ``failed``,
    a shutdown drain); empty otherwise."""
    incarnation: str = ""
    """Unique to one run of the worker process (as on its ``KvEventBatch``es): a new one
    under the same id is a restart, so what was known of its cache is dropped."""
    cordoned: bool = False
    """An operator cordoned it: schedulers place nothing new here."""


class ClusterStatusRequest(Message):
    """Ask a scheduler (``sched.status``) for its view of the cluster."""


class WorkerView(Message):
    """A worker as the scheduler sees it."""

    stats: WorkerStats
    alive: bool
    last_seen_ms: int


class ClusterStatus(Message):
    scheduler_id: str
    workers: list[WorkerView]
    queued: int = 0
    """Requests waiting in this scheduler replica's queue."""
    queued_tokens: int = 0
    """Their prompt tokens."""
