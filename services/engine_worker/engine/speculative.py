"""Speculative decoding by prompt lookup (n-gram): what to propose, and for whom.

A decoding request that may speculate gets a *draft*: the tokens that followed the most
recent earlier occurrence of its last few tokens (its prompt and output so far). The
step then computes the request's last token and its draft together, like a chunk of
prompt, and the sampler verifies the draft against the target model's distribution at
each position (``Sampler.verify``): greedy requests keep the longest prefix that equals
their argmax tokens, sampled ones run rejection sampling, which keeps the target
distribution exactly. Either way the step yields the accepted draft tokens plus one
token of the target's own, and the KV of rejected positions is given back.

Prompt lookup needs no second model and costs a search over the request's tokens; it
pays where output repeats its context (code edits, quoting, summaries, loops) and costs a
wider step where it does not. A draft model is the other method peers offer; it is not
built here yet.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Literal

import numpy as np

from lamina.services.engine_worker.engine.request import Request


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config``, in vLLM's shape (a JSON object of these keys)."""

    method: Literal["ngram"] = "ngram"
    """How drafts are made: ``ngram`` (prompt lookup, no second model)."""
    num_speculative_tokens: int = 3
    """Most draft tokens per request per step."""
    prompt_lookup_max: int = 5
    """Longest suffix of a request's tokens looked up (the longest match wins)."""
    prompt_lookup_min: int = 2
    """Shortest suffix looked up: a shorter match proposes nothing."""
    disable_by_batch_size: int | None = None
    """Speculate only in steps with fewer running requests than this (None: always): a
    wide batch is no longer memory-bound, and a rejected draft then costs compute."""

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative method {self.method!r}: only 'ngram' is built")
        if self.num_speculative_tokens <= 0:
            raise ValueError(
                f"num_speculative_tokens ({self.num_speculative_tokens}) must be positive"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) and prompt_lookup_max "
                f"({self.prompt_lookup_max}) must satisfy 1 <= min <= max"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size <= 0:
            raise ValueError(
                f"disable_by_batch_size ({self.disable_by_batch_size}) must be positive"
            )

    def __str__(self) -> str:
        """The JSON that :meth:`parse` reads back."""
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """The config from ``--speculative-config``'s JSON; unknown keys are refused by
        name (a misspelt key must not silently mean the default)."""
        try:
            given = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(given, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(given) - known):
            raise ValueError(
                f"--speculative-config: unknown keys {unknown} (known: {sorted(known)})"
            )
        if "prompt_lookup_max" in given and "prompt_lookup_min" not in given:
            given["prompt_lookup_min"] = min(cls.prompt_lookup_min, given["prompt_lookup_max"])
        return cls(**given)


def may_speculate(request: Request) -> bool:
    """Whether ``request`` may take a draft: its distribution at a draft position must
    not depend on the draft tokens before it in ways verification does not model.
    Penalties, bad words and ``min_tokens`` it models (a row stands for the draft before
    it having been output); not a grammar, prompt logprobs still to send, or a seed (a
    seeded request's draws must not depend on what was proposed)."""
    return request.grammar is None and request.generator is None and request.prompt_logprobs is None


def propose(tokens: list[int], config: SpeculativeConfig, most: int) -> list[int]:
    """Up to ``most`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` (between ``prompt_lookup_min`` and ``prompt_lookup_max`` long)
    found before it; ``[]`` when there is none. The latest occurrence, since what a
    sequence repeats is likelier what it wrote recently."""
    length = len(tokens)
    if most <= 0 or length < config.prompt_lookup_min + 1:
        return []
    seq = np.asarray(tokens)
    # Candidate ends of an earlier occurrence: positions before the last holding its token.
    ends = np.flatnonzero(seq[: length - 1] == seq[-1])
    if not len(ends):
        return []
    longest = min(config.prompt_lookup_max, length - 1)
    matched = np.ones(len(ends), dtype=bool)
    best: np.ndarray | None = None
    for n in range(2, longest + 1):  # extend every candidate's match one token back
        back = ends - (n - 1)
        matched &= back >= 0
        matched[matched] = seq[back[matched]] == seq[length - n]
        if not matched.any():
            break
        if n >= config.prompt_lookup_min:
            best = ends[matched]
    if config.prompt_lookup_min == 1 and best is None:
        best = ends
    if best is None:
        return []
    start = int(best[-1]) + 1
    return seq[start : start + most].tolist()
