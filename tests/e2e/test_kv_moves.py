"""KV that moves between workers through the whole stack: a prompt's prefix cached on a
worker the scheduler no longer places on (cordoned) is fetched by the worker it places
the prompt on instead, which the placement record says; the client sees the prefix
cached and gets the text the first worker gave; heartbeats and telemetry count what
moved. A drain that moves hands running streams to another worker with their KV."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

import httpx

from lamina.libs.bus import Bus
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.records import PlacementRecord
from tests.e2e.conftest import make_stack, read_spans
from tests.e2e.test_ctl import lamina_ctl, wait_for_status


def ctl(capsys, url: str, *args: str) -> None:
    """``lamina ctl`` that must succeed (waiting longer than its default on a loaded
    machine), or the test fails with what it said."""
    code, out = lamina_ctl(capsys, url, *args, "--timeout", "30")
    assert code == 0, out


def both_ready(capsys, url: str) -> None:
    """The stack is up once one worker is; a worker answers control once it is ready."""
    for worker in ("worker-0", "worker-1"):
        wait_for_status(capsys, url, worker, "ready")


def only_worker_0_takes_work(capsys, url: str) -> None:
    """Both workers ready, worker-1 cordoned: what comes next runs on worker-0, for a drain
    that moves it to worker-1."""
    both_ready(capsys, url)
    ctl(capsys, url, "cordon", "worker-1")
    wait_for_status(capsys, url, "worker-1", "cordoned")


async def completion_text(client: httpx.AsyncClient, body: dict, prompt: list[int]) -> str:
    """The text of a non-streamed completion of ``prompt`` (it must succeed)."""
    response = await client.post("/v1/completions", json=body | {"prompt": prompt})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


async def streamed_text(
    client: httpx.AsyncClient, body: dict, prompt: list[int], accepted: asyncio.Event
) -> tuple[str, int]:
    """A streamed completion's text and its number of chunks; ``accepted`` is set once
    its headers came (the gateway answers once a worker accepted the request)."""
    text, chunks = "", 0
    request = body | {"prompt": prompt, "stream": True}
    async with client.stream("POST", "/v1/completions", json=request) as response:
        accepted.set()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
                chunks += 1
    return text, chunks


def move_to_worker_1(capsys, url: str) -> None:
    """Uncordon worker-1, then drain worker-0 with a move: its streams go to worker-1."""
    ctl(capsys, url, "uncordon", "worker-1")
    ctl(capsys, url, "drain", "--move", "worker-0")


async def placed(url: str, call) -> tuple[object, PlacementRecord]:
    """``call()``'s result (run off the loop) and the one placement record it caused."""
    records: list[PlacementRecord] = []
    bus = await Bus.connect(url, "test-placed")
    try:

        async def on_record(record: PlacementRecord, _msg) -> None:
            records.append(record)

        await bus.subscribe(subjects.EVENTS_PLACEMENT, PlacementRecord, on_record)
        await bus.flush()
        result = await asyncio.to_thread(call)
        await asyncio.sleep(0.5)
    finally:
        await bus.close()
    (record,) = records
    return result, record


PREFIX = list(range(5, 133))  # 8 blocks of 16
QUESTION = [*PREFIX, 140, 141, 142]


def test_a_prefix_cached_on_a_cordoned_worker_is_fetched_by_the_one_placed(
    stories, tmp_path, capsys
):
    args = ["--max-model-len", "256"]
    spans_at = tmp_path / "spans.jsonl"
    env = {"LAMINA_TRACE_FILE": str(spans_at)}
    with make_stack(stories, tmp_path, workers=2, worker_args=args, extra_env=env) as stack:
        url = stack.nats_url
        both_ready(capsys, url)

        trace_id = secrets.token_hex(16)

        def complete() -> dict:
            body = {"prompt": QUESTION, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            traced = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
            response = httpx.post(
                stack.base_url + "/v1/completions", json=body, headers=traced, timeout=60
            )
            assert response.status_code == 200, response.text
            return response.json()

        def move_to(worker: str, away_from: str) -> None:
            ctl(capsys, url, "uncordon", worker)
            ctl(capsys, url, "cordon", away_from)
            wait_for_status(capsys, url, away_from, "cordoned")

        move_to("worker-0", away_from="worker-1")
        first, record = asyncio.run(placed(url, complete))
        assert record.worker_id == "worker-0"
        move_to("worker-1", away_from="worker-0")
        again, record = asyncio.run(placed(url, complete))

        assert record.worker_id == "worker-1"
        (scored,) = record.scored
        assert (scored.fetch_from, scored.fetch_blocks) == ("worker-0", 8)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PREFIX)
        cluster = httpx.get(stack.metrics_url.replace("/metrics", "/v1/cluster"), timeout=10)
        workers = {w["worker_id"]: w for w in cluster.json()["workers"]}
        assert workers["worker-1"]["kv_fetches_total"] == 1
        assert workers["worker-1"]["kv_fetched_blocks_total"] == 8
        assert workers["worker-0"]["kv_sent_blocks_total"] == 8
        metrics = httpx.get(stack.metrics_url, timeout=10).text
        labels = f'model="{stories.name}",worker_id="worker-1"'
        assert f"lamina:kv_fetched_blocks_total{{{labels}}} 8.0" in metrics
        # The transfer is a span of its own in the request's trace, on the receiver.
        deadline, fetches = time.monotonic() + 10, []
        while not fetches and time.monotonic() < deadline:
            spans = [s for s in read_spans(spans_at) if s["trace_id"] == trace_id]
            fetches = [s for s in spans if s["name"] == "kv fetch worker-0"]
            time.sleep(0.2)
        (fetch,) = fetches
        assert fetch["attributes"]["lamina.kv.blocks_fetched"] == 8
        assert fetch["parent_id"] in {s["span_id"] for s in spans}


MOVED = [[*range(5 + i, 133 + i), 7] for i in range(3)]  # 8 blocks of their own, and a token


def test_a_drain_that_moves_hands_running_streams_and_their_kv_to_another_worker(
    tiny_model, tmp_path, capsys
):
    """``lamina ctl drain --move``: the drained worker fails its running requests as
    retryable, their gateways move them, and the worker they move to fetches the blocks
    they computed so far instead of computing them again; every stream ends with the text
    it would have had unmoved."""
    args = ["--max-model-len", "2048"]
    with make_stack(tiny_model, tmp_path, workers=2, worker_args=args) as stack:
        url = stack.nats_url
        body = {"max_tokens": 1900, "temperature": 0, "ignore_eos": True}
        only_worker_0_takes_work(capsys, url)

        async def main() -> tuple[list[str], list[str]]:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
                want = [await completion_text(client, body, prompt) for prompt in MOVED]
                accepted = [asyncio.Event() for _ in MOVED]
                streams = [
                    asyncio.create_task(streamed_text(client, body, prompt, event))
                    for prompt, event in zip(MOVED, accepted, strict=True)
                ]
                for event in accepted:
                    await event.wait()

                # Each stream is accepted (its headers came) and has ~1900 tokens to go.
                await asyncio.to_thread(move_to_worker_1, capsys, url)
                return want, [text for text, _ in await asyncio.gather(*streams)]

        want, got = asyncio.run(main())
        assert got == want
        cluster = httpx.get(stack.metrics_url.replace("/metrics", "/v1/cluster"), timeout=10)
        workers = {w["worker_id"]: w for w in cluster.json()["workers"]}
        moved_to = workers["worker-1"]
        assert moved_to["kv_fetches_total"] == len(MOVED)
        assert moved_to["kv_fetch_failures_total"] == 0
        # What it computed of the moved prompts: each one's last, partial block at most.
        computed = moved_to["prompt_tokens_total"] - moved_to["prompt_tokens_cached"]
        assert computed <= 16 * len(MOVED), moved_to
        assert workers["worker-0"]["kv_sent_blocks_total"] == moved_to["kv_fetched_blocks_total"]
