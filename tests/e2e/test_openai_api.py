"""The OpenAI API through gateway → scheduler → worker, with the official client."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from lamina.schemas.v1.generate import Sampling
from lamina.services.engine_worker.config import EngineConfig
from lamina.services.engine_worker.engine import Engine
from tests.e2e.conftest import read_spans

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def test_models_and_health(stack, client):
    assert [m.id for m in client.models.list()] == ["lamina-tiny"]
    assert httpx.get(stack.base_url + "/health").status_code == 200
    assert httpx.get(stack.base_url + "/ready").status_code == 200


def test_completion_matches_the_in_process_engine(client, tiny_model, tokenizer):
    prompt = "The engine reads a prompt and"
    out = client.completions.create(model="lamina-tiny", prompt=prompt, max_tokens=12, **GREEDY)
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    engine = Engine(
        EngineConfig(model=tiny_model, max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    )
    engine.add_request("local", ids, Sampling(max_tokens=12, temperature=0, ignore_eos=True))
    tokens = []
    while engine.has_work():
        for o in engine.step():
            tokens += o.new_token_ids
    assert out.choices[0].text == tokenizer.decode(tokens)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 12)


def test_token_id_prompts_and_streaming_completion_usage(client):
    stream = client.completions.create(
        model="lamina-tiny",
        prompt=[5, 6, 7, 8],
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.prompt_tokens == 4 and chunks[-1].usage.completion_tokens == 9
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    same = client.completions.create(
        model="lamina-tiny", prompt=[5, 6, 7, 8], max_tokens=9, **GREEDY
    )
    assert same.choices[0].text == text


def test_chat_streaming_and_not(client):
    messages = [{"role": "user", "content": "Tell me about the cache"}]
    full = client.chat.completions.create(
        model="lamina-tiny", messages=messages, max_completion_tokens=10, **GREEDY
    )
    assert full.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model="lamina-tiny",
            messages=messages,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stop_strings_end_the_text(client):
    prompt = "The engine reads"  # continues with real words on the default model
    free = (
        client.completions.create(model="lamina-tiny", prompt=prompt, max_tokens=16, **GREEDY)
        .choices[0]
        .text
    )
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert stop.strip()
    out = client.completions.create(
        model="lamina-tiny", prompt=prompt, max_tokens=16, stop=[stop], **GREEDY
    )
    assert out.choices[0].text == free[: free.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(
        model="lamina-tiny",
        prompt="Seeds",
        max_tokens=12,
        temperature=1.0,
        seed=7,
        top_p=0.9,
        extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1},
    )
    assert (
        client.completions.create(**kwargs).choices[0].text
        == client.completions.create(**kwargs).choices[0].text
    )


def test_bad_requests_get_openai_errors(stack, client):
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="lamina-tiny", prompt="x", max_tokens=10**9)
    assert "maximum context length" in too_long.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="lamina-tiny", prompt=[10**7], max_tokens=1)
    response = httpx.post(stack.base_url + "/v1/completions", content=b"{not json")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    response = httpx.post(
        stack.base_url + "/v1/chat/completions", json={"messages": "hello", "max_tokens": 1}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    # Under the gateway's 16 MiB body limit, over NATS's 1 MiB max_payload on the way on.
    response = httpx.post(
        stack.base_url + "/v1/completions", json={"prompt": [1000] * 300_000, "max_tokens": 1}
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "request_too_large"
    response = httpx.get(stack.base_url + "/v1/completions")  # the route is POST only
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_fifty_concurrent_streams_all_complete(stack, tokenizer):
    client = openai.AsyncOpenAI(
        base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )

    async def one(i: int) -> tuple[int, Any, str]:
        stream = await client.completions.create(
            model="lamina-tiny",
            prompt=f"Request number {i} says",
            max_tokens=8 + i % 5,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        usage, text = None, ""
        async for chunk in stream:
            usage = chunk.usage or usage
            text += "".join(c.text for c in chunk.choices)
        return i, usage, text

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(50))), 180)

    results = asyncio.run(main())
    assert len(results) == 50
    for i, usage, _ in results:
        prompt = tokenizer.encode(f"Request number {i} says", add_special_tokens=False).ids
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 8 + i % 5)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_one_trace_spans_gateway_scheduler_and_worker(client, trace_file):
    client.completions.create(model="lamina-tiny", prompt="trace me", max_tokens=3, **GREEDY)
    deadline = time.monotonic() + 10
    services: set[str] = set()
    while time.monotonic() < deadline:
        spans = read_spans(trace_file)
        roots = [
            s
            for s in spans
            if s["name"] == "generate lamina-tiny"
            and s["attributes"].get("gen_ai.usage.output_tokens") == 3
            and s["attributes"].get("gen_ai.request.max_tokens") == 3
        ]
        if roots:
            trace_id = roots[-1]["trace_id"]
            services = {s["service"] for s in spans if s["trace_id"] == trace_id}
            if {"gateway", "scheduler", "engine-worker"} <= services:
                break
        time.sleep(0.2)
    else:
        pytest.fail(f"no trace spanning all three services; services seen: {services}")
    in_trace = [s for s in spans if s["trace_id"] == trace_id]
    names = {s["name"] for s in in_trace}
    assert "lamina.v1.sched.submit process" in names
    assert "lamina.v1.worker.worker-0.generate process" in names
    assert "(temporary) publish" in names  # the worker's token events


def test_vllm_bench_serve_payload(stack):
    """The exact request ``vllm bench serve --backend openai`` sends, parsed as it parses."""
    payload = {
        "model": "lamina-tiny",
        "prompt": "benchmark prompt",
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 7,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "best_of": 1,
    }
    text, usage = "", None
    with httpx.stream("POST", stack.base_url + "/v1/completions", json=payload) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        if chunk["choices"]:
            text += chunk["choices"][0]["text"]
        elif chunk.get("usage"):
            usage = chunk["usage"]
    assert usage["completion_tokens"] == 7 and text
