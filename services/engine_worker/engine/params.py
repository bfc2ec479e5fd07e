"""How a request samples and why it ends: the engine's own vocabulary.

The wire's ``Sampling`` (``lamina.schemas``) is what a request carries on the bus; the
worker's shell converts it to :class:`SamplingParams` once (``engine_worker.wire``), so the
engine core changes only when sampling itself does, not when a schema evolves. The two
declare the same knobs with the same names and defaults; the wire's ranges are checked
where a message is decoded, :func:`check_params` here are what the engine itself cannot
run outside of (a NaN temperature, a seed no generator takes): a ``SamplingParams`` built
in Python has been through no decoder.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from lamina.services.engine_worker.engine.errors import InvalidRequestError

GREEDY_BELOW = 1e-5
"""A temperature under this is greedy (vLLM's rule): dividing logits by a subnormal one
overflows, and such a request always yielded the same first token and stopped."""

_INT64 = (-(2**63), 2**63 - 1)

# The engine's bounds on each number it samples by: float32 arithmetic on logits
# overflows outside them, or a torch generator refuses the seed. (field, low, high).
_BOUNDS: tuple[tuple[str, float, float], ...] = (
    ("temperature", 0.0, math.inf),
    ("top_k", -1, _INT64[1]),
    ("min_p", 0.0, 1.0),
    ("repetition_penalty", 1e-6, 1e6),
    ("presence_penalty", -2.0, 2.0),
    ("frequency_penalty", -2.0, 2.0),
    ("min_tokens", 0, _INT64[1]),
)
MAX_LOGPROBS = 20
"""Most top alternatives per token the sampler computes."""


class FinishReason(enum.StrEnum):
    """Why a request ended in the engine."""

    STOP = "stop"
    """EOS, a stop token, or a complete structured output."""
    LENGTH = "length"
    """``max_tokens`` or the context length."""


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """How to pick each next token and when to stop (OpenAI's and vLLM's knobs; the
    wire's ``Sampling`` documents each). A structured output constraint is not here: it
    reaches the engine compiled, on the :class:`EngineRequest` (``grammar``)."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

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

    @property
    def has_token_rules(self) -> bool:
        """Tokens biased, allowed or banned by id (not by probability)."""
        return bool(
            self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids
        )


def check_params(params: SamplingParams) -> None:
    """Raise :class:`InvalidRequestError`, naming the field, for a value the engine
    cannot sample by (token ids are checked against the vocabulary apart)."""
    for name, low, high in _BOUNDS:
        _within(name, getattr(params, name), low, high)
    if not 0.0 < params.top_p <= 1.0:  # NaN fails this too
        raise InvalidRequestError(f"top_p ({params.top_p}) must be in (0, 1]", "top_p")
    if params.max_tokens is not None:
        _within("max_tokens", params.max_tokens, 1, _INT64[1])
        if params.min_tokens > params.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({params.min_tokens}) must not exceed max_tokens "
                f"({params.max_tokens})",
                "min_tokens",
            )
    if params.seed is not None:
        _within("seed", params.seed, *_INT64)
    for name in ("logprobs", "prompt_logprobs"):
        if (count := getattr(params, name)) is not None:
            _within(name, count, 0, MAX_LOGPROBS)
    for bias in params.logit_bias.values():
        _within("logit_bias", bias, -100.0, 100.0)
    if params.allowed_token_ids is not None and not params.allowed_token_ids:
        raise InvalidRequestError("allowed_token_ids must not be empty", "allowed_token_ids")
    if any(not word for word in params.bad_words_token_ids):
        raise InvalidRequestError("a bad word must have a token", "bad_words_token_ids")


def _within(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:  # NaN fails this too
        raise InvalidRequestError(f"{name} ({value}) must be in [{low}, {high}]", name)
