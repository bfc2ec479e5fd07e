"""LoRA adapters through the whole stack: a worker started with ``--lora-modules``
publishes the adapters it holds, the gateway lists them in ``/v1/models`` with the
model as their ``parent``, a request naming one is placed on that worker and its output
is ``transformers`` + ``peft``'s (merged weights); the base model's requests beside it
are unchanged; an adapter no worker holds is a 404; telemetry shows (vLLM's)
``lora_requests_info``."""

from __future__ import annotations

import time

import httpx

from tests.e2e.conftest import make_stack
from tests.engine.helpers import LORA_TARGETS, hf_greedy, make_adapter

PROMPT = [1, 400, 261, 403]


def test_a_request_naming_an_adapter_gets_the_adapters_output(stories, tmp_path):
    import transformers

    merged = make_adapter(stories, tmp_path / "sql", 4, 8, LORA_TARGETS, 0)
    base = transformers.AutoModelForCausalLM.from_pretrained(stories).eval()
    args = ["--max-model-len", "256", "--lora-modules", f"sql={tmp_path / 'sql'}"]
    with make_stack(stories, tmp_path, worker_args=args) as stack:
        url = stack.base_url
        deadline = time.monotonic() + 30
        while True:  # the gateway learns the adapters from the cluster view
            cards = httpx.get(url + "/v1/models", timeout=10).json()["data"]
            if len(cards) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        model = cards[0]["id"]
        assert [(c["id"], c["parent"]) for c in cards] == [(model, None), ("sql", model)]
        assert httpx.get(url + "/v1/models/sql", timeout=10).json()["parent"] == model

        def tokens(name: str) -> list[int]:
            body = {"model": name, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
            body |= {"ignore_eos": True, "return_token_ids": True}
            response = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["token_ids"]

        assert tokens("sql") == hf_greedy(merged, PROMPT, 40)
        assert tokens(model) == hf_greedy(base, PROMPT, 40)
        body = {"model": "chat", "prompt": PROMPT, "max_tokens": 4}
        missing = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        cluster = httpx.get(stack.metrics_url.replace("/metrics", "/v1/cluster"), timeout=10)
        (worker,) = cluster.json()["workers"]
        assert worker["lora_adapters"] == ["sql"] and worker["max_loras"] == 1
        metrics = httpx.get(stack.metrics_url, timeout=10).text
        assert "lamina:lora_requests_info{" in metrics and 'max_lora="1"' in metrics
