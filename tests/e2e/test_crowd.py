"""A crowd, bounded: 400 concurrent streams on two workers of the tiny model. Every stream
finishes or is refused up front with a 429; none dies of a stall (requests wait in a
worker's queue far longer than the gateway's stall timeout, which keep-alives make
harmless); ``/health`` answers every probe meanwhile. ``benchmarks/crowd.py`` measures
the same at larger sizes, with the latencies this test does not assert."""

from __future__ import annotations

import asyncio
import os
from collections import Counter

import httpx
import msgspec

from tests.e2e.conftest import make_stack

STREAMS = 400
KEEPALIVE = os.environ.get("LAMINA_TEST_KEEPALIVE", "0.2")


async def _stream(client: httpx.AsyncClient) -> str:
    """How one stream ended: ``completed``, ``429``, or what else happened."""
    body = {"prompt": "Once upon a time", "max_tokens": 192, "ignore_eos": True, "stream": True}
    reason = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return str(response.status_code)
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = msgspec.json.decode(line[6:])
                    if "error" in chunk:
                        return chunk["error"]["message"]
                    for choice in chunk["choices"]:
                        reason = choice.get("finish_reason") or reason
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "completed" if reason == "length" else f"ended without finishing ({reason})"


def test_a_crowd_is_served_or_refused_up_front_and_nothing_stalls(tiny_model, tmp_path):
    stack = make_stack(
        tiny_model,
        tmp_path,
        workers=2,
        # 64 run per worker, 64 more wait there (the rest in the scheduler's queue), for
        # longer than a three-second stall timeout.
        worker_args=["--max-num-seqs", "64", "--stream-keepalive", KEEPALIVE],
        gateway_args=["--stall-timeout", "3"],
        extra_env={"LAMINA_MAX_QUEUE_WAIT": "600"},
    )

    async def main(base_url: str) -> tuple[Counter, list[int]]:
        limits = httpx.Limits(max_connections=STREAMS + 8)
        probes: list[int] = []
        done = asyncio.Event()

        async def probe() -> None:
            async with httpx.AsyncClient(base_url=base_url, timeout=120) as prober:
                while not done.is_set():
                    probes.append((await prober.get("/health")).status_code)
                    await asyncio.sleep(0.1)

        async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
            prober = asyncio.create_task(probe())
            ended = await asyncio.gather(*(_stream(client) for _ in range(STREAMS)))
            done.set()
            await prober
        return Counter(ended), probes

    with stack:
        ended, probes = asyncio.run(main(stack.base_url))
    assert set(ended) <= {"completed", "429"}, ended
    assert ended["completed"] >= STREAMS // 2, ended
    assert probes and set(probes) == {200}
