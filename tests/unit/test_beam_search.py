"""Beam search's step, pinned: which beams grow, which complete, and how they rank."""

from __future__ import annotations

import math

from lamina.services.gateway.beam_search import Beam, extend

EOS = 0


def test_a_step_keeps_the_best_extensions_and_completes_beams_at_eos():
    beams = [Beam((7, 1), -1.0), Beam((7, 2), -2.0)]
    options = [[(3, -0.1), (EOS, -0.2), (4, -3.0)], [(5, -0.05), (6, -0.5)]]
    completed: list[Beam] = []
    kept = extend(beams, options, width=2, eos=EOS, length_penalty=1.0, completed=completed)
    assert kept == [Beam((7, 1, 3), -1.1), Beam((7, 2, 5), -2.05)]
    assert completed == [Beam((7, 1, EOS), -1.2)]
    # Without an EOS (ignore_eos), the EOS token is one more extension.
    kept = extend(beams, options, width=3, eos=None, length_penalty=1.0, completed=[])
    assert [b.tokens for b in kept] == [(7, 1, 3), (7, 1, EOS), (7, 2, 5)]


def test_the_score_is_the_logprob_over_the_length_to_the_penalty():
    beam = Beam((7, 1, 3, EOS), -3.0)
    assert beam.score(EOS, 1.0) == -1.0  # the EOS is not counted
    assert beam.score(None, 1.0) == -0.75
    assert math.isclose(beam.score(EOS, 2.0), -3.0 / 9)
    # A longer beam with the same mean logprob per token ranks higher with a penalty > 1.
    short, long = Beam((1, 2), -2.0), Beam((1, 2, 3, 4), -4.0)
    assert long.score(None, 2.0) > short.score(None, 2.0)
