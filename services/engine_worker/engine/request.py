"""A request as the engine takes it (:class:`EngineRequest`) and as it holds it
(:class:`Request`)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from lamina.libs.block_hash import ROOT_HASH, hash_blocks
from lamina.services.engine_worker.engine.grammar import GrammarState
from lamina.services.engine_worker.engine.params import SamplingParams

RankedLogprob = tuple[float, int, list[tuple[int, float]]]
"""A prompt token's logprob, its rank (1: the most likely) and the top alternatives."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRequest:
    """A request checked against one engine: what :meth:`Engine.add` takes. Made by
    :meth:`EngineSpec.request` (the one place a request is checked), never by hand."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    """``params.max_tokens``, or what the context leaves when that is None."""
    priority: int = 0
    """Lower values are served first and preempted last."""
    deadline_ms: int | None = None
    """Unix ms; within a priority, earlier deadlines are served first (None: last)."""
    replayed: int = 0
    """The last this-many prompt tokens are output the request produced elsewhere before
    it moved: penalties count them as output, a seeded generator skips their draws."""
    grammar: GrammarState | None = None
    """Its structured output constraint, advanced past the output it replays."""
    lora: str | None = None
    """The LoRA adapter it runs with (None: the base model)."""


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
    deadline_ms: int | None = None
    """Unix ms; within a priority, earlier deadlines are served first (None: last)."""
    arrival: int = 0
    """Engine-wide admission counter; breaks priority ties (earlier first)."""
    token_ids: list[int] = field(default_factory=list)
    """Prompt then output tokens."""
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache; written by the scheduler only. The blocks that
    hold them are the block manager's (``BlockManager.block_table``)."""
    block_hashes: list[int] = field(default_factory=list)
    """Chained hashes of every full block of ``token_ids``."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at (last) admission (the scheduler's)."""
    status: Status = Status.WAITING
    generator: torch.Generator | None = None
    """Per-request generator when the request carries a seed."""
    num_replayed: int = 0
    """The last this-many prompt tokens are output produced before the request moved."""
    pending_draws: int = 0
    """Draws of ``generator`` the tokens it replays took where they were sampled: the
    sampler skips them before its next draw, so a seeded stream continues exactly."""
    queued_at: float = 0.0
    """``time.monotonic()`` when the engine took it; the other times are on that clock."""
    scheduled_at: float = 0.0
    """When it first ran in a step (0: not yet; preemptions do not move it)."""
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    num_preemptions: int = 0
    grammar: GrammarState | None = None
    """Where its structured output constraint stands (None: unconstrained)."""
    draft: list[int] = field(default_factory=list)
    """Tokens proposed to follow ``token_ids`` (speculative decoding), for this step
    only: computed after the last token and verified by the sampler (the engine's)."""
    draft_stale_from: int | None = None
    """The first position whose KV in a draft model's pool a step left behind (it ran
    without the draft model: the speculation gate held drafts off); the request's next
    draft catches up from there. None: the draft's KV follows the target's."""
    prompt_logprobs: dict[int, RankedLogprob] | None = None
    """While its prompt logprobs are wanted and not yet sent: those computed so far, by
    prompt position. Such a request computes its prompt, never reads the prefix cache."""
    lora: str | None = None
    """The LoRA adapter it runs with (None: the base model)."""
    root_hash: int = ROOT_HASH
    """The parent of its first block's hash (``block_hash.root_hash`` of ``lora``)."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_step_tokens(self) -> int:
        """Tokens with a place in the KV this step: ``token_ids`` and the draft."""
        return len(self.token_ids) + len(self.draft)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def generated_token_ids(self) -> list[int]:
        """Output here and, before it moved, elsewhere: what penalties count."""
        return self.token_ids[len(self.prompt_token_ids) - self.num_replayed :]

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: priority, then earliest deadline, then arrival (the reverse
        is the preemption order)."""
        deadline = math.inf if self.deadline_ms is None else self.deadline_ms
        return (self.priority, deadline, self.arrival)

    def update_block_hashes(self, block_size: int) -> None:
        """Extend ``block_hashes`` over any blocks of ``token_ids`` that became full."""
        start = len(self.block_hashes) * block_size
        if self.num_tokens - start >= block_size:
            parent = self.block_hashes[-1] if self.block_hashes else self.root_hash
            self.block_hashes += hash_blocks(self.token_ids, block_size, parent, start)
