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
    adaptive: bool = False
    """Speculate only while drafting is predicted to pay at the batch the step has, from
    the engine's measured step times and acceptance (:class:`SpeculationGate`); the
    worker says whether it drafts now (``WorkerStats.spec_decode_active``)."""

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
    """``most`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` (between ``prompt_lookup_min`` and ``prompt_lookup_max`` long) found before
    it; ``[]`` when there is none. The latest occurrence, since what a sequence repeats is
    likelier what it wrote recently. Where what followed it runs into the end of
    ``tokens``, the copy goes on from its own start (an overlapping copy, as LZ77's): a
    sequence in a loop of ``p`` tokens is proposed the loop again, not the ``p - 1``
    tokens left before its end."""
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
    copied = seq[start:].tolist()
    while len(copied) < most:  # (an overlapping copy)
        copied += copied[: most - len(copied)]
    return copied[:most]


class SpeculationGate:
    """Whether drafting pays at the current batch (``"adaptive": true``), decided from
    the engine's own measurements rather than a fixed batch size.

    A decode step that computes ``n`` tokens takes ``t(n) = a + b·n``: ``a`` the part
    that does not grow with the tokens (reading the weights, dispatch), ``b`` the part
    that does, fitted by exponentially weighted least squares over decode-only steps
    (drafted or not). Drafting ``k`` tokens for each of ``B`` sequences, of which ``α``
    are accepted on average, turns a step of ``B`` tokens that outputs ``B`` into one of
    ``B(1 + k)`` that outputs ``B(1 + α)``: it pays while ``(1 + α)·t(B) > t(B(1 + k))``.
    A memory-bound step (``a`` large) pays for drafts at any acceptance; a compute-bound
    one only at high acceptance. A margin on each side keeps it from flapping. Until it
    has drafts to count, it drafts; until it has a fit, which needs steps of two widths
    at least, it drafts but for one plain step in :attr:`PROBE_EVERY` (a draft model
    proposes for every request at every step, so without these it would see one width
    only); while off, one step in :attr:`PROBE_OFF_EVERY` drafts all the same, so that
    the acceptance it goes by follows the requests (a sequence that starts unlike its
    context often comes to repeat it)."""

    MIN_WEIGHT = 8.0
    """Decode steps' weight before the fit counts (about that many recent steps)."""
    PROBE_EVERY = 8
    """Without a fit, one decision in this many is a plain step, to measure one."""
    PROBE_OFF_EVERY = 16
    """While off, one decision in this many drafts, to measure the acceptance again (each
    such step costs what drafting does not pay back)."""

    def __init__(
        self, decay: float = 0.98, acceptance_decay: float = 0.9, margin: float = 0.05
    ) -> None:
        self.decay = decay
        """Of the step-time fit, per decode step (about the last fifty count)."""
        self.acceptance_decay = acceptance_decay
        """Of the draft counts, per drafted step (about the last ten count: acceptance
        moves with the requests, and while off only probes measure it)."""
        self.margin = margin
        self.on = True
        self._sums = np.zeros(5)  # weight, Σn, Σt, Σn², Σn·t (decayed)
        self._draft_tokens = 0.0  # per drafted sequence-step (decayed means)
        self._accepted = 0.0
        self._drafted = 0.0
        self._unfit = 0  # decisions made without a fit
        self._off = 0  # decisions made while off

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A decode-only step that computed ``tokens`` tokens in ``seconds``."""
        self._sums = self.decay * self._sums + np.array(
            [1.0, tokens, seconds, tokens * tokens, tokens * seconds]
        )

    def observe_drafts(self, drafts: int, draft_tokens: int, accepted: int) -> None:
        """A step verified ``drafts`` drafts of ``draft_tokens`` tokens in all, of which
        ``accepted`` were accepted."""
        keep = self.acceptance_decay
        self._drafted = keep * self._drafted + drafts
        self._draft_tokens = keep * self._draft_tokens + draft_tokens
        self._accepted = keep * self._accepted + accepted

    def step_time(self, tokens: float) -> float | None:
        """``t(tokens)`` by the fit; None without one (too few steps, or all of one
        width)."""
        w, x, y, xx, xy = self._sums
        spread = w * xx - x * x
        if w < self.MIN_WEIGHT or spread <= 1e-9 * w * xx:
            return None
        slope = max(0.0, (w * xy - x * y) / spread)
        intercept = max(0.0, (y - slope * x) / w)
        return intercept + slope * tokens

    def pays(self, batch: int) -> bool:
        """Whether ``batch`` decoding sequences should draft this step (updates
        :attr:`on`)."""
        if batch <= 0 or self._drafted <= 0:
            return self.on
        k = self._draft_tokens / self._drafted
        alpha = self._accepted / self._drafted
        plain, drafted = self.step_time(batch), self.step_time(batch * (1 + k))
        if plain is None or drafted is None or drafted <= 0:
            self._unfit += 1
            return self.on and self._unfit % self.PROBE_EVERY != 0
        gain = (1 + alpha) * plain / drafted
        if self.on and gain < 1 - self.margin:
            self.on = False
        elif not self.on and gain > 1 + self.margin:
            self.on = True
        if self.on:
            return True
        self._off += 1
        return self._off % self.PROBE_OFF_EVERY == 0
