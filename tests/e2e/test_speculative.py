"""Speculative decoding through the whole stack: a worker started with vLLM's
``--speculative-config`` naming a draft model (a checkpoint of its own, stories260K's
first two layers) serves the text a plain worker serves, greedy and seeded, and says in
its heartbeat and in telemetry that it drafts and what was accepted."""

from __future__ import annotations

import json
import time

import httpx

from tests.e2e.conftest import make_stack
from tests.engine.helpers import variant

PROMPT = [1, 400, 261, 403]
BODIES = [
    {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True},
    {"prompt": PROMPT, "max_tokens": 60, "temperature": 0.8, "seed": 11, "ignore_eos": True},
]


def texts(url: str) -> list[str]:
    out = []
    for body in BODIES:
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        out.append(response.json()["choices"][0]["text"])
    return out


def test_a_worker_with_a_draft_model_serves_a_plain_workers_text(stories, tmp_path):
    (tmp_path / "draft").mkdir()
    draft = variant(stories, tmp_path / "draft", layers=2)
    args = ["--max-model-len", "256"]
    with make_stack(stories, tmp_path / "plain", worker_args=args) as plain:
        want = texts(plain.base_url)
    # Not adaptive: whether the gate drafts depends on the machine's step times, and what
    # this checks is what the worker says of its drafts (the gate: tests/engine).
    config = json.dumps({"model": str(draft), "num_speculative_tokens": 3})
    speculative = [*args, "--speculative-config", config]
    telemetry = ["--metrics-compat", "vllm"]
    with make_stack(
        stories, tmp_path / "drafting", worker_args=speculative, telemetry_args=telemetry
    ) as stack:
        assert texts(stack.base_url) == want
        cluster = stack.metrics_url.replace("/metrics", "/v1/cluster")
        deadline = time.monotonic() + 30
        made = sum(body["max_tokens"] for body in BODIES)
        while True:  # a heartbeat whose engine counters include every token the requests made
            (worker,) = httpx.get(cluster, timeout=10).json()["workers"]
            if worker["generation_tokens_total"] >= made or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert worker["spec_decode_num_accepted_tokens"] > 0
        metrics = httpx.get(stack.metrics_url, timeout=10).text.splitlines()

        def value(prefix: str) -> float:
            (line,) = [m for m in metrics if m.startswith(prefix)]
            return float(line.rsplit(" ", 1)[1])

        assert value("vllm:spec_decode_num_accepted_tokens_total") > 0
        assert worker["spec_decode_active"]
        assert value("lamina:spec_decode_active{") == 1.0
