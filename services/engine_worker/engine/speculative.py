"""Speculative decoding: its config, prompt lookup (n-gram), and who may speculate.

A decoding request that may speculate gets a *draft*: by prompt lookup (``ngram``), the
tokens that followed the most recent earlier occurrence of its last few tokens (its
prompt and output so far); by a draft model (``draft_model``, ``draft_model.py``), a
smaller checkpoint's greedy continuation. The step then computes the request's last
token and its draft together, like a chunk of prompt, and the sampler verifies the draft
against the target model's distribution at each position (``Sampler.verify``): greedy
requests keep the longest prefix that equals their argmax tokens, sampled ones run
rejection sampling, which keeps the target distribution exactly. Either way the step
yields the accepted draft tokens plus one token of the target's own, and the KV of
rejected positions is given back.

Prompt lookup needs no second model and costs a search over the request's tokens; it
pays where output repeats its context (code edits, quoting, summaries, loops) and costs a
wider step where it does not. A draft model proposes everywhere, at the price of its own
steps.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal

import numpy as np

from lamina.services.engine_worker.engine.request import Request


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config``, in vLLM's shape (a JSON object of these keys)."""

    method: Literal["ngram", "draft_model"] = "ngram"
    """How drafts are made: ``ngram`` (prompt lookup, no second model) or
    ``draft_model`` (the checkpoint ``model``; the default when ``model`` is given)."""
    model: str | None = None
    """The draft model's checkpoint directory (``draft_model`` only): a smaller model of
    the same tokenizer (its vocabulary must equal the target's)."""
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
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(
                f"speculative method {self.method!r}: 'ngram' and 'draft_model' are built"
            )
        if (self.method == "draft_model") != bool(self.model):
            raise ValueError(
                "speculative method 'draft_model' takes a draft checkpoint, 'model', and "
                f"'ngram' none (method {self.method!r}, model {self.model!r})"
            )
        if self.model and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"speculative model {self.model!r}: no config.json there")
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
        if given.get("model") and "method" not in given:  # as vLLM infers it
            given["method"] = "draft_model"
        if "prompt_lookup_max" in given and "prompt_lookup_min" not in given:
            given["prompt_lookup_min"] = min(cls.prompt_lookup_min, given["prompt_lookup_max"])
        return cls(**given)


def may_speculate(request: Request) -> bool:
    """Whether ``request`` may take a draft: its distribution at a draft position must
    not depend on the draft tokens before it in ways verification does not model.
    Penalties, bad words, ``min_tokens`` and a grammar it models (a row stands for the
    draft before it having been output), and a seed (its own draw per row); not prompt
    logprobs still to send."""
    return request.prompt_logprobs is None


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
