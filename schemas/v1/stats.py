"""Worker heartbeats: the engine's contract with placement, admission and telemetry."""

from __future__ import annotations

from typing import Annotated

import msgspec

from lamina.schemas.v1.base import Id, Message, OpenEnum, Text
from lamina.schemas.v1.generate import INT64_MAX, Count

# A heartbeat is believed only within these bounds (a forged one with a negative load or
# interval fails to decode and is dropped, so it cannot draw traffic).
Size = Annotated[int, msgspec.Meta(gt=0, le=INT64_MAX)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Rate = Annotated[float, msgspec.Meta(ge=0.0, le=1e12)]
Interval = Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)]


MAX_LORAS = 1024
"""Most adapters a heartbeat may name in one list."""

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""Upper bounds of ``WorkerStats.iteration_tokens``' buckets (vLLM's, for its
``iteration_tokens_total``); a last bucket takes what is above them."""


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


class WorkerRole(OpenEnum):
    """What a worker is placed for (``--role``): disaggregated serving splits a request
    into a prefill leg and a decode leg on different workers."""

    MIXED = "mixed"
    """Both: it runs a request whole (the default)."""
    PREFILL = "prefill"
    """Prefill legs: it computes prompts' KV for decode workers to fetch (requests are
    placed on it whole only when no other worker serves the model)."""
    DECODE = "decode"
    """Decode legs: a prefill worker computes its requests' prompts when one has room
    (it computes a prompt itself otherwise, and a short prompt always)."""
    UNKNOWN = "unknown"
    """A role this peer does not know: taken as ``mixed``."""


MAX_RANKS = 1024
"""Most ranks a heartbeat may list (a hostile one listing more fails to decode)."""
MAX_PLACERS = 64
"""Most placers (scheduler processes) a heartbeat may report on."""


class Rank(msgspec.Struct, kw_only=True):
    """One process of a worker's model (``WorkerStats.ranks``)."""

    rank: Count
    host: Id
    device: Id
    """Its torch device (``cuda:1``, ``cpu``)."""
    pid: Count
    stage: Count = 0
    """Its pipeline stage."""
    weight_bytes: Count
    """Bytes of its share of the weights."""
    kv_bytes: Count
    """Bytes of its share of the KV pool."""


class WorkerStats(Message, gc=False):
    """Published on ``worker.<id>.stats`` every 0.5 s and on state changes."""

    worker_id: Id
    model: Id
    device: Id
    state: WorkerState
    block_size: Size
    total_kv_blocks: Count
    free_kv_blocks: Count
    kv_cache_usage: Fraction
    prefix_cache_hit_ratio: Fraction
    prefix_cache_queries: Count
    prefix_cache_hits: Count
    num_running: Count
    num_waiting: Count
    num_queued_prefill_tokens: Count
    max_num_batched_tokens: Size
    max_num_seqs: Size
    max_model_len: Count
    prefill_tokens_per_s: Rate
    decode_tokens_per_s: Rate
    num_preemptions: Count
    prompt_tokens_total: Count
    generation_tokens_total: Count
    timestamp_ms: Count
    heartbeat_interval_s: Interval = 0.5
    state_reason: Text = ""
    """Why the worker is in its state when that is not obvious (``degraded``, ``failed``,
    a shutdown drain); empty otherwise."""
    incarnation: Id = ""
    """Unique to one run of the worker process (as on its ``KvEventBatch``es): a new one
    under the same id is a restart, so what was known of its cache is dropped."""
    cordoned: bool = False
    """An operator cordoned it: schedulers place nothing new here."""
    prompt_tokens_cached: Count = 0
    """Prompt tokens served from the prefix cache, counted once per request at its
    first admission (cumulative)."""
    iteration_tokens: list[Count] = []
    """Engine steps by the tokens each computed, over the worker's life: the steps of each
    bucket of :data:`ITERATION_TOKEN_BUCKETS` (above the previous bound, up to its
    own), then those above the last bound."""
    iteration_tokens_sum: Count = 0
    """Tokens computed over all those steps."""
    kv_cache_dtype: Id = ""
    """The KV cache's element type as configured (``auto``: the model's dtype)."""
    enable_prefix_caching: bool = True
    dtype: Id = ""
    """The activations' dtype (``float32``, ``bfloat16``, ``float16``)."""
    weight_dtype: Id = ""
    """What the linears' weights are stored as: ``dtype``, or a quantized format
    (``int8``, ``fp8``)."""
    tensor_parallel_size: Size = 1
    """Processes the model is split across (by attention heads and MLP columns). The
    worker is one target however many: it schedules, samples and reports for them all."""
    pipeline_parallel_size: Size = 1
    """Stages the model's layers are split across, each of ``tensor_parallel_size``
    ranks."""
    ranks: Annotated[list[Rank], msgspec.Meta(max_length=MAX_RANKS)] = []
    """Each of them once loaded, rank 0 (the worker's own process) first."""
    host_kv_blocks: Count = 0
    """Its KV host tier's capacity in blocks (``--kv-offload-bytes``; 0: none): prefix
    blocks evicted from the device wait there to be loaded back."""
    host_kv_blocks_used: Count = 0
    host_kv_loads_total: Count = 0
    """Blocks loaded back from the host tier instead of computed (cumulative)."""
    host_kv_saves_total: Count = 0
    """Evicted blocks saved to the host tier (cumulative)."""
    host_kv_load_blocks_per_s: Rate = 0.0
    """Blocks per second its loads from the host tier took, measured (0: not measured:
    no load yet, or copies queued on a GPU stream, which the host does not time)."""
    disk_kv_blocks: Count = 0
    """Its KV disk tier's capacity in blocks (``--kv-offload-disk-bytes``; 0: none):
    blocks the host tier evicts (or the device, with no host tier) wait there."""
    disk_kv_blocks_used: Count = 0
    disk_kv_loads_total: Count = 0
    """Blocks loaded back from the disk tier instead of computed (cumulative)."""
    disk_kv_saves_total: Count = 0
    """Blocks saved to the disk tier (cumulative)."""
    disk_kv_load_blocks_per_s: Rate = 0.0
    """Blocks per second its loads from the disk tier took, measured (as
    ``host_kv_load_blocks_per_s``)."""
    kv_layout: Id = ""
    """``block_size/dtype/layers/KV heads/head dim`` of its whole KV blocks (a parallel
    worker's ranks' shares move together): blocks move only between workers whose
    layouts are equal, however each is split. Empty: its KV cannot move (an older
    worker)."""
    kv_address: Id = ""
    """``host:port`` its KV transfer listener takes receivers on (empty: it sends none)."""
    kv_fetches_total: Count = 0
    """Requests whose leading blocks it fetched from another worker (cumulative)."""
    kv_fetch_failures_total: Count = 0
    """Fetches that failed or timed out: those requests computed their prefix here."""
    kv_fetched_blocks_total: Count = 0
    kv_sent_blocks_total: Count = 0
    """Blocks it sent to other workers (cumulative)."""
    kv_fetch_blocks_per_s: Rate = 0.0
    """Blocks per second its last fetch took, from its request to the blocks imported
    (0: none yet): placement's transfer rate for it."""
    role: WorkerRole = WorkerRole.MIXED
    kv_prefills_total: Count = 0
    """Prefill legs it computed for other workers (cumulative)."""
    spec_decode_active: bool = False
    """Whether its decoding requests draft now: speculative decoding is on, under
    ``disable_by_batch_size``, and (``"adaptive": true``) predicted to pay at its batch."""
    spec_decode_num_drafts: Count = 0
    """Drafts it verified (speculative decoding, ``--speculative-config``: one per
    drafted request per step; cumulative, as the three below)."""
    spec_decode_num_draft_tokens: Count = 0
    spec_decode_num_accepted_tokens: Count = 0
    """Draft tokens the target model accepted: with the drafts, its acceptance rate, and
    its tokens per step a drafted request makes (``1 + accepted / drafts``)."""
    spec_decode_num_accepted_tokens_per_pos: Annotated[
        list[Count], msgspec.Meta(max_length=64)
    ] = []
    """Accepted draft tokens by position in the draft (the first, the second, ...)."""
    lora_adapters: Annotated[list[Id], msgspec.Meta(max_length=MAX_LORAS)] = []
    """The LoRA adapters of its model it holds: a request naming one as its ``model``
    may run here (``--lora-modules``)."""
    max_loras: Count = 0
    """Adapters one of its steps may use at once (0: it serves no adapters)."""
    running_lora_adapters: Annotated[list[Id], msgspec.Meta(max_length=MAX_LORAS)] = []
    """Adapters of its running requests (vLLM's ``lora_requests_info``)."""
    waiting_lora_adapters: Annotated[list[Id], msgspec.Meta(max_length=MAX_LORAS)] = []
    """Adapters of its waiting requests."""
    placements_seen: Annotated[dict[Id, Count], msgspec.Meta(max_length=MAX_PLACERS)] | None = None
    """The last ``GenerateRequest.placement_seq`` it received from each recent placer
    (``placed_by``), as of this heartbeat: the placements its counts include. What a
    scheduler placed here later is still on its way, and counted as pending. None: a
    worker that predates the numbers (each heartbeat ends every count, as it did)."""

    def serves(self, model: str) -> bool:
        """Whether a request naming ``model`` may run here: its model or an adapter."""
        return model == self.model or model in self.lora_adapters

    def numerics(self) -> str:
        """What a stream's tokens depend on beyond the model and the request: the device
        type, the activations' and weights' dtypes, the KV cache's, and how many ranks
        sum each layer's products (in parts, rounded differently). Two workers with the
        same compute the same greedy tokens; a stream moved between different ones
        continues, but not as the first worker would have."""
        device = self.device.split(":")[0]
        numerics = f"{device}/{self.dtype}/{self.weight_dtype}/{self.kv_cache_dtype}"
        return (
            numerics
            if self.tensor_parallel_size == 1
            else f"{numerics}/tp{self.tensor_parallel_size}"
        )


class GatewayAlive(Message):
    """Published on ``gateway.<id>.alive`` every ``interval_s``: the requests whose reply
    subjects start with ``inbox_prefix`` still have someone to stream to. A worker stops
    those requests once the heartbeats stop (three intervals), instead of generating
    into a dead inbox until ``max_tokens``."""

    gateway_id: Id
    inbox_prefix: Id
    interval_s: Interval = 1.0
    stream_batches: bool = False
    """It reads a ``StreamBatch`` (several streams' events in one message) on
    ``subjects.stream_batch``: a worker sends it those instead of one message per stream
    (False: a gateway that predates them gets one message per event)."""


class ClusterStatusRequest(Message):
    """Ask a scheduler (``sched.status``) for its view of the cluster."""


class WorkerView(Message):
    """A worker as the scheduler sees it."""

    stats: WorkerStats
    alive: bool
    last_seen_ms: int
    quarantined: bool = False
    """This replica places nothing on it: a request it placed there was resubmitted, and
    the worker has not answered a ping since (it may be alive but unreachable one way)."""


class ClusterStatus(Message):
    scheduler_id: Id
    workers: list[WorkerView]
    queued: int = 0
    """Requests waiting in this scheduler replica's queue."""
    queued_tokens: int = 0
    """Their prompt tokens."""
