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
        tiny_model, tmp_path, gateway_args=["--accept-timeout", "5", "--max-attempts", "2"]
    )
    with stack:
        response, elapsed = kill_and_ask(stack, "worker-0")
        assert response.status_code == 503, response.text
        assert response.json()["error"]["type"] == "service_unavailable"
        assert elapsed < 40, f"took {elapsed:.1f}s"  # two accept timeouts, not the 60 s stall
        # Once the scheduler has declared the worker dead, rejection is immediate: no
        # accept timeout (5 s) is waited out.
        wait_until_scheduler_forgets_alive(stack.nats_url, "worker-0", timeout=10)
        started = time.monotonic()
        response = httpx.post(
            stack.base_url + "/v1/completions",
            timeout=30,
            json={"prompt": "anyone there?", "max_tokens": 4},
        )
        assert response.status_code == 503
        assert time.monotonic() - started < 5.0
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
        assert elapsed < 40, f"took {elapsed:.1f}s"  # not the 60 s stall timeout


PENALISED = {  # settings that look at the output so far: a move must carry it as output
    "max_tokens": 600,
    "temperature": 0,
    "ignore_eos": True,
    "frequency_penalty": 0.6,
    "presence_penalty": 0.4,
    "repetition_penalty": 1.3,
    "min_tokens": 550,
}
PROMPTS = [f"keep going {i}" for i in range(4)]


def undisturbed(stack, body: dict) -> list[str]:
    """Each of ``PROMPTS``' texts, one request at a time, before any fault."""
    url = stack.base_url + "/v1/completions"
    return [
        httpx.post(url, json=body | {"prompt": p}, timeout=60).json()["choices"][0]["text"]
        for p in PROMPTS
    ]


def streams_through(stack, body: dict, fault) -> list[tuple[str, dict | None, list]]:
    """Stream ``PROMPTS`` at once; once every one is flowing, ``await fault(client)``;
    return each stream's ``(text, final usage, error chunks)``."""
    url = stack.base_url + "/v1/completions"

    async def stream(client: httpx.AsyncClient, prompt: str, flowing: asyncio.Event):
        request = body | {"prompt": prompt, "stream": True}
        request["stream_options"] = {"include_usage": True}
        text, usage, errors = "", None, []
        async with client.stream("POST", url, json=request, timeout=120) as response:
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
            flowing = [asyncio.Event() for _ in PROMPTS]
            tasks = [
                asyncio.create_task(stream(client, p, f))
                for p, f in zip(PROMPTS, flowing, strict=True)
            ]
            for event in flowing:
                await asyncio.wait_for(event.wait(), 30)
            await fault(client)
            return await asyncio.wait_for(asyncio.gather(*tasks), 150)

    return asyncio.run(main())


def assert_exact(results: list, expected: list[str], tokens: int) -> None:
    """Every stream completed with no error, the undisturbed text and whole usage."""
    for (text, usage, errors), want in zip(results, expected, strict=True):
        assert errors == []
        assert text == want
        assert usage["completion_tokens"] == tokens


async def busiest_worker(stack, client: httpx.AsyncClient) -> str:
    """The worker running the most requests, by the heartbeats telemetry has (streams can
    be flowing before the first heartbeat that shows them: wait for one, briefly)."""
    cluster = stack.metrics_url.replace("/metrics", "/v1/cluster")
    deadline = time.monotonic() + 3
    while True:
        workers = (await client.get(cluster)).json()["workers"]
        busiest = max(workers, key=lambda w: w["num_running"])
        if busiest["num_running"] > 0:
            return busiest["worker_id"]
        assert time.monotonic() < deadline, workers
        await asyncio.sleep(0.1)


def two_workers(tiny_model, tmp_path):
    return make_stack(tiny_model, tmp_path, workers=2, worker_args=["--max-model-len", "2048"])


def test_streams_migrate_token_exact_when_their_worker_is_killed(tiny_model, tmp_path):
    """SIGKILL the busier of two workers mid-stream: every stream completes, with the text
    an undisturbed run gives (greedy, with output-sensitive penalties) and full usage."""
    with two_workers(tiny_model, tmp_path) as stack:
        expected = undisturbed(stack, PENALISED)

        async def kill(client) -> None:
            stack.procs[await busiest_worker(stack, client)].kill()

        results = streams_through(stack, PENALISED, kill)
    assert_exact(results, expected, 600)


def test_a_worker_stopped_past_its_heartbeats_loses_its_streams_to_the_other_and_no_token_doubles(
    tiny_model, tmp_path
):
    """SIGSTOP the busier worker for longer than the heartbeat window, then SIGCONT: its
    streams moved meanwhile, and what it sends on waking lands nowhere."""
    with two_workers(tiny_model, tmp_path) as stack:
        expected = undisturbed(stack, PENALISED)

        async def stop_then_continue(client) -> None:
            proc = stack.procs[await busiest_worker(stack, client)]
            proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(4)  # the gateway declares it lost after 1.5 s
            proc.send_signal(signal.SIGCONT)

        results = streams_through(stack, PENALISED, stop_then_continue)
    assert_exact(results, expected, 600)


def test_in_flight_streams_outlive_a_killed_scheduler_and_new_requests_wait_for_its_successor(
    tiny_model, tmp_path
):
    """Tokens flow worker to gateway: the scheduler's loss does not touch open streams.
    New requests get a fast 503 until a scheduler is back, then succeed."""
    with two_workers(tiny_model, tmp_path) as stack:
        expected = undisturbed(stack, PENALISED)
        url = stack.base_url + "/v1/completions"
        during: list[int] = []

        async def kill(client) -> None:
            proc = stack.procs.pop("scheduler")
            proc.kill()
            proc.wait()
            during.append(
                (await client.post(url, json={"prompt": "x", "max_tokens": 2})).status_code
            )
            stack.start_scheduler("successor")

        results = streams_through(stack, PENALISED, kill)
        after = httpx.post(url, json={"prompt": "after", "max_tokens": 2}, timeout=30)
    assert_exact(results, expected, 600)
    assert during == [503] and after.status_code == 200


def test_a_killed_nats_server_restarted_on_its_port_loses_no_accepted_request(tiny_model, tmp_path):
    """SIGKILL nats-server mid-stream and start it again on the same port: the services
    reconnect and every stream that was accepted completes, with the undisturbed text."""
    with two_workers(tiny_model, tmp_path) as stack:
        expected = undisturbed(stack, PENALISED)

        async def cut_the_bus(client) -> None:
            stack.nats._proc.kill()
            stack.nats._proc.wait()
            await asyncio.sleep(1)
            await asyncio.to_thread(stack.nats.start)

        results = streams_through(stack, PENALISED, cut_the_bus)
    assert_exact(results, expected, 600)


def test_sigterm_to_the_gateway_finishes_its_open_streams_then_exits(tiny_model, tmp_path):
    with make_stack(tiny_model, tmp_path) as stack:
        results = asyncio.run(sigterm_under_load(stack, "gateway", 6, 64))
        assert results == [(64, 64, "length")] * 6  # every open stream finished
        with pytest.raises(httpx.TransportError):  # and it takes no new connections
            httpx.get(stack.base_url + "/health", timeout=2)
        assert stack.procs["gateway"].wait(30) == 0


def test_with_the_scheduler_gone_a_request_gets_its_503_without_an_accept_timeout(
    tiny_model, tmp_path
):
    with make_stack(tiny_model, tmp_path) as stack:
        response, elapsed = kill_and_ask(stack, "scheduler")
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    assert "no scheduler is running" in response.json()["error"]["message"]
    assert elapsed < 5.0, f"took {elapsed:.2f}s"  # under one accept timeout (5 s), let alone 3


def test_a_killed_gateways_requests_stop_on_their_worker_and_free_its_blocks(tiny_model, tmp_path):
    """SIGKILL the gateway under 24 open streams (two run at a time, the rest wait): the
    worker stops them within a few gateway heartbeats, not after all their tokens, and
    gives their blocks back."""
    streams, max_tokens = 24, 2000
    stack = make_stack(
        tiny_model, tmp_path, worker_args=["--max-model-len", "2048", "--max-num-seqs", "2"]
    )
    with stack:
        cluster = stack.metrics_url.replace("/metrics", "/v1/cluster")
        body = {"prompt": "on and on", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

        async def open_streams() -> None:
            flowing = asyncio.Event()

            async def one(client: httpx.AsyncClient) -> None:
                url = stack.base_url + "/v1/completions"
                async with client.stream("POST", url, json=body, timeout=60) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            flowing.set()

            async with httpx.AsyncClient() as client:
                tasks = [asyncio.create_task(one(client)) for _ in range(streams)]
                await asyncio.wait_for(flowing.wait(), 30)
                # Every request is in, and the worker has heard the gateway's heartbeat (every
                # 2 s; a worker leaves alone the requests of a requester it never heard).
                await asyncio.sleep(2.5)
                stack.procs["gateway"].kill()
                await asyncio.gather(*tasks, return_exceptions=True)  # connections drop

        asyncio.run(open_streams())
        killed = time.monotonic()
        worker = None
        while time.monotonic() - killed < 30:
            (worker,) = httpx.get(cluster).json()["workers"]
            if worker["num_running"] == 0 and worker["num_waiting"] == 0:
                break
            time.sleep(0.2)
        stopped_after = time.monotonic() - killed
    assert worker["num_running"] == 0 and stopped_after < 12, (stopped_after, worker)
    assert worker["generation_tokens_total"] < streams * max_tokens / 2  # stopped early
    assert worker["free_kv_blocks"] == worker["total_kv_blocks"]
