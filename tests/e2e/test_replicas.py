"""Two scheduler replicas in front of three workers: a burst of distinct prompts, split
between the replicas by their queue group, spreads over the workers instead of piling on
the one each replica would pick alone; each submit is placed exactly once."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable

import httpx

from lamina.libs.bus import Bus
from lamina.libs.errors import RequestTimeout
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.records import PlacementRecord
from lamina.schemas.v1.stats import ClusterStatus, ClusterStatusRequest, WorkerState
from tests.e2e.conftest import make_stack


def ready_workers(status: ClusterStatus) -> int:
    return sum(
        w.alive and w.stats.state == WorkerState.READY and not w.quarantined for w in status.workers
    )


def both_replicas_answered() -> Callable[[ClusterStatus], bool]:
    """``request_many``'s ``last``: true once two replicas have answered."""
    answered: set[str] = set()

    def last(status: ClusterStatus) -> bool:
        answered.add(status.scheduler_id)
        return len(answered) == 2

    return last


def test_two_replicas_spread_a_burst_and_place_each_request_once(tiny_model, tmp_path):
    stack = make_stack(tiny_model, tmp_path, workers=3)

    async def main(base_url: str, nats_url: str) -> list[PlacementRecord]:
        placed: list[PlacementRecord] = []
        bus = await Bus.connect(nats_url, "test-replicas")

        async def on_record(record: PlacementRecord, _msg) -> None:
            placed.append(record)

        await bus.subscribe(subjects.EVENTS_PLACEMENT, PlacementRecord, on_record)
        await bus.flush()
        # Every replica answers sched.status: wait until both see all three workers ready
        # (the gateway is ready with one: a worker still loading would take no part).
        for _ in range(300):
            with contextlib.suppress(RequestTimeout):  # the second is not subscribed yet
                answers = await bus.request_many(
                    subjects.SCHED_STATUS,
                    ClusterStatusRequest(),
                    ClusterStatus,
                    both_replicas_answered(),
                    timeout=1,
                )
                if all(ready_workers(status) == 3 for status in answers):
                    break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the replicas never saw the three workers ready")
        prompts = [[(i * 37 + j * 11) % 900 + 5 for j in range(400)] for i in range(12)]
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            responses = await asyncio.gather(
                *(
                    client.post("/v1/completions", json={"prompt": p, "max_tokens": 4})
                    for p in prompts
                )
            )
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        await bus.drain()  # the barrier: every record published before it has arrived
        return placed

    with stack:
        stack.start_scheduler("second")
        records = asyncio.run(main(stack.base_url, stack.nats_url))
    placed = [r for r in records if r.reason == "placed"]
    assert len(placed) == 12 and len({r.request_id for r in placed}) == 12
    assert len({r.scheduler_id for r in placed}) == 2  # both replicas took part
    per_worker = Counter(r.worker_id for r in placed)
    assert len(per_worker) == 3 and max(per_worker.values()) <= 6, per_worker
