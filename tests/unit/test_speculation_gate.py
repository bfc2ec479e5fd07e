"""The adaptive speculation gate alone, on synthetic step times: it drafts while a drafted
step is predicted to return more tokens per second than a plain one, from its fit of the
step time over the tokens a step computes and the acceptance it counted."""

from __future__ import annotations

import pytest

from lamina.services.engine_worker.engine.speculative import SpeculationGate


def measured(fixed_s: float, per_token_s: float, widths=range(1, 40)) -> SpeculationGate:
    """A gate that saw decode steps of ``widths`` tokens taking ``fixed + per_token·n``,
    and drafts of 3 tokens with 1.5 accepted on average."""
    gate = SpeculationGate()
    for n in widths:
        gate.observe_step(n, fixed_s + per_token_s * n)
    gate.observe_drafts(drafts=10, draft_tokens=30, accepted=15)
    return gate


def test_a_memory_bound_step_drafts_at_any_batch():
    gate = measured(fixed_s=5e-3, per_token_s=1e-5)  # reading the weights dominates
    assert gate.step_time(10) == pytest.approx(5.1e-3)
    assert all(gate.pays(batch) for batch in (1, 8, 32))


def test_a_compute_bound_step_stops_drafting_when_its_drafts_cost_more_than_they_return():
    gate = measured(fixed_s=1e-3, per_token_s=1e-3)
    # Batch 1: (1 + 1.5) x t(1) = 5 ms against t(4) = 5 ms: even, so it stays on.
    assert gate.pays(1)
    # Batch 8: 2.5 x 9 ms = 22.5 ms of plain steps' worth against t(32) = 33 ms.
    assert not gate.pays(8)
    assert not gate.on
    # Off, it still drafts one step in PROBE_OFF_EVERY, to measure the acceptance again.
    every = SpeculationGate.PROBE_OFF_EVERY
    assert [gate.pays(8) for _ in range(every)] == [False] * (every - 2) + [True, False]
    # Back to batch 1: even again, within the margin, so it stays off (no flapping) ...
    gate.pays(1)
    assert not gate.on
    # ... until the acceptance it sees makes drafting pay clearly.
    gate.observe_drafts(drafts=100, draft_tokens=300, accepted=290)
    assert gate.pays(1) and gate.on


def test_it_drafts_until_it_has_measured_what_it_needs_with_a_plain_step_now_and_then():
    gate = SpeculationGate()
    assert gate.pays(32)  # nothing measured
    for _ in range(50):
        gate.observe_step(40, 9e-3)  # drafted steps of one width: no slope to fit
    gate.observe_drafts(drafts=10, draft_tokens=30, accepted=0)
    assert gate.step_time(40) is None
    every = SpeculationGate.PROBE_EVERY
    assert [gate.pays(10) for _ in range(every)] == [True] * (every - 1) + [False]
    gate.observe_step(10, 8e-3)  # the plain step it asked for gives the fit its slope
    assert gate.step_time(40) == pytest.approx(9e-3, rel=0.01)
    assert not gate.pays(10) and not gate.on  # 3 draft tokens for none accepted: no
    few = SpeculationGate()
    few.observe_step(1, 1e-3)
    few.observe_step(2, 2e-3)
    assert few.step_time(2) is None  # two steps are too few to fit


def test_old_steps_fade():
    """The fit follows the engine: steps long past weigh less than recent ones."""
    gate = measured(fixed_s=1e-3, per_token_s=1e-3)
    for _ in range(20):
        for n in range(1, 40):
            gate.observe_step(n, 5e-3 + 1e-5 * n)  # the machine got idle, or a bigger model
    assert gate.step_time(32) == pytest.approx(5e-3 + 32e-5, rel=0.05)
