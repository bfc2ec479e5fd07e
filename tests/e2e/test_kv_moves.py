"""KV that moves between workers through the whole stack: a prompt's prefix cached on a
worker the scheduler no longer places on (cordoned) is fetched by the worker it places
the prompt on instead, which the placement record says; the client sees the prefix
cached and gets the text the first worker gave; heartbeats and telemetry count what
moved."""

from __future__ import annotations

import asyncio

import httpx

from lamina.libs.bus import Bus
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.records import PlacementRecord
from tests.e2e.conftest import make_stack
from tests.e2e.test_ctl import lamina_ctl, wait_for_status

PREFIX = list(range(5, 133))  # 8 blocks of 16
QUESTION = [*PREFIX, 140, 141, 142]


def test_a_prefix_cached_on_a_cordoned_worker_is_fetched_by_the_one_placed(
    stories, tmp_path, capsys
):
    args = ["--max-model-len", "256"]
    with make_stack(stories, tmp_path, workers=2, worker_args=args) as stack:
        url = stack.nats_url

        def complete() -> dict:
            body = {"prompt": QUESTION, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            response = httpx.post(stack.base_url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()

        def move_to(worker: str, away_from: str) -> None:
            assert lamina_ctl(capsys, url, "uncordon", worker)[0] == 0
            assert lamina_ctl(capsys, url, "cordon", away_from)[0] == 0
            wait_for_status(capsys, url, away_from, "cordoned")

        async def placed(call) -> tuple[dict, PlacementRecord]:
            records: list[PlacementRecord] = []
            bus = await Bus.connect(url, "test-kv-moves")
            try:

                async def on_record(record: PlacementRecord, _msg) -> None:
                    records.append(record)

                await bus.subscribe(subjects.EVENTS_PLACEMENT, PlacementRecord, on_record)
                await bus.flush()
                result = await asyncio.to_thread(call)
                await asyncio.sleep(0.5)
            finally:
                await bus.close()
            (record,) = records
            return result, record

        move_to("worker-0", away_from="worker-1")
        first, record = asyncio.run(placed(complete))
        assert record.worker_id == "worker-0"
        move_to("worker-1", away_from="worker-0")
        again, record = asyncio.run(placed(complete))

        assert record.worker_id == "worker-1"
        (scored,) = record.scored
        assert (scored.fetch_from, scored.fetch_blocks) == ("worker-0", 8)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PREFIX)
        cluster = httpx.get(stack.metrics_url.replace("/metrics", "/v1/cluster"), timeout=10)
        workers = {w["worker_id"]: w for w in cluster.json()["workers"]}
        assert workers["worker-1"]["kv_fetches_total"] == 1
        assert workers["worker-1"]["kv_fetched_blocks_total"] == 8
        assert workers["worker-0"]["kv_sent_blocks_total"] == 8
        metrics = httpx.get(stack.metrics_url, timeout=10).text
        labels = f'model="{stories.name}",worker_id="worker-1"'
        assert f"lamina:kv_fetched_blocks_total{{{labels}}} 8.0" in metrics
