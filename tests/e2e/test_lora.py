"""LoRA adapters through the whole stack: a worker started with ``--lora-modules``
publishes the adapters it holds, the gateway lists them in ``/v1/models`` with the
model as their ``parent``, a request naming one is placed on that worker and its output
is ``transformers`` + ``peft``'s (merged weights); the base model's requests beside it
are unchanged; an adapter no worker holds is a 404; telemetry shows (vLLM's)
``lora_requests_info``."""

from __future__ import annotations

import json
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
            assert response.json()["model"] == name  # vLLM's: the adapter's name, not the model's
            return response.json()["choices"][0]["token_ids"]

        assert tokens("sql") == hf_greedy(merged, PROMPT, 40)
        assert tokens(model) == hf_greedy(base, PROMPT, 40)
        stream = {"model": "sql", "prompt": PROMPT, "max_tokens": 3, "stream": True}
        stream["stream_options"] = {"include_usage": True}
        streamed = httpx.post(url + "/v1/completions", json=stream, timeout=60)
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if "{" in line]
        # the tokens' chunks (one each, or fewer where the gateway fell behind) and usage
        assert len(chunks) >= 2 and chunks[-1]["usage"], streamed.text
        assert {chunk["model"] for chunk in chunks} == {"sql"}
        body = {"model": "chat", "prompt": PROMPT, "max_tokens": 4}
        missing = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        cluster = httpx.get(stack.metrics_url.replace("/metrics", "/v1/cluster"), timeout=10)
        (worker,) = cluster.json()["workers"]
        assert worker["lora_adapters"] == ["sql"] and worker["max_loras"] == 1
        metrics = httpx.get(stack.metrics_url, timeout=10).text
        assert "lamina:lora_requests_info{" in metrics and 'max_lora="1"' in metrics


def test_adapters_load_and_unload_at_run_time(stories, tmp_path):
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` through the
    gateway (``--allow-runtime-lora-updating``) to the worker (``--enable-lora``): once
    the load answers, the adapter is listed and serves exact output; a bad path, a name
    taken, an unknown name are refused in OpenAI's error shape; after the unload the
    name is a 404 again. Without the gateway's flag the routes do not exist."""
    merged = make_adapter(stories, tmp_path / "sql", 4, 8, LORA_TARGETS, 0)
    worker = ["--max-model-len", "256", "--enable-lora", "--max-loras", "2"]
    gateway = ["--allow-runtime-lora-updating"]
    with make_stack(stories, tmp_path, worker_args=worker, gateway_args=gateway) as stack:
        url = stack.base_url

        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(url + path, json=body, timeout=60)

        def completion(model: str) -> httpx.Response:
            body = {"model": model, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
            return post("/v1/completions", body | {"ignore_eos": True, "return_token_ids": True})

        deadline = time.monotonic() + 30
        while not httpx.get(url + "/ready", timeout=10).is_success:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert completion("sql").status_code == 404
        bad = post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        loaded = post(
            "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(tmp_path / "sql")}
        )
        assert loaded.status_code == 200, loaded.text
        assert "sql" in loaded.text
        assert [c["id"] for c in httpx.get(url + "/v1/models", timeout=10).json()["data"]][1:] == [
            "sql"
        ]
        response = completion("sql")  # at once: the load returned after the view showed it
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == hf_greedy(merged, PROMPT, 40)
        again = post(
            "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(tmp_path / "sql")}
        )
        assert again.status_code == 400
        unknown = post("/v1/unload_lora_adapter", {"lora_name": "chat"})
        assert unknown.status_code == 404
        assert post("/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 200
        assert completion("sql").status_code == 404
        assert post("/v1/load_lora_adapter", {"lora_name": ""}).status_code == 400
        paths = httpx.get(url + "/openapi.json", timeout=10).json()["paths"]
        assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(paths)
    with make_stack(stories, tmp_path / "plain", worker_args=worker) as stack:
        body = {"lora_name": "sql", "lora_path": str(tmp_path / "sql")}
        response = httpx.post(stack.base_url + "/v1/load_lora_adapter", json=body, timeout=60)
        assert response.status_code in (404, 405)
        paths = httpx.get(stack.base_url + "/openapi.json", timeout=10).json()["paths"]
        assert "/v1/load_lora_adapter" not in paths
