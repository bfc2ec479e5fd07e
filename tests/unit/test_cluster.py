"""The one liveness rule (``lamina.libs.cluster``), on an injected clock."""

from __future__ import annotations

from lamina.libs.cluster import FORGET_AFTER_S, MISSED_HEARTBEATS, ClusterView
from lamina.schemas.v1.stats import WorkerState
from tests.telemetry.helpers import make_stats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_alive_for_three_of_its_own_intervals_then_forgotten():
    clock = Clock()
    view = ClusterView(clock, wall_clock=lambda: 1_700_000_000.0)
    view.heartbeat(make_stats("fast", heartbeat_interval_s=0.5))
    view.heartbeat(make_stats("slow", heartbeat_interval_s=2.0))
    clock.now += MISSED_HEARTBEATS * 0.5
    assert [e.stats.worker_id for e in view.live()] == ["fast", "slow"]
    clock.now += 0.01
    assert [e.stats.worker_id for e in view.live()] == ["slow"]
    assert [alive for _, alive in view.snapshot()] == [False, True]
    clock.now += FORGET_AFTER_S + MISSED_HEARTBEATS * 2.0
    assert view.snapshot() == []


def test_serving_means_alive_and_not_failed():
    clock = Clock()
    view = ClusterView(clock)
    view.heartbeat(make_stats("w"))
    assert view.serving("w", since=clock.now)
    view.heartbeat(make_stats("w", state=WorkerState.FAILED))  # heartbeats, holds nothing
    assert not view.serving("w", since=clock.now)
    # Never heard from: one window at the default interval from when it took the request.
    assert view.serving("new", since=clock.now - 1.5)
    assert not view.serving("new", since=clock.now - 1.51)
