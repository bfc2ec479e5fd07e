"""Worker loss and worker drain, each on its own stack."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from lamina.libs.bus import Bus
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.stats import ClusterStatus, ClusterStatusRequest
from tests.e2e.conftest import make_stack

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def kill_and_ask(stack, service: str) -> tuple[httpx.Response, float]:
    """SIGKILL ``service``, then one completion: its response and how long it took."""
    proc = stack.procs[service]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    started = time.monotonic()
    response = httpx.post(
        stack.base_url + "/v1/completions",
        timeout=30,
        json={"prompt": "anyone there?", "max_tokens": 4},
    )
    return response, time.monotonic() - started


def test_killing_the_only_worker_fails_new_requests_fast_with_503(tiny_model, tmp_path):
    stack = make_stack(
        tiny_model, tmp_path, gateway_args=["--accept-timeout", "1", "--max-attempts", "2"]
    )
    with stack:
        response, elapsed = kill_and_ask(stack, "worker-0")
        assert response.status_code == 503, response.text
        assert response.json()["error"]["type"] == "service_unavailable"
        assert elapsed < 10, f"took {elapsed:.1f}s"
        # Once the scheduler has declared the worker dead, rejection is immediate.
        wait_until_scheduler_forgets_alive(stack.nats_url, "worker-0", timeout=10)
        started = time.monotonic()
        response = httpx.post(
            stack.base_url + "/v1/completions",
            timeout=30,
            json={"prompt": "anyone there?", "max_tokens": 4},
        )
        assert response.status_code == 503
        assert time.monotonic() - started < 1.0
        # The gateway polls the scheduler's view (every 0.5 s): /ready follows it.
        deadline = time.monotonic() + 5
        while httpx.get(stack.base_url + "/ready").status_code != 503:
            assert time.monotonic() < deadline, "/ready still says ready"
            time.sleep(0.1)


def wait_until_scheduler_forgets_alive(nats_url: str, worker_id: str, timeout: float) -> None:
    """Wait (bounded) until the scheduler's own view (``sched.status``) has ``worker_id``
    dead or gone: the event the test means, not a guess at the heartbeat window."""

    async def alive() -> bool:
        bus = await Bus.connect(nats_url, "test-faults-status")
        try:
            status = await bus.request(
                subjects.SCHED_STATUS, ClusterStatusRequest(), ClusterStatus, timeout=5
            )
        finally:
            await bus.close()
        return any(w.alive for w in status.workers if w.stats.worker_id == worker_id)

    deadline = time.monotonic() + timeout
    while asyncio.run(alive()):
        assert time.monotonic() < deadline, f"the scheduler still has {worker_id} alive"
        time.sleep(0.1)


async def sigterm_under_load(stack, service: str, streams: int, max_tokens: int) -> list:
    """Open ``streams`` greedy streams, SIGTERM ``service`` once every one is generating,
    and return ``(tokens received, tokens the final usage counts, finish reason)`` each."""
    client = openai.AsyncOpenAI(
        base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )
    streaming = [asyncio.Event() for _ in range(streams)]

    async def one(i: int) -> tuple[int, int, str | None]:
        stream = await client.completions.create(
            model="lamina-tiny",
            prompt=f"load {i}",
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=0,  # one logprobs entry per token: the tokens can be counted
            **GREEDY,
        )
        received, usage, reason = 0, None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs:
                received += len(chunk.choices[0].logprobs.tokens)
                streaming[i].set()
            if chunk.choices:
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        return received, usage.completion_tokens, reason

    tasks = [asyncio.create_task(one(i)) for i in range(streams)]
    for started in streaming:  # every request accepted and generating
        await asyncio.wait_for(started.wait(), 60)
    stack.procs[service].send_signal(signal.SIGTERM)
    return await asyncio.wait_for(asyncio.gather(*tasks), 120)


def test_sigterm_to_a_worker_under_load_finishes_every_accepted_request(tiny_model, tmp_path):
    with make_stack(tiny_model, tmp_path) as stack:
        results = asyncio.run(sigterm_under_load(stack, "worker-0", 12, 48))
        assert results == [(48, 48, "length")] * 12  # every token of every request
        assert stack.procs["worker-0"].wait(30) == 0  # drained, then exited cleanly


def test_a_worker_dying_mid_stream_ends_the_stream_in_seconds(tiny_model, tmp_path):
    stack = make_stack(tiny_model, tmp_path, worker_args=["--max-model-len", "2048"])
    with stack:
        body = {
            "prompt": "keep going",
            "max_tokens": 2000,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        events = []
        with httpx.stream(
            "POST", stack.base_url + "/v1/completions", json=body, timeout=60
        ) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break  # tokens are flowing
            stack.procs["worker-0"].kill()
            killed = time.monotonic()
            events = [line for line in lines if line.startswith("data: ")]
        elapsed = time.monotonic() - killed
        assert events[-1] == "data: [DONE]"
        # Its only worker is gone: migration finds no other, so the stream ends with a 503.
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "no_worker"
        assert elapsed < 10, f"took {elapsed:.1f}s"  # not the 60 s stall timeout


PENALISED = {  # settings that look at the output so far: a move must carry it as output
    "max_tokens": 600,
    "temperature": 0,
    "ignore_eos": True,
    "frequency_penalty": 0.6,
    "presence_penalty": 0.4,
    "repetition_penalty": 1.3,
    "min_tokens": 550,
}


def test_streams_migrate_token_exact_when_their_worker_is_killed(tiny_model, tmp_path):
    """SIGKILL the busier of two workers mid-stream: every stream completes, with the text
    an undisturbed run gives (greedy, with output-sensitive penalties) and full usage."""
    stack = make_stack(tiny_model, tmp_path, workers=2, worker_args=["--max-model-len", "2048"])
    prompts = [f"keep going {i}" for i in range(4)]
    with stack:
        url = stack.base_url + "/v1/completions"
        expected = [
            httpx.post(url, json=PENALISED | {"prompt": p}, timeout=60).json()["choices"][0]["text"]
            for p in prompts
        ]
        cluster = stack.metrics_url.replace("/metrics", "/v1/cluster")

        async def stream(client: httpx.AsyncClient, prompt: str, flowing: asyncio.Event):
            body = PENALISED | {"prompt": prompt, "stream": True}
            body["stream_options"] = {"include_usage": True}
            text, usage, errors = "", None, []
            async with client.stream("POST", url, json=body, timeout=120) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    errors += [chunk["error"]] if "error" in chunk else []
                    text += "".join(c["text"] for c in chunk.get("choices", []))
                    usage = chunk.get("usage") or usage
                    flowing.set()
            return text, usage, errors

        async def main():
            async with httpx.AsyncClient() as client:
                flowing = [asyncio.Event() for _ in prompts]
                tasks = [
                    asyncio.create_task(stream(client, p, f))
                    for p, f in zip(prompts, flowing, strict=True)
                ]
                for event in flowing:
                    await asyncio.wait_for(event.wait(), 30)
                workers = (await client.get(cluster)).json()["workers"]
                busiest = max(workers, key=lambda w: w["num_running"])
                assert busiest["num_running"] > 0, workers
                stack.procs[busiest["worker_id"]].kill()
                return await asyncio.gather(*tasks)

        results = asyncio.run(main())
    for (text, usage, errors), want in zip(results, expected, strict=True):
        assert errors == []
        assert text == want
        assert usage["completion_tokens"] == 600


def test_sigterm_to_the_gateway_finishes_its_open_streams_then_exits(tiny_model, tmp_path):
    with make_stack(tiny_model, tmp_path) as stack:
        results = asyncio.run(sigterm_under_load(stack, "gateway", 6, 64))
        assert results == [(64, 64, "length")] * 6  # every open stream finished
        with pytest.raises(httpx.TransportError):  # and it takes no new connections
            httpx.get(stack.base_url + "/health", timeout=2)
        assert stack.procs["gateway"].wait(30) == 0


def test_with_the_scheduler_gone_a_request_gets_its_503_within_a_second(tiny_model, tmp_path):
    with make_stack(tiny_model, tmp_path) as stack:
        response, elapsed = kill_and_ask(stack, "scheduler")
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    assert "no scheduler is running" in response.json()["error"]["message"]
    assert elapsed < 1.0, f"took {elapsed:.2f}s"
