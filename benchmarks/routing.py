"""Placement policies compared on one machine: the same multi-tenant workload through a
stack of three workers under ``--placement kv``, ``load`` and ``round-robin``, in one run.

Workload: a dozen tenants, each with its own 1,024-token system prompt; each request is a
turn of one of the tenant's conversations (system prompt, the turns so far, a new user
message), so consecutive turns share all but their last message. Requests arrive as a
Poisson process at ``--load-factor`` times the cluster's capacity for that workload
under ``load`` (measured first, closed loop). A second workload with no shared prefixes
(every prompt distinct, same lengths) checks that ``kv`` costs nothing when there is
nothing to reuse.

Each worker runs its engine on one thread (``OMP_NUM_THREADS=1``): the three workers'
three engine threads share the machine's two cores with the gateway, the scheduler and
``nats-server`` (on this 2-vCPU VM the cores are oversubscribed either way; one thread
each keeps any worker from taking both). Each worker's KV pool (``--kv-blocks``) holds a
third of the tenants' system prompts and their conversations comfortably, and all of
them not at all: where the requests of a tenant go decides whether its prefix stays
cached.

Prints TTFT p50/p90/p99, throughput and the cluster's prefix hit rate (cached prompt
tokens over prompt tokens, from each response's usage) next to the ideal rate: one
unbounded cache seeing the requests in the same order.

    .venv/bin/python benchmarks/routing.py
    .venv/bin/python benchmarks/routing.py --requests 400 --load-factor 0.8
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from timing import pct, stream_completion

from lamina.libs.block_hash import hash_blocks
from lamina.libs.nats_server import free_port
from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.launcher import Stack

BLOCK = 16
POLICIES = ("kv", "load", "round-robin")


@dataclass
class Result:
    ttft: list[float]
    cached: int
    prompt: int
    output: int
    seconds: float


def conversations(
    requests: int,
    tenants: int,
    system_tokens: int,
    turns: int,
    vocab: int,
    shared: bool,
    seed: int = 7,
) -> list[list[int]]:
    """The prompts, in arrival order. ``shared``: tenants' conversations share their
    tenant's system prompt and their own earlier turns; otherwise every prompt is new."""
    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    systems = [text(system_tokens) for _ in range(tenants)]
    open_turns: list[tuple[int, list[int], int]] = []  # (tenant, prompt so far, turns)
    prompts = []
    for _ in range(requests):
        if open_turns and rng.random() < 0.6:
            tenant, history, n = open_turns.pop(rng.randrange(len(open_turns)))
        else:
            tenant, n = rng.randrange(tenants), 0
            history = list(systems[tenant])
        prompt = history + text(rng.randrange(32, 64))
        prompts.append(prompt if shared else text(len(prompt)))
        if n + 1 < turns:  # the assistant's reply joins the history (a stand-in for it)
            open_turns.append((tenant, prompt + text(16), n + 1))
    return prompts


def ideal_hit_rate(prompts: list[list[int]]) -> float:
    """Hit rate of one unbounded prefix cache over the requests in order."""
    cache: set[int] = set()
    hit = total = 0
    for prompt in prompts:
        hashes = hash_blocks(prompt, BLOCK)
        usable = (len(prompt) - 1) // BLOCK  # the last prompt token is always computed
        for block_hash in hashes[:usable]:
            if block_hash not in cache:
                break
            hit += BLOCK
        cache.update(hashes)
        total += len(prompt)
    return hit / total


async def open_loop(base_url: str, prompts: list[list[int]], rate: float, out: int) -> Result:
    """Poisson arrivals at ``rate`` requests/s."""
    rng = random.Random(11)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        started = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(stream_completion(client, prompt, out)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - started
    return Result(
        ttft=[r[0] for r in results],
        cached=sum(r[1] for r in results),
        prompt=sum(len(p) for p in prompts),
        output=sum(r[2] for r in results),
        seconds=seconds,
    )


async def closed_loop(base_url: str, prompts: list[list[int]], clients: int, out: int) -> float:
    """Requests per second with ``clients`` requests always in flight."""
    pending = list(prompts)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while pending:
            await stream_completion(client, pending.pop(), out)

    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        return len(prompts) / (time.perf_counter() - started)


def stack_for(model: Path, policy: str, kv_blocks: int, logs: Path) -> Stack:
    return Stack(
        model=model,
        workers=3,
        http_port=free_port(),
        metrics_port=free_port(),
        log_dir=logs / policy,
        worker_args=["--num-kv-blocks", str(kv_blocks), "--max-model-len", "2048"],
        extra_env={"OMP_NUM_THREADS": "1", "LAMINA_PLACEMENT": policy},
    )


def report(name: str, result: Result) -> dict[str, float]:
    ms = [t * 1e3 for t in result.ttft]
    row = {
        "p50": pct(ms, 0.5),
        "p90": pct(ms, 0.9),
        "p99": pct(ms, 0.99),
        "tok/s": result.output / result.seconds,
        "hit": result.cached / result.prompt,
    }
    print(
        f"  {name:12s} TTFT p50 {row['p50']:7.1f}  p90 {row['p90']:7.1f}  p99 {row['p99']:7.1f} ms"
        f"   {row['tok/s']:7.1f} output tok/s   prefix hits {row['hit']:.1%}"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--tenants", type=int, default=12)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=512, help="KV blocks per worker")
    parser.add_argument("--load-factor", type=float, default=0.9)
    parser.add_argument("--rate", type=float, help="arrivals/s (default: measured)")
    args = parser.parse_args()

    model = ensure_default_model()
    vocab = 1024
    shared = conversations(
        args.requests, args.tenants, args.system_tokens, args.turns, vocab, shared=True
    )
    distinct = conversations(
        args.requests, args.tenants, args.system_tokens, args.turns, vocab, shared=False
    )
    mean_prompt = statistics.mean(len(p) for p in shared)
    print(
        f"{args.requests} requests, {args.tenants} tenants, {args.system_tokens}-token system "
        f"prompts, up to {args.turns} turns (mean prompt {mean_prompt:.0f} tokens), "
        f"{args.output_tokens} output tokens; 3 workers x {args.kv_blocks} KV blocks"
    )
    ideal = ideal_hit_rate(shared)
    warmup = conversations(12, 12, args.system_tokens, 1, vocab, shared=False, seed=99)
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        rows: dict[str, dict[str, dict[str, float]]] = {"shared": {}, "distinct": {}}
        for workload, prompts in (("shared", shared), ("distinct", distinct)):
            rate = args.rate
            if rate is None:
                with stack_for(model, "load", args.kv_blocks, logs) as stack:
                    sample = conversations(
                        120,
                        args.tenants,
                        args.system_tokens,
                        args.turns,
                        vocab,
                        shared=workload == "shared",
                        seed=5,
                    )
                    capacity = asyncio.run(
                        closed_loop(stack.base_url, sample, 12, args.output_tokens)
                    )
                rate = args.load_factor * capacity
            print(f"{workload} prefixes, arrivals at {rate:.1f}/s:")
            for policy in POLICIES:
                with stack_for(model, policy, args.kv_blocks, logs) as stack:
                    asyncio.run(open_loop(stack.base_url, warmup, rate, 4))
                    result = asyncio.run(
                        open_loop(stack.base_url, prompts, rate, args.output_tokens)
                    )
                rows[workload][policy] = report(policy, result)
    kv, load = rows["shared"]["kv"], rows["shared"]["load"]
    print(
        f"shared: kv p90 TTFT / load's = {kv['p90'] / load['p90']:.2f} (target <= 0.33); "
        f"kv hit rate {kv['hit']:.1%} vs ideal {ideal:.1%} = {kv['hit'] / ideal:.2f} of ideal "
        "(target >= 0.90)"
    )
    kv, load = rows["distinct"]["kv"], rows["distinct"]["load"]
    print(
        f"distinct: kv / load p50 TTFT {kv['p50'] / load['p50']:.2f}, p90 "
        f"{kv['p90'] / load['p90']:.2f}, throughput {kv['tok/s'] / load['tok/s']:.2f} "
        "(target: within 5%)"
    )


if __name__ == "__main__":
    main()
