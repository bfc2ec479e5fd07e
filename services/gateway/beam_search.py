"""Beam search (vLLM's ``use_beam_search``), run by the gateway over the engine's
one-token steps and its prefix cache.

vLLM runs beam search in its front end the same way: each step asks the engine for one
token of every live beam with its ``2 * width`` most likely next tokens, and keeps the
``width`` best extensions; a beam that ends in EOS is complete. Every beam's prompt is its
parent's plus one token, so the worker's prefix cache holds all but that token, and the
beams of one request share their blocks (they are placed together, one affinity). A
beam's score is its cumulative logprob over its length (prompt included, the EOS not) to
the power ``length_penalty`` (vLLM's ``get_beam_search_score``).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from lamina.schemas.v1.generate import FinishReason, Sampling, Sla
from lamina.services.gateway.intake import Caller, Intake, Sequence
from lamina.services.gateway.replies import whole


@dataclass(frozen=True, slots=True)
class Beam:
    """A candidate sequence: the prompt and the tokens chosen after it."""

    tokens: tuple[int, ...]
    logprob: float = 0.0
    """The chosen tokens' logprobs, summed."""

    def score(self, eos: int | None, length_penalty: float) -> float:
        length = len(self.tokens) - (1 if self.tokens[-1] == eos else 0)
        return self.logprob / length**length_penalty


def extend(
    beams: list[Beam],
    options: list[list[tuple[int, float]]],
    width: int,
    eos: int | None,
    length_penalty: float,
    completed: list[Beam],
) -> list[Beam]:
    """One step: each beam grown by each of its ``options`` (token, logprob); those ending
    in ``eos`` join ``completed``; the ``width`` best of the rest go on."""
    grown = []
    for beam, choices in zip(beams, options, strict=True):
        for token, logprob in choices:
            child = Beam((*beam.tokens, token), beam.logprob + logprob)
            (completed if token == eos else grown).append(child)
    grown.sort(key=lambda b: b.score(eos, length_penalty), reverse=True)
    return grown[:width]


@dataclass(frozen=True)
class Found:
    """A finished beam, as a choice: its generated tokens and why it ended."""

    token_ids: list[int]
    finish_reason: FinishReason


async def search(
    intake: Intake,
    model: str | None,
    prompt: list[int],
    *,
    width: int,
    max_tokens: int,
    length_penalty: float,
    ignore_eos: bool,
    sla: Sla,
    caller: Caller,
) -> list[Found]:
    """The ``width`` best beams after ``prompt``, best first. Each step is an ordinary
    intake of the live beams (one token each, greedy, ``2 * width`` logprobs), so
    every refusal is the ``GenerationError`` a request would get."""
    eos = None if ignore_eos else intake.tokenizer.eos_token_id
    step = Sampling(max_tokens=1, temperature=0.0, logprobs=2 * width, ignore_eos=True)
    live, completed = [Beam(tuple(prompt))], []
    affinity = uuid.uuid4().hex
    for _ in range(max_tokens):
        if not live:
            break
        sequences = [Sequence(list(beam.tokens), step, affinity=affinity) for beam in live]
        streams = await intake.start(model, sequences, sla, [], caller=caller)
        try:
            deltas = await asyncio.gather(*(whole(stream) for stream in streams))
        finally:
            for stream in streams:
                intake.close_later(stream)
        options = []
        for delta in deltas:
            (scored,) = delta.logprobs or ()
            chosen = {delta.token_ids[0]: scored.logprob}
            options.append(list((chosen | dict(scored.top)).items()))
        live = extend(live, options, width, eos, length_penalty, completed)
    best = sorted([*completed, *live], key=lambda b: b.score(eos, length_penalty), reverse=True)
    return [
        Found(
            list(beam.tokens[len(prompt) :]),
            FinishReason.STOP if beam.tokens[-1] == eos else FinishReason.LENGTH,
        )
        for beam in best[:width]
    ]
