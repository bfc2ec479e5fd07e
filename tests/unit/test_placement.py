"""Scheduler registry and placement: pure, with exact outcomes."""

from __future__ import annotations

from lamina.schemas.v1.generate import GenerateRequest, RejectReason, Sampling
from lamina.schemas.v1.stats import WorkerState, WorkerStats
from lamina.services.scheduler.placement import REQUEST_WEIGHT_TOKENS, place
from lamina.services.scheduler.registry import Registry
from tests.telemetry.helpers import make_stats


def stats(worker_id: str, **kw) -> WorkerStats:
    """An idle worker serving model ``m`` with a 1024-token context, plus ``kw``."""
    idle = dict(
        model="m", num_running=0, num_waiting=0, num_queued_prefill_tokens=0, max_model_len=1024
    )
    return make_stats(worker_id, **(idle | kw))


def request(prompt_len: int = 10, max_tokens: int = 10, model: str = "m") -> GenerateRequest:
    return GenerateRequest(
        request_id="r",
        model=model,
        prompt_token_ids=[1] * prompt_len,
        sampling=Sampling(max_tokens=max_tokens),
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def registry_at(clock: Clock) -> Registry:
    return Registry(clock=clock)


def test_worker_is_dead_after_three_missed_heartbeats():
    clock = Clock()
    registry = registry_at(clock)
    clock.now = 10.0
    registry.heartbeat(stats("a"))
    clock.now = 11.5
    assert [w.stats.worker_id for w in registry.candidates()] == ["a"]
    clock.now = 11.51
    assert registry.candidates() == []
    clock.now = 12.0
    registry.heartbeat(stats("a"))
    clock.now = 12.1
    assert len(registry.candidates()) == 1


def test_least_queued_work_wins_and_pending_placements_count():
    clock = Clock()
    registry = registry_at(clock)
    registry.heartbeat(stats("busy", num_queued_prefill_tokens=500))
    registry.heartbeat(stats("idle"))
    registry.heartbeat(stats("loaded", num_running=10))
    clock.now = 0.1
    decision = place(request(), registry.candidates())
    assert (decision.worker_id, decision.reason, decision.candidates) == ("idle", None, 3)
    # Placed work counts until the next heartbeat, so a burst spreads out.
    for _ in range(10):
        registry.placed("idle", 10)
    assert place(request(), registry.candidates()).worker_id == "busy"
    assert 10 * REQUEST_WEIGHT_TOKENS > 500  # why "loaded" lost to "busy" above
    clock.now = 0.2
    registry.heartbeat(stats("idle"))  # a heartbeat supersedes the estimate
    clock.now = 0.3
    assert place(request(), registry.candidates()).worker_id == "idle"


def test_rejections_are_typed():
    registry = registry_at(Clock())
    assert place(request(), []).reason == RejectReason.NO_WORKER
    registry.heartbeat(stats("a"))
    wrong = place(request(model="other"), registry.candidates())
    assert (wrong.reason, wrong.retryable) == (RejectReason.MODEL_NOT_FOUND, False)
    too_long = place(request(prompt_len=1000, max_tokens=100), registry.candidates())
    assert (too_long.reason, too_long.retryable) == (RejectReason.INVALID_REQUEST, False)
    assert "maximum context length is 1024" in too_long.message
    registry.heartbeat(stats("a", state=WorkerState.DRAINING))
    draining = place(request(), registry.candidates())
    assert (draining.reason, draining.retryable) == (RejectReason.NO_WORKER, True)
    registry.heartbeat(stats("b", state=WorkerState.STARTING))  # loading its model
    waiting = place(request(), registry.candidates())
    assert (waiting.worker_id, waiting.reason, waiting.retryable) == (
        None,
        RejectReason.NO_WORKER,
        True,
    )
    assert "draining, starting" in waiting.message
    registry.heartbeat(stats("c", state=WorkerState.FAILED))
    registry.heartbeat(stats("d", state=WorkerState.UNKNOWN))  # from a newer worker
    assert place(request(), registry.candidates()).worker_id is None
