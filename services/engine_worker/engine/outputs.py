"""What the engine reports: each step's result, each request's output, its load.

``Engine.step`` returns a :class:`StepResult`; the worker's shell alone turns it into
wire events and spans (``engine_worker.streams``, ``engine_worker.step_tracing``)."""

from __future__ import annotations

from dataclasses import dataclass

from lamina.services.engine_worker.engine.batch_scheduler import ScheduledBatch
from lamina.services.engine_worker.engine.params import FinishReason
from lamina.services.engine_worker.engine.request import RankedLogprob
from lamina.services.engine_worker.engine.sampler import SampledLogprob

STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""Upper bounds of the histogram of tokens per step (:attr:`EngineStats.iteration_tokens`),
vLLM's ``iteration_tokens_total`` buckets."""


@dataclass(frozen=True, slots=True)
class Timings:
    """Where a finished request's time went here (the engine's monotonic clock; vLLM's
    phases: queue, prefill, decode)."""

    queued_s: float
    """From the engine taking the request to its first step."""
    prefill_s: float
    """From its first step to its first token (preemptions included)."""
    decode_s: float
    """From its first token to its last."""
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampledLogprob] | None
    finished: bool
    finish_reason: FinishReason | None  # set once finished, unless it failed
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    """Why this request failed on its own (its batch mates went on); it is finished."""
    timings: Timings | None = None
    """Set once it finished (not failed): where its time went here."""
    prompt_logprobs: list[RankedLogprob] | None = None
    """With its first token, if asked for: the logprobs of prompt tokens 1, 2, ..."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """One step: what ran (``batch``, the step's input) and what it produced."""

    batch: ScheduledBatch
    """The requests the step ran and the tokens of each (and who was preempted for it)."""
    outputs: list[RequestOutput]
    """The requests that produced a token or ended, in batch order."""
    kv_usage: float
    """The KV pool's fraction in use after the step."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's load and cache state: what placement and admission decide on. The
    names are the wire's ``WorkerStats``', which carries them as they are; all zero
    before the engine exists."""

    num_running: int = 0
    num_waiting: int = 0
    total_kv_blocks: int = 0
    free_kv_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_queued_prefill_tokens: int = 0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    prompt_tokens_cached: int = 0
    iteration_tokens: tuple[int, ...] = ()
    """Steps by tokens computed, in :data:`STEP_TOKEN_BUCKETS` (and one above the last)."""
    iteration_tokens_sum: int = 0
    host_kv_blocks: int = 0
    """The host tier's capacity, in blocks (0: none)."""
    host_kv_blocks_used: int = 0
    host_kv_loads_total: int = 0
    """Blocks loaded back from the host tier instead of computed."""
    host_kv_saves_total: int = 0
    """Evicted blocks saved to the host tier."""
    host_kv_load_blocks_per_s: float = 0.0
    """How fast this rank's loads from the host tier ran, where it times them."""
    disk_kv_blocks: int = 0
    """The disk tier's capacity, in blocks (0: none)."""
    disk_kv_blocks_used: int = 0
    disk_kv_loads_total: int = 0
    """Blocks loaded back from the disk tier instead of computed."""
    disk_kv_saves_total: int = 0
    """Blocks saved to the disk tier (evicted from the host tier, or from the device
    where there is none)."""
    disk_kv_load_blocks_per_s: float = 0.0
    """How fast this rank's loads from the disk tier ran, where it times them."""
    spec_decode_active: bool = False
    spec_decode_num_drafts: int = 0
    """Drafts verified (speculative decoding: one per drafted request per step)."""
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    """Accepted draft tokens by their position in the draft (the first, second, ...)."""
    lora_adapters: tuple[str, ...] = ()
    """The LoRA adapters it holds."""
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()

    @property
    def prefix_cache_hit_ratio(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )
