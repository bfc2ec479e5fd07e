"""Workers of several ranks, through the whole stack: tensor- and pipeline-parallel
workers give the same text as one process, and a rank killed mid-stream costs no client
anything (its streams move, exactly, to the other group) before the supervisor restarts
the whole group."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.e2e.conftest import make_stack
from tests.e2e.test_faults import assert_exact, busiest_worker, streams_through, undisturbed

# stories260K is trained: its greedy tokens do not hinge on the last bits of a logit, so
# one process and two ranks (which round each layer's sums differently) agree.
BODY = {
    "max_tokens": 300,
    "temperature": 0,
    "ignore_eos": True,
    "frequency_penalty": 0.6,
    "presence_penalty": 0.4,
    "repetition_penalty": 1.3,
}


def cluster(stack) -> list[dict]:
    url = stack.metrics_url.replace("/metrics", "/v1/cluster")
    return httpx.get(url, timeout=10).json()["workers"]


ARGS = ["--max-model-len", "512"]


@pytest.fixture(scope="module")
def expected(stories, tmp_path_factory) -> list[str]:
    """What one process per worker streams for each prompt."""
    with make_stack(stories, tmp_path_factory.mktemp("one"), worker_args=ARGS) as stack:
        return undisturbed(stack, BODY)


def test_two_rank_workers_serve_one_processs_text_and_outlive_a_killed_rank(
    stories, tmp_path, expected
):
    groups = make_stack(
        stories, tmp_path, workers=2, worker_args=[*ARGS, "--tensor-parallel-size", "2"]
    )
    with groups as stack:
        assert undisturbed(stack, BODY) == expected
        (model,) = httpx.get(stack.base_url + "/v1/models", timeout=10).json()["data"]
        assert [p["tensor_parallel_size"] for p in model["precisions"]] == [2]
        killed: dict = {}

        async def kill_a_rank(client) -> None:  # rank 1 of the busier group
            busiest = await busiest_worker(stack, client)
            (worker,) = [w for w in cluster(stack) if w["worker_id"] == busiest]
            killed.update(worker)
            os.kill(worker["ranks"][1]["pid"], signal.SIGKILL)

        assert_exact(streams_through(stack, BODY, kill_a_rank), expected, 300)

        # The group's worker exits for its supervisor, which starts the whole group again.
        name = killed["worker_id"]
        deadline = time.monotonic() + 120
        while stack.restarts.get(name, 0) == 0:
            stack.supervise()
            assert time.monotonic() < deadline, f"{name} was not restarted"
            time.sleep(0.2)
        while True:
            (back,) = [w for w in cluster(stack) if w["worker_id"] == name]
            if back["state"] == "ready" and back["incarnation"] != killed["incarnation"]:
                break
            assert time.monotonic() < deadline, back
            time.sleep(0.2)
        assert len(back["ranks"]) == 2
        assert {r["pid"] for r in back["ranks"]}.isdisjoint(r["pid"] for r in killed["ranks"])
        assert undisturbed(stack, BODY) == expected


def test_a_worker_of_two_pipeline_stages_serves_one_processs_text(stories, tmp_path, expected):
    args = [*ARGS, "--pipeline-parallel-size", "2"]
    with make_stack(stories, tmp_path, worker_args=args) as stack:
        assert undisturbed(stack, BODY) == expected
        (model,) = httpx.get(stack.base_url + "/v1/models", timeout=10).json()["data"]
        (precision,) = model["precisions"]
        assert (precision["tensor_parallel_size"], precision["pipeline_parallel_size"]) == (1, 2)
        (worker,) = cluster(stack)
        assert [rank["stage"] for rank in worker["ranks"]] == [0, 1]
