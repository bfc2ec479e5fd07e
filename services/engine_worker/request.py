"""Sampling parameters and the engine's per-request state."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from lamina.libs.block_hash import ROOT_HASH, hash_blocks
from lamina.services.engine_worker.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop (OpenAI and vLLM semantics)."""

    max_tokens: int | None = 16
    """Most tokens to generate; ``None`` means up to the model's context length."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy."""
    top_k: int = 0
    """Keep the ``top_k`` most likely tokens; 0 or -1 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches ``top_p``."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely one."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of tokens already in prompt or output."""
    presence_penalty: float = 0.0
    """Subtract from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """Subtract, per occurrence, from the logit of tokens already generated."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever the batch."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the request (the model's EOS always does unless ignored)."""
    ignore_eos: bool = False
    """Keep generating past EOS."""
    min_tokens: int = 0
    """Suppress EOS and stop tokens until this many tokens exist."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives (0: just the token)."""

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> InvalidRequestError:
            return InvalidRequestError(name, f"{name} ({getattr(self, name)!r}) {rule}")

        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise bad("temperature", "must be a finite number >= 0")
        if self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (disabled) or positive")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise bad("repetition_penalty", "must be a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def has_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence in the engine. Its only progress measure is ``num_computed_tokens``
    catching up with ``len(token_ids)``: prefill and decode are the same thing."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    """Resolved from ``params.max_tokens`` and the context length."""
    priority: int = 0
    """Lower values are served first and preempted last."""
    arrival: int = 0
    """Engine-wide admission counter; breaks priority ties (earlier first)."""
    token_ids: list[int] = field(default_factory=list)
    """Prompt then output tokens."""
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    """Chained hashes of every full block of ``token_ids``."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at (last) admission."""
    status: Status = Status.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    """Per-request generator when the request carries a seed."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: priority, then arrival."""
        return (self.priority, self.arrival)

    def update_block_hashes(self, block_size: int) -> None:
        """Extend ``block_hashes`` over any blocks of ``token_ids`` that became full."""
        start = len(self.block_hashes) * block_size
        if self.num_tokens - start >= block_size:
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
            self.block_hashes += hash_blocks(self.token_ids, block_size, parent, start)
