"""Disaggregated prefill and decode across hosts (network namespaces,
``tests/multihost/netns.py``): KV blocks cross between hosts on the transfer stream.

- host a: gateway, scheduler, telemetry, worker ``a-worker-0`` (``--worker-role prefill``)
- hosts b and c: a worker each (``--worker-role decode``)

Long prompts are placed on b's or c's worker with a prefill leg on a's: a's worker
computes each prompt's full blocks, the decode worker fetches them from a's address (its
node's ``--address``) and computes only the rest. The text equals a single-host mixed
stack's, the client sees the fetched blocks as cached tokens (the decode worker did not
compute them), and telemetry counts the legs and the fetches, none failed.

Then the prefill worker is a pipeline-parallel one whose second stage runs on another
host: its blocks leave whole, the second stage's layers gathered from that host over the
step channel before they cross to the decode host.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.e2e.conftest import make_stack
from tests.multihost import netns, nodes
from tests.multihost.nodes import converge

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))

ROLES = {"a": "gateway,scheduler,telemetry,worker", "b": "worker", "c": "worker"}
EXTRA = {
    "a": ["--worker-role", "prefill"],
    "b": ["--worker-role", "decode"],
    "c": ["--worker-role", "decode"],
}
ENGINE = ["--max-model-len", "512"]
PROMPTS = [list(range(5 + n, 305 + n)) for n in range(4)]  # 300 tokens: 18 full blocks each
BLOCKS = 18 * 16


def _complete(base_url: str, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _workers(c: nodes.Cluster, shows, within_s: float = 30.0) -> dict[str, dict]:
    """Telemetry's workers by id once ``shows(workers)`` (their heartbeats lag)."""
    url = f"http://{c.hosts['a'].address}:9400/v1/cluster"
    deadline = time.monotonic() + within_s
    while True:
        workers = {w["worker_id"]: w for w in httpx.get(url, timeout=10).json()["workers"]}
        if shows(workers) or time.monotonic() > deadline:
            return workers
        time.sleep(0.3)


def test_decode_workers_on_other_hosts_fetch_what_the_prefill_host_computed(stories, tmp_path):
    with make_stack(stories, tmp_path / "reference", worker_args=ENGINE) as reference:
        want = [_complete(reference.base_url, p)["choices"][0]["text"] for p in PROMPTS]

    with nodes.running(ROLES, stories, ENGINE, tmp_path, extra=EXTRA) as c:
        asyncio.run(converge(c, ("a",), nodes.workers_of(ROLES), timeout=180))
        got = [_complete(c.gateway("a"), p) for p in PROMPTS]
        assert [g["choices"][0]["text"] for g in got] == want
        # The decode worker computed each prompt's last, partial block only.
        cached = [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got]
        assert cached == [BLOCKS] * len(PROMPTS)

        decoders = ("b-worker-0", "c-worker-0")

        def counted(workers: dict[str, dict]) -> bool:
            """Every worker's heartbeat since the last request (each beats on its own)."""
            fetched = sum(workers.get(w, {}).get("kv_fetches_total", 0) for w in decoders)
            legs = workers.get("a-worker-0", {}).get("kv_prefills_total", 0)
            return fetched == legs == len(PROMPTS)

        workers = _workers(c, counted)
        assert workers["a-worker-0"]["role"] == "prefill"
        assert workers["a-worker-0"]["kv_prefills_total"] == len(PROMPTS)
        assert sum(workers[w]["kv_fetches_total"] for w in decoders) == len(PROMPTS)
        assert sum(workers[w]["kv_fetch_failures_total"] for w in decoders) == 0
        # Fetched from a's node address, not a loopback.
        assert workers["a-worker-0"]["kv_address"].startswith(c.hosts["a"].address + ":")
        metrics = httpx.get(f"http://{c.hosts['a'].address}:9400/metrics", timeout=10).text
        legs = [
            line
            for line in metrics.splitlines()
            if line.startswith("lamina:disaggregated_placements_total{")
            and 'prefill_worker_id="a-worker-0"' in line
        ]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in legs) == len(PROMPTS)


STAGED = {
    "a": "gateway,scheduler,telemetry,worker",  # the prefill worker's driver and stage 0
    "b": "",  # stage 1 of a's worker, nothing else
    "c": "worker",  # the decode worker
}
STAGED_EXTRA = {
    "a": ["--worker-role", "prefill", "--pipeline-parallel-size", "2",
          "--remote-pipeline-stages", "1"],
    "b": ["--pipeline-stage", "a-worker-0:1"],
    "c": ["--worker-role", "decode"],
}  # fmt: skip


def test_a_prefill_worker_whose_second_stage_is_on_another_host_sends_whole_blocks(
    stories, tmp_path
):
    with make_stack(stories, tmp_path / "reference", worker_args=ENGINE) as reference:
        want = [_complete(reference.base_url, p)["choices"][0]["text"] for p in PROMPTS]

    with nodes.running(STAGED, stories, ENGINE, tmp_path, extra=STAGED_EXTRA) as c:
        asyncio.run(converge(c, ("a",), nodes.workers_of(STAGED), timeout=240))
        prefiller = _workers(c, lambda w: "a-worker-0" in w)["a-worker-0"]
        assert [(r["stage"], r["host"]) for r in prefiller["ranks"]][1] == (1, "b")
        assert prefiller["kv_layout"] == _workers(c, lambda w: True)["c-worker-0"]["kv_layout"]

        got = [_complete(c.gateway("a"), p) for p in PROMPTS]
        assert [g["choices"][0]["text"] for g in got] == want
        cached = [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got]
        assert cached == [BLOCKS] * len(PROMPTS)  # every layer's KV came from a and b

        def counted(workers: dict[str, dict]) -> bool:
            """Both workers' heartbeats since the last request (each beats on its own)."""
            fetched = workers.get("c-worker-0", {}).get("kv_fetches_total", 0)
            legs = workers.get("a-worker-0", {}).get("kv_prefills_total", 0)
            return fetched == legs == len(PROMPTS)

        workers = _workers(c, counted)
        assert workers["a-worker-0"]["kv_prefills_total"] == len(PROMPTS)
        assert workers["c-worker-0"]["kv_fetches_total"] == len(PROMPTS)
        assert workers["c-worker-0"]["kv_fetch_failures_total"] == 0
