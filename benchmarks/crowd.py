"""A crowd against the stack: N concurrent streamed completions on two workers of the tiny
model, and the gateway's ``/health`` probed throughout.

For each size it prints how the streams ended (completed; refused up front with a 429;
failed any other way: a stall, a 5xx, a broken stream), the time to first token of the
ones served, and ``/health``'s latency while they ran. The targets (issue 38): nothing
failed at any size, ``/health`` p99 under 50 ms at 400. The client runs on the same two
cores as the stack, so what it costs is taken from the stack.

Not a test: run it by hand.

    .venv/bin/python benchmarks/crowd.py
    .venv/bin/python benchmarks/crowd.py --sizes 400 --runs 3 --max-tokens 64
    .venv/bin/python benchmarks/crowd.py --sizes 64 --runs 3 --max-num-seqs 2

``--max-num-seqs 2`` makes the burst the compose test sends, larger: workers that take
two requests at a time (and hold two more waiting), so nearly every request waits in the
scheduler's queue, and each placement made on a stale view is a worker's refusal.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.synchronize
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import msgspec

from lamina.libs.nats_server import free_port
from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.launcher import Stack

HEALTH_PERIOD_S = 0.05


@dataclass
class Outcome:
    kind: str  # "completed", "refused" (429), "failed"
    ttft_s: float | None = None
    detail: str = ""


@dataclass
class Round:
    outcomes: list[Outcome] = field(default_factory=list)
    health_s: list[float] = field(default_factory=list)
    health_failed: int = 0
    wall_s: float = 0.0


async def one_stream(client: httpx.AsyncClient, body: dict) -> Outcome:
    started = time.perf_counter()
    ttft, reason = None, None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code == 429:
                await response.aread()
                return Outcome("refused", detail=response.headers.get("retry-after", ""))
            if response.status_code != 200:
                text = (await response.aread()).decode()[:200]
                return Outcome("failed", detail=f"{response.status_code} {text}")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = msgspec.json.decode(line[6:])
                if "error" in chunk:
                    return Outcome("failed", detail=chunk["error"]["message"][:200])
                for choice in chunk.get("choices", []):
                    if choice.get("text") and ttft is None:
                        ttft = time.perf_counter() - started
                    reason = choice.get("finish_reason") or reason
    except httpx.HTTPError as exc:
        return Outcome("failed", detail=f"{type(exc).__name__}: {exc}"[:200])
    if reason is None:
        return Outcome("failed", detail="the stream ended without a finish reason")
    return Outcome("completed", ttft)


def probe(url: str, stop: multiprocessing.synchronize.Event, out: Connection) -> None:
    """``/health`` every ``HEALTH_PERIOD_S`` until ``stop``, in a process of its own (in
    the crowd's, its latency would be the crowd's event loop's); sends back the
    latencies and the count of failed probes."""

    async def run() -> tuple[list[float], int]:
        latencies, failed = [], 0
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    response = await client.get("/health")
                    if response.status_code == 200:
                        latencies.append(time.perf_counter() - started)
                    else:
                        failed += 1
                except httpx.HTTPError:
                    failed += 1
                await asyncio.sleep(HEALTH_PERIOD_S)
        return latencies, failed

    out.send(asyncio.run(run()))


async def crowd(url: str, size: int, max_tokens: int) -> Round:
    body = {
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    result = Round()
    stop, (mine, theirs) = multiprocessing.Event(), multiprocessing.Pipe()
    prober = multiprocessing.Process(target=probe, args=(url, stop, theirs))
    prober.start()
    limits = httpx.Limits(max_connections=size + 8, max_keepalive_connections=size + 8)
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        result.outcomes = await asyncio.gather(*(one_stream(client, body) for _ in range(size)))
    result.wall_s = time.perf_counter() - started
    stop.set()
    result.health_s, result.health_failed = mine.recv()
    prober.join()
    return result


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(size: int, rounds: list[Round]) -> None:
    for n, r in enumerate(rounds):
        kinds = Counter(o.kind for o in r.outcomes)
        ttfts = [o.ttft_s for o in r.outcomes if o.ttft_s is not None]
        print(
            f"{size:>5} streams, run {n + 1}: completed {kinds['completed']}, refused (429) "
            f"{kinds['refused']}, failed {kinds['failed']} in {r.wall_s:.1f}s; TTFT p50 "
            f"{quantile(ttfts, 0.5) * 1000:.0f} ms p99 {quantile(ttfts, 0.99) * 1000:.0f} ms; "
            f"/health p50 {quantile(r.health_s, 0.5) * 1000:.1f} ms p99 "
            f"{quantile(r.health_s, 0.99) * 1000:.1f} ms "
            f"max {max(r.health_s, default=0) * 1000:.0f} ms "
            f"over {len(r.health_s)} probes ({r.health_failed} failed)"
        )
        for detail, count in Counter(o.detail for o in r.outcomes if o.kind == "failed").items():
            print(f"      {count} x {detail}")
    if len(rounds) > 1:
        p99s = [quantile(r.health_s, 0.99) * 1000 for r in rounds]
        failed = [sum(o.kind == "failed" for o in r.outcomes) for r in rounds]
        print(
            f"{size:>5} streams, median of {len(rounds)}: failed {statistics.median(failed):g}, "
            f"/health p99 {statistics.median(p99s):.1f} ms (range {min(p99s):.1f}-{max(p99s):.1f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 400, 1000])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="each worker's (default: the engine's)"
    )
    args = parser.parse_args()
    seqs = [] if args.max_num_seqs is None else ["--max-num-seqs", str(args.max_num_seqs)]
    model = args.model or ensure_default_model("tiny")
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(
            model=model,
            workers=args.workers,
            http_port=free_port(),
            metrics_port=free_port(),
            log_dir=Path(tmp) / "logs",
            worker_args=seqs,
        )
        with stack:
            print(f"stack up: {args.workers} workers on {model.name}; logs in {tmp}/logs")
            for size in args.sizes:
                rounds = [
                    asyncio.run(crowd(stack.base_url, size, args.max_tokens))
                    for _ in range(args.runs)
                ]
                report(size, rounds)


if __name__ == "__main__":
    main()
