"""Timing shared by the benchmarks (run as scripts from this folder)."""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
from collections.abc import Callable

import httpx


def median_ms(fn: Callable[[], object], runs: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``runs`` calls, in milliseconds, after ``warmup``
    untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


async def stream_completion(
    client: httpx.AsyncClient, prompt: list[int], max_tokens: int
) -> tuple[float, int, int]:
    """``(ttft_s, cached_tokens, completion_tokens)`` of one greedy streamed completion
    of ``max_tokens`` (``ignore_eos``): TTFT is the time to the first chunk with text."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started, ttft, usage = time.perf_counter(), None, {}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - started
            usage = event.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft, cached, usage.get("completion_tokens", 0)


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the nearest rank at or below it)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def wait_for_workers(metrics_url: str, count: int, timeout_s: float = 120.0) -> None:
    """Until telemetry (its ``/metrics`` URL given) shows ``count`` workers ready."""
    cluster = metrics_url.replace("/metrics", "/v1/cluster")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            workers = httpx.get(cluster, timeout=10).json()["workers"]
        except httpx.HTTPError:  # telemetry still starting
            workers = []
        if sum(w["state"] == "ready" for w in workers) >= count:
            return
        time.sleep(0.3)
    raise TimeoutError(f"{count} workers never were ready")


def wait_http(url: str, timeout_s: float) -> None:
    """Until ``url`` answers 200; raises ``TimeoutError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout_s:g}s")
        time.sleep(1)
