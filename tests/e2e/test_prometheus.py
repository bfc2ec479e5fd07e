"""A real Prometheus scrapes a real stack: every query of every shipped dashboard returns
data after a short load, vLLM's dashboard's series are there by ``model_name``, and the
latency histograms keep their requests' trace ids as exemplars."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.e2e.conftest import make_stack
from tests.e2e.prometheus import BINARY, Prometheus
from tests.telemetry import vllm_0_33

pytestmark = pytest.mark.skipif(BINARY is None, reason="needs Debian's prometheus package")

REQUESTS = 12


@pytest.fixture(scope="module")
def scraped(tiny_model, tmp_path_factory):
    """A stack whose one worker takes two requests at a time (so that a burst waits in
    the scheduler's queue), traced, with vLLM's names on, scraped every second."""
    tmp = tmp_path_factory.mktemp("prometheus")
    stack = make_stack(
        tiny_model,
        tmp,
        extra_env={"LAMINA_TRACE_FILE": str(tmp / "spans.jsonl")},
        worker_args=["--max-num-seqs", "2", "--kv-cache-memory-bytes", str(64 << 20)],
        telemetry_args=["--metrics-compat", "vllm"],
    )
    with stack, Prometheus([stack.metrics_url.split("/")[2]], tmp) as prometheus:
        client = openai.AsyncOpenAI(
            base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
        )

        async def one(i: int) -> None:
            stream = await client.completions.create(
                model="lamina-tiny",
                prompt=f"load {i} " * (1 + i % 4),
                max_tokens=12,
                temperature=0.0,
                stream=True,
            )
            async for _ in stream:
                pass

        async def burst() -> None:
            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(REQUESTS))), 120)

        asyncio.run(burst())
        prometheus.wait_for("sum(lamina:request_outcome_total)", REQUESTS)
        prometheus.wait_for("sum(lamina:scheduler_queue_wait_seconds_count)", 1)
        # Rates need two samples of each series since it appeared: a few more scrapes.
        prometheus.wait_for("min(count_over_time(lamina:request_outcome_total[1m]))", 3)
        yield prometheus


def test_every_dashboard_query_returns_data(scraped):
    scraped.assert_every_dashboard_query_returns_data()


def test_vllms_dashboard_series_are_there_by_model_name(scraped):
    empty = [
        series
        for series in vllm_0_33.DASHBOARD_SERIES
        if not scraped.query(f'{series}{{model_name="lamina-tiny"}}')
    ]
    assert not empty


def test_latencies_keep_their_requests_trace_ids_as_exemplars(scraped):
    exemplars = scraped.exemplars("lamina:time_to_first_token_seconds_bucket")
    trace_ids = {e["labels"]["trace_id"] for series in exemplars for e in series["exemplars"]}
    assert trace_ids and all(len(t) == 32 for t in trace_ids)
