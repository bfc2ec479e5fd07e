"""The worker's state machine: every legal move, and the ones it refuses."""

from __future__ import annotations

import pytest

from lamina.schemas.v1.stats import WorkerState as S
from lamina.services.engine_worker.lifecycle import Event, IllegalTransition, Lifecycle


def at(*events: Event) -> Lifecycle:
    lifecycle = Lifecycle()
    for event in events:
        lifecycle.move(event)
    return lifecycle


def test_a_worker_starts_then_is_ready_and_only_ready_takes_requests():
    lifecycle = Lifecycle()
    assert lifecycle.state == S.STARTING and not lifecycle.taking_requests
    assert lifecycle.move(Event.LOADED) and lifecycle.state == S.READY
    assert lifecycle.taking_requests


def test_drain_and_resume_and_a_failed_step():
    lifecycle = at(Event.LOADED)
    assert lifecycle.move(Event.DRAIN, "drained by an operator")
    assert (lifecycle.state, lifecycle.reason) == (S.DRAINING, "drained by an operator")
    assert not lifecycle.move(Event.DRAIN)  # idempotent
    assert lifecycle.move(Event.RESUME) and (lifecycle.state, lifecycle.reason) == (S.READY, "")
    assert not lifecycle.move(Event.RESUME)
    assert lifecycle.move(Event.STEP_FAILED, "engine step failed")
    assert (lifecycle.state, lifecycle.reason) == (S.DEGRADED, "engine step failed")
    assert lifecycle.move(Event.RESUME) and lifecycle.state == S.READY


def test_resume_cannot_undo_a_shutdown():
    lifecycle = at(Event.LOADED, Event.DRAIN)
    lifecycle.move(Event.SHUTDOWN, "shutting down (SIGTERM)")
    with pytest.raises(IllegalTransition, match="SIGTERM"):
        lifecycle.move(Event.RESUME)
    assert lifecycle.state == S.DRAINING and lifecycle.reason == "shutting down (SIGTERM)"


@pytest.mark.parametrize("before", [(), (Event.LOADED,), (Event.LOADED, Event.DRAIN)])
def test_a_dead_engine_is_final(before):
    lifecycle = at(*before)
    assert lifecycle.move(Event.ENGINE_DEAD, "the engine thread died")
    assert (lifecycle.state, lifecycle.reason) == (S.FAILED, "the engine thread died")
    for event in (Event.RESUME, Event.DRAIN, Event.LOADED, Event.STEP_FAILED, Event.SHUTDOWN):
        with pytest.raises(IllegalTransition):
            lifecycle.move(event)
    assert lifecycle.state == S.FAILED


def test_moves_that_make_no_sense_are_refused():
    with pytest.raises(IllegalTransition, match="Resume is not allowed while the worker is"):
        Lifecycle().move(Event.RESUME)  # still loading its model
    with pytest.raises(IllegalTransition):
        at(Event.LOADED).move(Event.LOADED)
