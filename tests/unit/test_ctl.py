"""``lamina ctl status``'s table: each worker's state as the scheduler acts on it."""

from __future__ import annotations

from lamina.schemas.v1.stats import ClusterStatus, WorkerView
from lamina.services.ctl import COLUMNS, status_table
from tests.telemetry.helpers import make_stats


def column(table: str, worker: str, name: str) -> str:
    row = next(line for line in table.splitlines() if line.startswith(worker + " "))
    return row.split()[COLUMNS.index(name)]


def test_the_state_column_says_why_a_live_worker_gets_nothing() -> None:
    views = [
        WorkerView(stats=make_stats("w-ready"), alive=True, last_seen_ms=1),
        WorkerView(stats=make_stats("w-cordoned", cordoned=True), alive=True, last_seen_ms=1),
        WorkerView(stats=make_stats("w-lost"), alive=True, last_seen_ms=1, quarantined=True),
    ]
    table = status_table(ClusterStatus(scheduler_id="s", workers=views, queued=3))
    assert table.splitlines()[0] == "scheduler s: 3 queued (0 prompt tokens)"
    assert [column(table, w.stats.worker_id, "state") for w in views] == [
        "ready",
        "cordoned",
        "quarantined",
    ]


def test_a_tensor_parallel_worker_shows_its_ranks() -> None:
    views = [
        WorkerView(stats=make_stats("w-one"), alive=True, last_seen_ms=1),
        WorkerView(stats=make_stats("w-two", tensor_parallel_size=2), alive=True, last_seen_ms=1),
    ]
    table = status_table(ClusterStatus(scheduler_id="s", workers=views))
    assert [column(table, w.stats.worker_id, "tp") for w in views] == ["1", "2"]
