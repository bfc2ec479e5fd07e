"""Scheduler registry and placement: pure, with exact outcomes."""

from __future__ import annotations

from lamina.schemas.v1.generate import GenerateRequest, Sampling
from lamina.schemas.v1.stats import WorkerStats
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


def test_worker_is_dead_after_three_missed_heartbeats():
    registry = Registry()
    registry.heartbeat(stats("a"), now=10.0)
    assert [w.stats.worker_id for w in registry.live(11.5)] == ["a"]
    assert registry.live(11.51) == []
    registry.heartbeat(stats("a"), now=12.0)
    assert len(registry.live(12.1)) == 1


def test_least_queued_work_wins_and_pending_placements_count():
    registry = Registry()
    registry.heartbeat(stats("busy", num_queued_prefill_tokens=500), now=0)
    registry.heartbeat(stats("idle"), now=0)
    registry.heartbeat(stats("loaded", num_running=10), now=0)
    decision = place(request(), registry.live(0.1))
    assert (decision.worker_id, decision.reason, decision.candidates) == ("idle", "placed", 3)
    # Placed work counts until the next heartbeat, so a burst spreads out.
    registry.workers["idle"].pending = 10
    registry.workers["idle"].pending_tokens = 100
    assert place(request(), registry.live(0.1)).worker_id == "busy"
    assert 10 * REQUEST_WEIGHT_TOKENS > 500  # why "loaded" lost to "busy" above
    registry.heartbeat(stats("idle"), now=0.2)  # a heartbeat supersedes the estimate
    assert place(request(), registry.live(0.3)).worker_id == "idle"


def test_rejections_are_typed():
    registry = Registry()
    assert place(request(), []).reason == "no_worker"
    registry.heartbeat(stats("a"), now=0)
    wrong = place(request(model="other"), registry.live(0))
    assert (wrong.reason, wrong.retryable) == ("model_not_found", False)
    too_long = place(request(prompt_len=1000, max_tokens=100), registry.live(0))
    assert (too_long.reason, too_long.retryable) == ("invalid_request", False)
    assert "maximum context length is 1024" in too_long.message
    registry.heartbeat(stats("a", state="draining"), now=0)
    draining = place(request(), registry.live(0))
    assert (draining.reason, draining.retryable) == ("no_worker", True)
    registry.heartbeat(stats("b", state="starting"), now=0)  # loading its model
    waiting = place(request(), registry.live(0))
    assert (waiting.worker_id, waiting.reason, waiting.retryable) == (None, "no_worker", True)
    assert "draining, starting" in waiting.message
