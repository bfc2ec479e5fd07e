"""A client that hangs up cancels its request all the way to the engine; an oversized
body is refused. Raw sockets, because the point is what the client does to the socket."""

from __future__ import annotations

import asyncio
import json
import time

from lamina.libs.bus import Bus
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.records import RequestRecord
from lamina.schemas.v1.stats import WorkerStats
from lamina.services.gateway.asgi import MAX_BODY_BYTES

MAX_TOKENS = 1000  # the shared stack's context is 1024: ~1-2 s of tiny's decoding


def http_request(path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Observer:
    """The gateway's request records and the worker's stats, from the bus."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.records: asyncio.Queue[RequestRecord] = asyncio.Queue()
        self.stats: asyncio.Queue[WorkerStats] = asyncio.Queue()

    @classmethod
    async def connect(cls, nats_url: str) -> Observer:
        observer = cls(await Bus.connect(nats_url, "test-observer"))

        async def on_record(record: RequestRecord, _msg: object) -> None:
            observer.records.put_nowait(record)

        async def on_stats(stats: WorkerStats, _msg: object) -> None:
            observer.stats.put_nowait(stats)

        await observer.bus.subscribe(subjects.EVENTS_REQUEST, RequestRecord, on_record)
        await observer.bus.subscribe(subjects.WORKER_STATS_ALL, WorkerStats, on_stats)
        return observer

    async def idle_generation_total(self) -> int:
        """Tokens the worker has generated, from its first heartbeat that is newer than
        this call and shows nothing running."""
        since_ms = time.time() * 1000
        while True:
            stats = await asyncio.wait_for(self.stats.get(), 10)
            if stats.timestamp_ms > since_ms and stats.num_running + stats.num_waiting == 0:
                return stats.generation_tokens_total

    async def record(self) -> RequestRecord:
        return await asyncio.wait_for(self.records.get(), 10)


async def hang_up(stack, path: str, payload: dict, wait) -> tuple[RequestRecord, int]:
    """Send ``payload``, close the connection once ``wait(reader)`` returns; the gateway's
    record of the request and the tokens the worker generated for it."""
    observer = await Observer.connect(stack.nats_url)
    try:
        before = await observer.idle_generation_total()
        reader, writer = await asyncio.open_connection(stack.http_host, stack.http_port)
        writer.write(http_request(path, json.dumps(payload).encode()))
        await wait(reader)
        writer.close()
        record = await observer.record()
        generated = await observer.idle_generation_total() - before
        return record, generated
    finally:
        await observer.bus.close()


async def first_event(reader: asyncio.StreamReader) -> None:
    received = b""
    while b"data: " not in received:
        received += await asyncio.wait_for(reader.read(4096), 10)


def test_closing_a_stream_cancels_its_generation(stack):
    payload = {"prompt": "Once upon", "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True}
    record, generated = asyncio.run(hang_up(stack, "/v1/completions", payload, first_event))
    assert record.outcome == "cancelled" and record.worker_id
    assert 1 <= generated < MAX_TOKENS


def test_hanging_up_on_a_non_streaming_chat_cancels_it(stack):
    payload = {
        "messages": [{"role": "user", "content": "Once upon"}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
    }

    async def a_moment(_reader: asyncio.StreamReader) -> None:
        await asyncio.sleep(0.2)  # usually generating by now; the whole answer takes seconds

    record, generated = asyncio.run(hang_up(stack, "/v1/chat/completions", payload, a_moment))
    # Hung up while generating, or (on a slow machine) before the worker accepted it: then
    # the late Accepted makes the gateway cancel it. Either way the worker stops early.
    assert record.outcome == "cancelled"
    assert generated < MAX_TOKENS


def test_a_body_over_the_limit_is_refused_with_413(stack):
    async def main() -> tuple[bytes, bytes]:
        reader, writer = await asyncio.open_connection(stack.http_host, stack.http_port)
        writer.write(http_request("/v1/completions", b" " * (MAX_BODY_BYTES + 1)))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
        body = await asyncio.wait_for(reader.readexactly(length), 10)
        writer.close()
        return head, body

    head, body = asyncio.run(main())
    assert head.startswith(b"HTTP/1.1 413")
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "body" in error["message"]
