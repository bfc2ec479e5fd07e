"""The OpenAI API through gateway → scheduler → worker, with the official client."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from typing import Any

import httpx
import msgspec
import nats
import openai
import pytest
import torch

from lamina.schemas.v1.api import ApiRequest
from lamina.schemas.v1.generate import Sampling
from lamina.schemas.v1.subjects import API_GENERATE
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.params import SamplingParams
from tests.e2e.conftest import read_spans

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_models_and_health(stack, client):
    assert [m.id for m in client.models.list()] == ["lamina-tiny"]
    model = client.models.retrieve("lamina-tiny")
    assert model.id == "lamina-tiny" and model.created > 0
    assert model.model_extra["max_model_len"] == 1024  # vLLM's field: the worker's context
    precision = {
        "weight_dtype": "float32",
        "dtype": "float32",
        "kv_cache_dtype": "float32",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
    }
    assert model.model_extra["precisions"] == [precision | {"workers": 1}]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.body["code"] == "model_not_found"
    assert httpx.get(stack.base_url + "/v1/models/org/model").status_code == 404
    assert httpx.get(stack.base_url + "/health").status_code == 200
    assert httpx.get(stack.base_url + "/ready").status_code == 200


def test_completion_matches_the_in_process_engine(client, tiny_model, tokenizer):
    prompt = "The engine reads a prompt and"
    out = client.completions.create(model="lamina-tiny", prompt=prompt, max_tokens=12, **GREEDY)
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    engine = Engine(
        EngineConfig(model=tiny_model, max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    )
    engine.add_request("local", ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    tokens = []
    while engine.has_work():
        for o in engine.step().outputs:
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


def traced_request(client, trace_file, max_tokens: int, prompt: str = "trace me") -> list[dict]:
    """One completion sent inside a caller's trace (W3C ``traceparent``); the spans of that
    trace once gateway, scheduler and worker have all exported theirs."""
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    client.completions.create(
        model="lamina-tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        **GREEDY,
    )
    deadline, services = time.monotonic() + 10, set()
    while time.monotonic() < deadline:
        spans = [s for s in read_spans(trace_file) if s["trace_id"] == trace_id]
        services = {s["service"] for s in spans}
        names = {s["name"] for s in spans}
        # The last to end: the worker's span, and the gateway's once the reply is in.
        ends = {"serve lamina-tiny", "generate lamina-tiny"}
        if {"gateway", "scheduler", "engine-worker"} <= services and ends <= names:
            (root,) = [s for s in spans if s["name"] == "generate lamina-tiny"]
            assert root["parent_id"] == parent  # a child of the caller's span
            return spans
        time.sleep(0.2)
    pytest.fail(f"no trace {trace_id} spanning all three services; seen: {services}")


def test_one_trace_follows_the_caller_through_gateway_scheduler_and_worker(client, trace_file):
    long_prompt = "a prompt long enough to fill several cache blocks " * 8
    traced_request(client, trace_file, 2, long_prompt)  # stores blocks: a traced KV batch
    spans = traced_request(client, trace_file, 3, long_prompt)
    by_name = {s["name"]: s for s in spans}
    assert "lamina.v1.sched.submit process" in by_name
    assert "lamina.v1.worker.worker-0.generate process" in by_name
    served = by_name["serve lamina-tiny"]  # the worker's side, acceptance to finish
    assert served["attributes"]["gen_ai.usage.output_tokens"] == 3
    assert served["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
    assert served["attributes"]["lamina.end"] == "finished"
    # Its phases: scheduled (after its time in the queue), its prompt's one chunk, the
    # first token in the same step.
    assert served["events"] == ["scheduled", "prefill_chunk", "first_token"]
    # The engine steps that served it: one prefill, two decodes, under its span and
    # linked to it, each with the batch it ran.
    steps = [s for s in spans if s["name"] == "engine step"]
    assert [s["attributes"]["lamina.batch.prefill_seqs"] for s in steps] == [1, 0, 0]
    assert [s["attributes"]["lamina.batch.decode_seqs"] for s in steps] == [0, 1, 1]
    assert {s["parent_id"] for s in steps} == {served["span_id"]}
    assert all(s["links"] == [served["span_id"]] for s in steps)
    usage = [s["attributes"]["lamina.kv_cache_usage"] for s in steps]  # after each step
    assert 0 < usage[0] <= 1 and usage[-1] == 0  # the last step freed its blocks
    # Placement, told on the submit's span (placed as it arrived): the choice among the
    # candidates, what each scored, and links to what it was decided by: the worker's last
    # traced heartbeat and KV event batch (the first request's, which stored this prompt's
    # blocks), all of them in the trace store.
    place = by_name["lamina.v1.sched.submit process"]
    assert place["attributes"]["lamina.placement.worker_id"] == "worker-0"
    assert place["attributes"]["lamina.placement.prefix_hit_blocks"] > 0
    assert place["attributes"]["lamina.candidate.worker_id"] == ["worker-0"]
    assert len(place["attributes"]["lamina.candidate.predicted_ttft_s"]) == 1
    stored = read_spans(trace_file)
    heartbeats = {
        s["span_id"] for s in stored if s["name"] == "lamina.v1.worker.worker-0.stats publish"
    }
    kv_batches = {s["span_id"] for s in stored if s["name"] == "kv_events worker-0"}
    assert len(place["links"]) == 2
    assert place["links"][0] in heartbeats and place["links"][1] in kv_batches
    # Token events carry the trace but are not a span each: a longer output adds only
    # its engine steps.
    per_step = ("engine step", "kv_events worker-0")
    longer = traced_request(client, trace_file, 24)
    others = [s for s in longer if s["name"] not in per_step]
    assert len(others) == len([s for s in spans if s["name"] not in per_step])
    assert len([s for s in longer if s["name"] == "engine step"]) == 24


def test_telemetry_shows_a_slow_requests_trace_as_its_latency_exemplar(client, stack, trace_file):
    spans = traced_request(client, trace_file, 2)
    trace_id = spans[0]["trace_id"]
    openmetrics = {"accept": "application/openmetrics-text; version=1.0.0"}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        response = httpx.get(stack.metrics_url, headers=openmetrics)
        assert response.headers["content-type"].startswith("application/openmetrics-text")
        exemplars = [
            line
            for line in response.text.splitlines()
            if line.startswith("lamina:time_to_first_token_seconds_bucket") and "# {" in line
        ]
        if any(trace_id in line for line in exemplars):
            return
        time.sleep(0.2)
    pytest.fail(f"no TTFT exemplar for trace {trace_id}: {exemplars}")


def test_vllms_metrics_come_from_the_engine_and_the_gateway(client, stack):
    """With ``--metrics-compat vllm``: vLLM's names and labels, fed through every layer
    (the engine's phases and steps on the worker's wire, the gateway's latencies)."""
    client.completions.create(model="lamina-tiny", prompt="count me", max_tokens=4, **GREEDY)
    labels = '{engine="worker-0",model_name="lamina-tiny"}'
    wanted = [
        f"vllm:request_queue_time_seconds_count{labels}",
        f"vllm:request_decode_time_seconds_count{labels}",
        f"vllm:request_time_per_output_token_seconds_count{labels}",
        f"vllm:iteration_tokens_total_count{labels}",
        f"vllm:time_to_first_token_seconds_count{labels}",
        f"vllm:request_params_max_tokens_count{labels}",
        f"vllm:prompt_tokens_total{labels}",
    ]
    deadline, values = time.monotonic() + 10, {}
    while time.monotonic() < deadline:
        text = httpx.get(stack.metrics_url).text
        values = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:")
        }
        if all(values.get(name, 0) > 0 for name in wanted):
            break
        time.sleep(0.2)
    missing = [name for name in wanted if values.get(name, 0) <= 0]
    assert not missing, missing
    # Token-count buckets: vLLM's 1-2-5 up to the worker's max_model_len (1024).
    bounds = {
        line.split('le="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("vllm:request_prompt_tokens_bucket")
    }
    assert bounds == {"1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0",
                      "1000.0", "+Inf"}  # fmt: skip


def test_housekeeping_makes_no_traces_but_sampled_heartbeats(client, trace_file):
    """KV event batches, gateway liveness and the readiness poll run every second or so
    and start no trace; of the heartbeats (two a second) one in twenty is traced, and
    every change of state."""
    client.completions.create(model="lamina-tiny", prompt="and then", max_tokens=2, **GREEDY)
    time.sleep(1.5)  # several heartbeats and polls
    spans = read_spans(trace_file)
    names = {s["name"] for s in spans}
    assert not [n for n in names if n.endswith((".alive publish", ".kv publish"))]
    assert not any("sched.status" in n for n in names)
    beats = [s for s in spans if s["name"] == "heartbeat worker-0"]
    publishes = [s for s in spans if s["name"].endswith(".stats publish")]
    assert {s["parent_id"] for s in publishes} <= {s["span_id"] for s in beats}
    seconds = (max(s["end"] for s in spans) - min(s["start"] for s in spans)) / 1e9
    assert 1 <= len(beats) <= seconds / 10 + 6  # the first, every 10 s, state changes


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


def test_the_nats_api_continues_the_callers_trace(stack, trace_file):
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    request = ApiRequest(
        prompt="traced over NATS", sampling=Sampling(max_tokens=2, ignore_eos=True)
    )

    async def main() -> None:
        nc = await nats.connect(stack.nats_url)
        inbox, done = nc.new_inbox(), asyncio.Event()

        async def on_event(msg) -> None:
            if json.loads(msg.data)["type"] in ("ApiFinished", "ApiError"):
                done.set()

        await nc.subscribe(inbox, cb=on_event)
        headers = {"traceparent": f"00-{trace_id}-{parent}-01"}
        await nc.publish(API_GENERATE, msgspec.json.encode(request), reply=inbox, headers=headers)
        await asyncio.wait_for(done.wait(), 30)
        await nc.drain()

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        spans = {s["name"]: s for s in read_spans(trace_file) if s["trace_id"] == trace_id}
        if "generate lamina-tiny" in spans and "serve lamina-tiny" in spans:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"no trace {trace_id} with the gateway's and the worker's spans")
    consumer = spans["lamina.v1.api.generate process"]
    assert consumer["parent_id"] == parent  # the caller's span
    assert spans["generate lamina-tiny"]["parent_id"] == consumer["span_id"]


def test_a_control_command_is_one_trace_from_the_operator_to_the_worker_and_back(stack, trace_file):
    program = "import sys; from lamina.services.cli import main; sys.exit(main())"
    for command in ("cordon", "uncordon"):
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                program,
                "ctl",
                "--nats-url",
                stack.nats_url,
                command,
                "worker-0",
            ],
            env={**os.environ, "LAMINA_TRACE_FILE": str(trace_file)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        spans = read_spans(trace_file)
        roots = [s for s in spans if s["name"] == "ctl cordon" and s["service"] == "lamina-ctl"]
        if roots:
            in_trace = {
                (s["service"], s["name"]) for s in spans if s["trace_id"] == roots[-1]["trace_id"]
            }
            if ("engine-worker", "lamina.v1.worker.worker-0.control process") in in_trace:
                break
        time.sleep(0.2)
    else:
        pytest.fail("no trace of `lamina ctl cordon` reaching the worker")
    assert ("lamina-ctl", "lamina.v1.worker.worker-0.control publish") in in_trace
    assert ("engine-worker", "(temporary) publish") in in_trace  # the acknowledgement back


def test_a_batch_of_prompts_is_a_choice_per_prompt_streamed_or_not(client):
    """A list of prompts (text, or token-id lists) runs as parallel requests: choice ``i``
    is what prompt ``i`` alone gives (greedy), usage is their sum."""
    prompts = ["Once upon", "The cat sat", "In a land far"]
    alone = [
        client.completions.create(model="lamina-tiny", prompt=p, max_tokens=6, **GREEDY)
        for p in prompts
    ]
    batch = client.completions.create(model="lamina-tiny", prompt=prompts, max_tokens=6, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 18

    stream = client.completions.create(
        model="lamina-tiny",
        prompt=prompts,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    texts, finished, usage = ["", "", ""], set(), None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == [c.text for c in batch.choices] and finished == {0, 1, 2}
    assert usage.completion_tokens == 18 and usage.prompt_tokens == batch.usage.prompt_tokens

    ids = [[5, 6, 7], [8, 9]]
    by_ids = client.completions.create(model="lamina-tiny", prompt=ids, max_tokens=2, **GREEDY)
    assert by_ids.usage.prompt_tokens == 5 and len(by_ids.choices) == 2


def test_one_refused_prompt_refuses_the_whole_batch(stack):
    response = httpx.post(
        stack.base_url + "/v1/completions",
        json={"prompt": [[5, 6], [10**6]], "max_tokens": 2},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_stop_token_stays_out_of_the_text_unless_asked_and_logprobs_can_name_ids(client):
    """A request that ends on one of its ``stop_token_ids`` leaves that token's text out
    (vLLM's), unless ``include_stop_str_in_output``; ``return_tokens_as_token_ids`` names
    the logprobs' tokens by id."""
    free = client.completions.create(
        model="lamina-tiny", prompt="Tokens to stop on", max_tokens=8, logprobs=0, **GREEDY
    )
    tokens = free.choices[0].logprobs.tokens
    ids = (
        client.completions.create(
            model="lamina-tiny",
            prompt="Tokens to stop on",
            max_tokens=8,
            logprobs=1,
            temperature=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        .choices[0]
        .logprobs
    )
    assert all(t.startswith("token_id:") for t in ids.tokens)
    assert all(k.startswith("token_id:") for top in ids.top_logprobs for k in top)
    stop_id = int(ids.tokens[3].removeprefix("token_id:"))
    first = ids.tokens.index(f"token_id:{stop_id}")  # it may occur before position 3
    for include, upto in ((False, first), (True, first + 1)):
        stopped = client.completions.create(
            model="lamina-tiny",
            prompt="Tokens to stop on",
            max_tokens=8,
            temperature=0,
            extra_body={
                "ignore_eos": True,
                "stop_token_ids": [stop_id],
                "include_stop_str_in_output": include,
            },
        ).choices[0]
        assert stopped.finish_reason == "stop"
        assert stopped.text == "".join(tokens[:upto])


def test_logit_bias_allowed_token_ids_and_bad_words_steer_the_tokens(client):
    def ids(**extra) -> list[int]:
        choice = client.completions.create(
            model="lamina-tiny",
            prompt="Steer me",
            max_tokens=8,
            logprobs=0,
            temperature=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **extra},
        ).choices[0]
        return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]

    free = ids()
    assert set(ids(logit_bias={"77": 100})) == {77}
    assert set(ids(allowed_token_ids=[40, 41, 42])) <= {40, 41, 42}
    word = (
        client.completions.create(model="lamina-tiny", prompt="Steer me", max_tokens=1, **GREEDY)
        .choices[0]
        .text
    )
    assert free[0] not in ids(bad_words=[word])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
    ],
)
def test_token_rules_out_of_range_are_400s_naming_the_field(stack, extra, param):
    body = {"prompt": "x", "max_tokens": 1, **extra}
    response = httpx.post(stack.base_url + "/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)


def test_echo_starts_each_choice_with_its_prompt(client, stack, tokenizer):
    prompts = ["Echo this", [5, 6, 7]]
    plain = client.completions.create(model="lamina-tiny", prompt=prompts, max_tokens=4, **GREEDY)
    echoed = client.completions.create(
        model="lamina-tiny", prompt=prompts, max_tokens=4, echo=True, **GREEDY
    )
    heads = ["Echo this", tokenizer.decode([5, 6, 7])]
    expected = [h + c.text for h, c in zip(heads, plain.choices, strict=True)]
    assert [c.text for c in echoed.choices] == expected
    assert echoed.usage == plain.usage
    stream = client.completions.create(
        model="lamina-tiny", prompt=prompts, max_tokens=4, echo=True, stream=True, **GREEDY
    )
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in echoed.choices]


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, stack, tiny_model):
    """What evaluation harnesses send for a loglikelihood: the prompt's logprobs lead the
    choice's, the first token without one; vLLM's ``prompt_logprobs`` too."""
    import transformers

    ids = [0, 17, 254, 980, 33, 401, 7]
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model).eval()
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    reply = client.completions.create(
        model="lamina-tiny", prompt=ids, max_tokens=1, echo=True, logprobs=2, temperature=0
    )
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, len(ids)):
        expected = float(want[position - 1, ids[position]])
        assert logprobs.token_logprobs[position] == pytest.approx(expected, abs=1e-3)
        top = logprobs.top_logprobs[position]  # the prompt's token first, then the top two
        assert next(iter(top.values())) == logprobs.token_logprobs[position]
        assert 2 <= len(top) <= 3
    scores = choice.model_extra["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(ids)
    second = scores[1][str(ids[1])]
    assert second["logprob"] == pytest.approx(float(want[0, ids[1]]), abs=1e-3)
    assert second["rank"] == int((want[0] > want[0, ids[1]]).sum()) + 1
    # vLLM's prompt_logprobs on a chat: the rendered prompt's tokens, at the top level.
    chat = client.chat.completions.create(
        model="lamina-tiny",
        messages=[{"role": "user", "content": "score me"}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    scored = chat.model_extra["prompt_logprobs"]
    assert len(scored) == chat.usage.prompt_tokens and scored[0] is None
    assert all(len(entry) == 1 for entry in scored[1:])  # just the prompt's own token
    # Not streamed, as in vLLM: refused, naming the field.
    for body, param in (
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ):
        response = httpx.post(
            stack.base_url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 1, "stream": True, **body},
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_n_sequences_per_prompt_each_a_choice(client):
    kwargs = dict(
        model="lamina-tiny", max_tokens=6, temperature=1.0, seed=7, extra_body={"ignore_eos": True}
    )
    reply = client.completions.create(prompt="Once upon a time", n=3, **kwargs)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    single = client.completions.create(prompt="Once upon a time", **kwargs)
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt once
    assert reply.usage.completion_tokens == 18  # every sequence's output
    # Sequence i draws from seed + i (vLLM's rule): each is the single request so seeded.
    for choice in reply.choices:
        alone = client.completions.create(
            prompt="Once upon a time", **(kwargs | {"seed": 7 + choice.index})
        )
        assert choice.text == alone.choices[0].text
    assert len({c.text for c in reply.choices}) > 1
    # Streamed, each chunk names its choice; a batch of prompts is prompt-major.
    chunks = client.completions.create(
        prompt=["Once upon a time", "The engine"], n=2, stream=True, **kwargs
    )
    texts = ["", "", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts[:2] == [c.text for c in reply.choices[:2]]
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hello"}], n=2, **kwargs
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage.completion_tokens == 12


def test_n_sequences_share_their_prompts_scores(client):
    """The first of a prompt's ``n`` sequences scores the prompt; every choice gets it."""
    reply = client.completions.create(
        model="lamina-tiny", prompt=[5, 6, 7, 8], n=3, max_tokens=2, echo=True, logprobs=1
    )
    scores = [c.model_extra["prompt_logprobs"] for c in reply.choices]
    assert scores[0] is not None and len(scores[0]) == 4 and scores[1] == scores[0] == scores[2]
    for choice in reply.choices:
        assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == 6
