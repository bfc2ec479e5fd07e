"""``lamina ctl status``'s table: each worker's state as the scheduler acts on it."""

from __future__ import annotations

from lamina.schemas.v1.stats import ClusterStatus, WorkerView
from lamina.services.ctl import status_table
from tests.telemetry.helpers import make_stats


def state_of(table: str, worker: str) -> str:
    row = next(line for line in table.splitlines() if line.startswith(worker + " "))
    return row.split()[1]


def test_the_state_column_says_why_a_live_worker_gets_nothing() -> None:
    views = [
        WorkerView(stats=make_stats("w-ready"), alive=True, last_seen_ms=1),
        WorkerView(stats=make_stats("w-cordoned", cordoned=True), alive=True, last_seen_ms=1),
        WorkerView(stats=make_stats("w-lost"), alive=True, last_seen_ms=1, quarantined=True),
    ]
    table = status_table(ClusterStatus(scheduler_id="s", workers=views, queued=3))
    assert table.splitlines()[0] == "scheduler s: 3 queued (0 prompt tokens)"
    assert [state_of(table, w.stats.worker_id) for w in views] == [
        "ready",
        "cordoned",
        "quarantined",
    ]
