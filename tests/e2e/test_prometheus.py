"""A real Prometheus scrapes a real stack: every query of every shipped dashboard returns
data after a short load, vLLM's dashboard's series are there by ``model_name``, and the
latency histograms keep their requests' trace ids as exemplars."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import make_stack
from tests.e2e.prometheus import BINARY, Prometheus, burst
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
        assert burst(stack.base_url, REQUESTS) == [12] * REQUESTS
        prometheus.wait_for_burst(REQUESTS)
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
