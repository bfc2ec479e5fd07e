"""The worker's state machine: the one place its state changes (pure: no I/O).

Only a ``ready`` worker takes new requests. An operator moves it between ``ready`` and
``draining`` (``Drain`` / ``Resume``); a failed engine step makes it ``degraded`` until
``Resume``; SIGTERM drains it for good (``Resume`` is then refused); a dead or wedged
engine thread makes it ``failed``, which nothing leaves.
"""

from __future__ import annotations

import enum

from lamina.schemas.v1.stats import WorkerState

S = WorkerState


class Event(enum.Enum):
    LOADED = "the model is loaded"
    DRAIN = "Drain"
    RESUME = "Resume"
    STEP_FAILED = "an engine step failed"
    SHUTDOWN = "SIGTERM"
    ENGINE_DEAD = "the engine thread is gone"


_MOVES: dict[tuple[WorkerState, Event], WorkerState] = {
    (S.STARTING, Event.LOADED): S.READY,
    (S.READY, Event.DRAIN): S.DRAINING,
    (S.DEGRADED, Event.DRAIN): S.DRAINING,
    (S.DRAINING, Event.DRAIN): S.DRAINING,
    (S.READY, Event.RESUME): S.READY,
    (S.DRAINING, Event.RESUME): S.READY,
    (S.DEGRADED, Event.RESUME): S.READY,
    (S.READY, Event.STEP_FAILED): S.DEGRADED,
    (S.DEGRADED, Event.STEP_FAILED): S.DEGRADED,
    (S.DRAINING, Event.STEP_FAILED): S.DRAINING,  # it takes nothing new either way
    **{(state, Event.SHUTDOWN): S.DRAINING for state in (S.STARTING, S.READY, S.DEGRADED)},
    (S.DRAINING, Event.SHUTDOWN): S.DRAINING,
    **{(state, Event.ENGINE_DEAD): S.FAILED for state in S if state is not S.UNKNOWN},
}


class IllegalTransition(Exception):
    """``event`` cannot happen in ``state``; the state is unchanged."""

    def __init__(self, state: WorkerState, event: Event, why: str = "") -> None:
        super().__init__(why or f"{event.value} is not allowed while the worker is {state}")
        self.state, self.event = state, event


class Lifecycle:
    """A worker's state and why it is in it."""

    def __init__(self) -> None:
        self.state = WorkerState.STARTING
        self.reason = ""
        """Why the worker is in its state, when that is not obvious (``degraded``,
        ``failed``, a shutdown drain); empty otherwise."""
        self.shutting_down = False

    def move(self, event: Event, reason: str = "") -> bool:
        """Apply ``event``; return whether the state changed. Raises
        :class:`IllegalTransition` for a move the table does not have, and for ``Resume``
        during a shutdown (the process is on its way out)."""
        if event is Event.RESUME and self.shutting_down:
            raise IllegalTransition(
                self.state, event, "the worker is shutting down (SIGTERM): Resume is refused"
            )
        new = _MOVES.get((self.state, event))
        if new is None:
            raise IllegalTransition(self.state, event)
        if event is Event.SHUTDOWN:
            self.shutting_down = True
        changed, self.state = new is not self.state, new
        if changed or reason:
            self.reason = reason if new is not WorkerState.READY else ""
        return changed

    @property
    def taking_requests(self) -> bool:
        return self.state is WorkerState.READY
