"""Two gateway processes on one port, workers that stream in batches and in chunks of
several tokens, and a move: every stream's tokens arrive once and in order.

The workers send each gateway one ``StreamBatch`` per step for all of its streams and
hold each decoding stream's tokens to three a message (``--stream-interval 3``); a
drain that moves hands every stream to the other worker mid-way. Each stream must end
with the text it has unmoved, in about a third as many chunks as tokens, and the bus
must have carried batches to both gateways, each with events of several streams."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx

from lamina.libs.bus import Bus
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.generate import StreamBatch
from lamina.services.launcher import listens
from tests.e2e.conftest import make_stack
from tests.e2e.test_kv_moves import (
    completion_text,
    move_to_worker_1,
    only_worker_0_takes_work,
    streamed_text,
)

PROMPTS = [[*range(5 + 3 * i, 40 + 3 * i), 7] for i in range(16)]
BODY = {"max_tokens": 1200, "temperature": 0, "ignore_eos": True}
INTERVAL = 3


def moved_streams(metrics_url: str, want: int) -> int:
    """The requests worker-1 took over with their KV, once its heartbeat shows ``want``
    (or after ten seconds, what it shows then)."""
    cluster = metrics_url.replace("/metrics", "/v1/cluster")
    deadline = time.monotonic() + 10
    while True:
        workers = {w["worker_id"]: w for w in httpx.get(cluster, timeout=10).json()["workers"]}
        fetched = workers["worker-1"]["kv_fetches_total"]
        if fetched >= want or time.monotonic() > deadline:
            return fetched
        time.sleep(0.2)


def test_batched_streams_reach_both_gateways_whole_and_in_order_across_a_move(
    tiny_model, tmp_path, capsys
):
    args = ["--max-model-len", "2048", "--stream-interval", str(INTERVAL)]
    args += ["--kv-cache-memory-bytes", str(256 << 20)]  # every stream runs at once
    with make_stack(tiny_model, tmp_path, workers=2, gateways=2, worker_args=args) as stack:
        assert all(listens(stack.procs[n].pid, stack.http_port) for n in ("gateway", "gateway-1"))
        url = stack.nats_url
        only_worker_0_takes_work(capsys, url)

        async def main() -> tuple[list[str], list[tuple[str, int]], list[StreamBatch], Counter]:
            batches: list[StreamBatch] = []
            inboxes: Counter[str] = Counter()
            bus = await Bus.connect(url, "test-batches")

            async def on_batch(batch: StreamBatch, msg) -> None:
                batches.append(batch)
                inboxes[msg.subject.rsplit(".", 2)[0]] += 1

            for inbox in ("_INBOX.*", "_INBOX.*.*"):  # an open bus's inboxes, a closed one's
                await bus.subscribe(subjects.stream_batch(inbox, "*"), StreamBatch, on_batch)
            await bus.flush()
            try:
                async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
                    want = await asyncio.gather(
                        *(completion_text(client, BODY, p) for p in PROMPTS)
                    )
                # Concurrent streams take a connection each: the kernel spreads them over
                # the gateways.
                client = httpx.AsyncClient(base_url=stack.base_url, timeout=120)
                accepted = [asyncio.Event() for _ in PROMPTS]
                streams = [
                    asyncio.create_task(streamed_text(client, BODY, prompt, event))
                    for prompt, event in zip(PROMPTS, accepted, strict=True)
                ]
                for event in accepted:  # each has ~1200 tokens to go
                    await asyncio.wait_for(event.wait(), 60)
                await asyncio.to_thread(move_to_worker_1, capsys, url)
                got = list(await asyncio.gather(*streams))
            finally:
                await client.aclose()
                await bus.close()
            return list(want), got, batches, inboxes

        want, got, batches, inboxes = asyncio.run(main())
        fetched = moved_streams(stack.metrics_url, len(PROMPTS))
    assert fetched == len(PROMPTS)  # every stream moved mid-way (with its KV)
    assert [text for text, _ in got] == want
    # A chunk per three tokens, give or take each stream's first token and its move.
    assert all(chunks <= BODY["max_tokens"] // INTERVAL + 8 for _, chunks in got), got
    assert len(inboxes) == 2, inboxes  # both gateways had streams, in batches
    assert max(len({item.attempt for item in b.events}) for b in batches) > 1
