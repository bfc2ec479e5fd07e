"""Frozen copies of the v1 wire types as first released: the "old peer" in evolution tests.

Never edit a class here to follow a change in ``lamina/schemas/v1``: this module is what
deployed services compiled against v1 understand, and ``test_evolution.py`` checks that
today's types still talk to it. Only add a class here when a new type is added to v1 (copy
it as released). Names, tags, field order, field types, defaults and struct options (the
ones that shape the wire: ``tag``, ``omit_defaults``, ``array_like``) are exactly v1's.
Docstrings are left out; they are not part of the contract.
"""

from __future__ import annotations

from typing import Annotated

import msgspec


class Message(msgspec.Struct, tag_field="type", tag=lambda name: name, kw_only=True):
    pass


# --- api.py -------------------------------------------------------------------------------


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str


# --- generate.py --------------------------------------------------------------------------


class Sampling(msgspec.Struct, kw_only=True, omit_defaults=True):
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None


class Sla(msgspec.Struct, kw_only=True, omit_defaults=True):
    priority: int = 0
    deadline_ms: int | None = None
    ttft_target_ms: int | None = None


class GenerateRequest(Message):
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    sla: Sla = msgspec.field(default_factory=Sla)
    attempt: int = 0
    worker_id: str | None = None


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class TokenLogprob(msgspec.Struct, array_like=True):
    logprob: float
    top: list[tuple[int, float]]


class Accepted(Message):
    request_id: str
    worker_id: str
    seq: int = 0


class Tokens(Message, gc=False):
    request_id: str
    seq: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


class PromptLogprobs(Message):
    request_id: str
    seq: int
    start: int
    logprobs: list[TokenLogprob]
    ranks: list[int]


class Finished(Message):
    request_id: str
    seq: int
    finish_reason: str
    usage: Usage
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None


class Rejected(Message):
    request_id: str
    reason: str
    message: str
    retryable: bool = False
    param: str | None = None


class Failed(Message):
    request_id: str
    seq: int
    message: str
    retryable: bool
    tokens_sent: bool


class Queued(Message):
    request_id: str
    position: int


StreamEvent = Accepted | PromptLogprobs | Tokens | Finished | Rejected | Failed | Queued


class StreamedEvent(msgspec.Struct, array_like=True, gc=False):
    attempt: str
    event: StreamEvent


class StreamBatch(Message, gc=False):
    events: list[StreamedEvent]


# --- api.py (continued: uses generate.py's structs) ---------------------------------------


class ApiRequest(Message):
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    model: str | None = None
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    sla: Sla = msgspec.field(default_factory=Sla)
    stop: list[str] = []
    request_id: str | None = None


class ApiDelta(Message):
    request_id: str
    seq: int
    text: str
    token_ids: list[int]


class ApiFinished(Message):
    request_id: str
    seq: int
    text: str
    finish_reason: str
    usage: Usage


class ApiError(Message):
    request_id: str | None
    code: int
    error_type: str
    message: str
    param: str | None = None


# --- control.py ---------------------------------------------------------------------------


class Cancel(Message):
    request_id: str


class Drain(Message):
    pass


class Resume(Message):
    pass


class ResetPrefixCache(Message):
    pass


class Ping(Message):  # added in session 6, after the first release of v1
    pass


class Cordon(Message):
    pass


class Uncordon(Message):
    pass


class ControlAck(Message):
    worker_id: str
    ok: bool
    state: str
    message: str = ""


# --- lora.py ------------------------------------------------------------------------------


class LoadLora(Message):  # added in session 53, with run-time LoRA adapters
    name: str
    path: str


class UnloadLora(Message):
    name: str


class LoraAck(Message):
    worker_id: str
    ok: bool
    error: str = "unknown"
    message: str = ""


# --- errors.py ----------------------------------------------------------------------------


class BadMessage(Message):
    subject: str
    error: str


# --- kv.py --------------------------------------------------------------------------------


class BlockStored(Message, frozen=True):
    event_id: int
    parent_hash: int
    block_hashes: list[int]


class BlockRemoved(Message, frozen=True):
    event_id: int
    block_hashes: list[int]


class AllBlocksCleared(Message, frozen=True):
    event_id: int


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(Message):
    worker_id: str
    block_size: int
    events: list[KvEvent]


class KvSyncRequest(Message):
    pass


class KvSnapshot(Message):
    worker_id: str
    incarnation: str
    block_size: int
    next_event_id: int
    block_hashes: list[int]
    part: int = 0
    last: bool = True


# --- records.py ---------------------------------------------------------------------------


class RequestRecord(Message):
    request_id: str
    model: str
    worker_id: str | None
    outcome: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float | None
    e2e_s: float
    inter_token_s: list[float] = []
    attempts: int = 1


class PlacementRecord(Message):
    request_id: str
    worker_id: str | None
    reason: str
    candidates: int
    score: float | None = None
    prefix_hit_blocks: int = 0
    attempt: int = 0


# --- stats.py -----------------------------------------------------------------------------


class WorkerStats(Message, gc=False):
    worker_id: str
    model: str
    device: str
    state: str
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


class ClusterStatusRequest(Message):
    pass


class GatewayAlive(Message):
    gateway_id: str
    inbox_prefix: str
    interval_s: float = 1.0


class WorkerView(Message):
    stats: WorkerStats
    alive: bool
    last_seen_ms: int


class ClusterStatus(Message):
    scheduler_id: str
    workers: list[WorkerView]


class ServiceStarted(Message):
    service: str
    instance: str
    restarts: int = 0


class BusHealth(Message):
    service: str
    instance: str
    errors: int = 0
    disconnects: int = 0
    reconnects: int = 0


# --- kv_transfer.py -----------------------------------------------------------------------


class KvGrant(Message):
    grant_id: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
    token: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
    receiver: str
    block_hashes: list[int]


# --- ranks.py -----------------------------------------------------------------------------


class RanksRequest(Message):
    stage: int


class RankRendezvous(Message):
    worker_id: str
    incarnation: str
    ready: bool
    message: str = ""
    store: str = ""
    host: str = ""
    port: int = 0
    key: str = ""
    digest: str = ""
    timeout_s: float = 0.0
    engine: dict = {}


#: Every frozen message type by name (its wire tag).
MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.__name__: cls
    for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, Message) and cls is not Message
}
