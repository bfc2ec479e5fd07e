"""KV that moves: the lower tiers against none (``--part tier``, the default), and a
prefix fetched from another worker against computing it (``--part transfer``).

The tiers: a multi-tenant prefix workload whose working set is four times the device
pool.

Each of ``--tenants`` tenants has a system prompt of ``--prefix`` tokens; each request is
a random tenant's prompt plus a fresh question of ``--question`` tokens, with a few
output tokens, one request at a time, in process (the engine alone: no bus). The device
pool holds a quarter of the tenants' prompts. The layouts: no tier (the rest is
computed again), a host tier that holds the whole working set (``--kv-offload-bytes``),
and a host tier as small as the device pool over a disk tier that holds the rest
(``--kv-offload-disk-bytes``, in ``--kv-offload-dir``: a temporary directory by
default), twice: as it runs, where the tier's file stays in the page cache while memory
is plentiful, and cold, its mapping paged out before every request (``madvise``
``MADV_PAGEOUT``: dirty pages written back, then dropped), so that every block loaded
from it is read from the disk, as under memory pressure. Printed per layout: the
prefix-cache hit rate, p50 and p90 time to first token (from ``add_request`` to its first
token), blocks loaded back from each tier, and the ratios of each tiered layout's to
none's. Every layout sees the same requests; the runs rotate which goes first.

The transfer: for each ``--contexts`` length, one engine computes a prompt, and a second
engine serves it three ways, cold each time: computing it (the baseline), and fetching
its blocks from the first over the transfer stream (``kv_transfer.py``: handshake,
export, bytes over loopback TCP, MAC, import) before computing its last token. Printed:
TTFT of each and their ratio, and the stream's time against the same bytes' through a
real nats-server in 512 KiB messages, the other path a transfer could take (the
stream's time counts its handshake, export and MAC as well; the bus's, bytes alone).

Disaggregated prefill and decode (``--part pd``): the whole stack (gateway, scheduler,
two workers, one engine thread each) twice, mixed (two mixed workers) and disaggregated
(one prefill, one decode worker), alternating which runs first. ``--streams`` decode
streams (short prompts, ``--stream-tokens`` each, restarted as they end) run while a
long prompt (``--long-prompt`` tokens, a few output tokens) arrives every
``--long-every`` seconds for ``--duration`` seconds. Printed: the streams' inter-token
latency (gaps between token-bearing SSE chunks, ``return_token_ids``) p50/p99, the long
requests' TTFT p50/p99, and disaggregated over mixed for each. With ``--netns`` (root)
the workers run on test hosts of their own (a network namespace each, the gateway,
scheduler and telemetry on a third): the KV crosses a veth pair and a bridge.

A drain that moves (``--part drain``): for each ``--contexts`` length, a stack of two
workers, ``--streams`` streams of that many prompt tokens decoding on worker-0; then
``lamina ctl drain --move worker-0``. Printed: the time from the drain until every moved
stream's next token, with the receiving worker fetching the streams' blocks (transfer)
and with its fetches failing at once (``--kv-fetch-timeout 0``: recompute, the same move
otherwise), and their ratio.

Not a test: run it by hand on an otherwise idle machine.

    .venv/bin/python benchmarks/kv_moves.py            # small preset, 16 tenants x 512
    .venv/bin/python benchmarks/kv_moves.py --part transfer
    .venv/bin/python benchmarks/kv_moves.py --part pd
    .venv/bin/python benchmarks/kv_moves.py --part drain --contexts 512 2048 8192
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import itertools
import json
import logging
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from timing import pct, wait_for_workers

from lamina.libs.block_hash import hash_blocks
from lamina.libs.bus import Bus
from lamina.libs.nats_server import NatsServer, free_port
from lamina.schemas.v1.kv_transfer import KvGrant, KvSource
from lamina.services import ctl
from lamina.services.engine_worker import kv_transfer
from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.kv_tier import DISK, KvBlocks
from lamina.services.engine_worker.engine.model_config import ModelConfig
from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.engine_worker.engine.runner import kv_block_bytes
from lamina.services.launcher import Stack


def workload(args: argparse.Namespace, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prefix)] for _ in range(args.tenants)]
    return [
        rng.choice(prompts) + [rng.randrange(3, vocab) for _ in range(args.question)]
        for _ in range(args.requests)
    ]


MADV_PAGEOUT = 21  # linux/mman.h


def page_out(engine: Engine) -> None:
    """Writes back and drops the engine's disk tier's pages (its file mappings)."""
    pool = engine.runner.tiers[DISK]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mappings = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in
                [*pool.caches, *pool.scales] if t is not None}  # fmt: skip
    for address, size in mappings.items():
        if libc.madvise(address, size, MADV_PAGEOUT) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_PAGEOUT) of the disk tier")


def serve(
    engine: Engine, requests: list[list[int]], warmup: int, cold: bool = False
) -> dict[str, float]:
    """TTFTs (ms) and the cache's counters over ``requests`` after the first ``warmup``
    (``cold``: the disk tier paged out before each request)."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ttfts: list[float] = []
    before = None
    for n, prompt in enumerate(requests):
        if n == warmup:
            before = engine.stats()
        if cold:
            page_out(engine)
        started, first = time.perf_counter(), None
        engine.add_request(f"r{n}", prompt, params)
        while engine.has_work():
            for out in engine.step().outputs:
                if first is None and out.new_token_ids:
                    first = time.perf_counter()
        if n >= warmup:
            ttfts.append((first - started) * 1e3)  # type: ignore[operator]
    after = engine.stats()
    assert before is not None
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    ttfts.sort()
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "p50": statistics.median(ttfts),
        "p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        "host_loads": after.host_kv_loads_total - before.host_kv_loads_total,
        "disk_loads": after.disk_kv_loads_total - before.disk_kv_loads_total,
        "host_rate": after.host_kv_load_blocks_per_s,
        "disk_rate": after.disk_kv_load_blocks_per_s,
    }


def ttft(engine: Engine, prompt: list[int], rid: str) -> float:
    """Seconds from ``add_request`` to the prompt's first token."""
    started = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_work():
        engine.step()
    return time.perf_counter() - started


async def fetch(server: kv_transfer.KvSender, hashes: list[int]) -> tuple[KvBlocks, float]:
    """The blocks over the transfer stream, and the seconds it took (grant to verified)."""
    grant = KvGrant(
        grant_id=secrets.token_hex(16),
        token=secrets.token_hex(32),
        receiver="bench",
        block_hashes=hashes,
    )
    started = time.perf_counter()
    await server.grant(grant)
    source = KvSource(
        worker_id="sender",
        address=server.address,
        grant_id=grant.grant_id,
        token=grant.token,
        block_hashes=hashes,
    )
    blocks = await kv_transfer.fetch(source, 60.0)
    return blocks, time.perf_counter() - started


async def through_nats(sender: Bus, receiver: Bus, payload: bytes, chunk: int = 512 << 10) -> float:
    """Seconds to carry ``payload`` from one client to another through the nats-server, in
    ``chunk``-byte messages (the receiver counts them all in)."""
    parts = [payload[i : i + chunk] for i in range(0, len(payload), chunk)]
    done, got = asyncio.Event(), [0]

    async def on_part(msg) -> None:
        got[0] += 1
        if got[0] == len(parts):
            done.set()

    subscription = await receiver.nc.subscribe("bench.kv", cb=on_part)
    await receiver.nc.flush()
    started = time.perf_counter()
    for part in parts:
        await sender.nc.publish("bench.kv", part)
    await sender.nc.flush()
    await asyncio.wait_for(done.wait(), 60)
    took = time.perf_counter() - started
    await subscription.unsubscribe()
    return took


async def transfer_part(args: argparse.Namespace, nats_url: str) -> None:
    """Each context: TTFT computed vs fetched, and the stream's time vs the bus's. The
    engines run on the event loop (no engine thread): the loop, the listener and the bus
    connections live through every run, as a worker's do."""
    model = ensure_default_model(args.preset)
    longest = max(args.contexts)
    config = EngineConfig(
        model=model,
        block_size=16,
        max_model_len=longest + 16,
        num_kv_blocks=2 * longest // 16,
        **on_device(args),  # type: ignore[arg-type]
    )
    sender, receiver = Engine(config), Engine(config)
    vocab = sender.model_config.vocab_size
    block_bytes = kv_block_bytes(sender.runner.model, 16)
    print(
        f"model: {args.preset} preset; {os.cpu_count()} cores; blocks of 16 tokens, "
        f"{block_bytes / 1024:.0f} KiB each; medians of {args.runs} runs"
    )

    async def export(grant: KvGrant) -> KvBlocks:
        return sender.export_blocks(grant.block_hashes)

    server = kv_transfer.KvSender(export, "127.0.0.1")
    await server.start()
    a, b = await Bus.connect(nats_url, "bench-a"), await Bus.connect(nats_url, "bench-b")
    rng = random.Random(0)
    try:
        for context in args.contexts:
            prompt = [rng.randrange(3, vocab) for _ in range(context + 1)]
            ttft(sender, prompt, f"s{context}")
            hashes = hash_blocks(prompt, 16)
            computed, fetched, moved, stream_s, nats_s = [], [], [], [], []
            for run in range(args.runs):
                receiver.reset_prefix_cache()
                computed.append(ttft(receiver, prompt, f"c{context}.{run}"))
                receiver.reset_prefix_cache()
                started = time.perf_counter()
                blocks, took = await fetch(server, hashes)
                receiver.import_blocks(blocks)
                ttft(receiver, prompt, f"f{context}.{run}")
                fetched.append(time.perf_counter() - started)
                moved.append(len(blocks.hashes))
                stream_s.append(took)
                payload = bytes(sum(t.numel() * t.element_size() for t in blocks.caches))
                nats_s.append(await through_nats(a, b, payload))
            size = statistics.median(moved) * block_bytes / 2**20
            c, f = statistics.median(computed), statistics.median(fetched)
            t, n = statistics.median(stream_s), statistics.median(nats_s)
            print(
                f"  {context:5d} tokens: TTFT computed {c * 1e3:7.1f} ms, fetched "
                f"{f * 1e3:7.1f} ms ({min(fetched) * 1e3:.1f}-{max(fetched) * 1e3:.1f}): "
                f"{f / c:.2f}x; {size:.1f} MiB over the stream {t * 1e3:.1f} ms "
                f"({size / t:,.0f} MiB/s), through NATS {n * 1e3:.1f} ms "
                f"({size / n:,.0f} MiB/s): stream/NATS time {t / n:.2f}x"
            )
    finally:
        await a.close()
        await b.close()
        await server.close()
        sender.close()
        receiver.close()


def streamed(prompt: list[int], max_tokens: int) -> dict:
    """A greedy streamed completion's body whose chunks carry their token ids (a chunk
    of text held back for a partial character still says a token came)."""
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the runs."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


async def stream_gaps(
    client: httpx.AsyncClient, prompt: list[int], max_tokens: int
) -> tuple[float, list[float]]:
    """One streamed completion: its TTFT and the gaps between its token-bearing chunks
    (seconds)."""
    body = streamed(prompt, max_tokens)
    started = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("token_ids"):
                    arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return arrivals[0] - started, gaps


async def pd_load(base_url: str, args: argparse.Namespace, vocab: int) -> dict[str, list]:
    """The streams and the long prompts against one stack; what each saw."""
    rng = random.Random(1)
    seen: dict[str, list] = {"gaps": [], "long_ttft": []}
    stop = time.perf_counter() + args.duration

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        await stream_gaps(client, prompt(args.long_prompt), 2)  # warm both paths

        async def streamer() -> None:
            while time.perf_counter() < stop:
                _, gaps = await stream_gaps(client, prompt(64), args.stream_tokens)
                seen["gaps"] += gaps

        async def long_one() -> None:
            ttft_s, _ = await stream_gaps(client, prompt(args.long_prompt), 4)
            seen["long_ttft"].append(ttft_s)

        streams = [asyncio.create_task(streamer()) for _ in range(args.streams)]
        longs = []
        await asyncio.sleep(1.0)  # the streams are decoding
        while time.perf_counter() < stop:
            longs.append(asyncio.create_task(long_one()))
            await asyncio.sleep(args.long_every)
        await asyncio.gather(*streams, *longs)
    return seen


def on_device(args: argparse.Namespace) -> dict[str, str]:
    """The engines' ``--device`` and ``--dtype``."""
    return {"device": args.device, "dtype": args.dtype}


def worker_flags(args: argparse.Namespace) -> list[str]:
    """A stack's workers' ``--device`` and ``--dtype``; on CUDA a KV budget of their own
    (two workers share the device: the default takes most of what is free)."""
    flags = ["--device", args.device, "--dtype", args.dtype]
    if args.device.startswith("cuda"):
        flags += ["--kv-cache-memory-bytes", str(4 << 30)]
    return flags


def pd_stack(args: argparse.Namespace, model, logs, prefill_workers: int) -> Stack:
    return Stack(
        model=model,
        workers=2,
        prefill_workers=prefill_workers,
        http_port=free_port(),
        metrics_port=free_port(),
        log_dir=logs,
        worker_args=["--max-model-len", "4096", *worker_flags(args)],
        extra_env={"OMP_NUM_THREADS": "1"},
    )


@contextlib.contextmanager
def pd_target(
    args: argparse.Namespace, model: Path, logs: Path, prefill_workers: int
) -> Iterator[str]:
    """The base URL of a stack of two workers, ``prefill_workers`` of them prefill and
    the rest decode (0: both mixed): on loopback, or with ``--netns`` on test hosts of
    their own (``tests/multihost/nodes.py``: gateway, scheduler and telemetry on one,
    a worker on each of two more; the KV crosses between the workers' addresses)."""
    if not args.netns:
        with pd_stack(args, model, logs, prefill_workers) as stack:
            wait_for_workers(stack.metrics_url, 2)
            yield stack.base_url
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' host helpers
    from tests.multihost import nodes

    roles = {"a": "gateway,scheduler,telemetry", "b": "worker", "c": "worker"}
    jobs = ["prefill", "decode"] if prefill_workers else ["mixed", "mixed"]
    extra = {host: ["--worker-role", job] for host, job in zip("bc", jobs, strict=True)}
    engine = ["--max-model-len", "4096", *worker_flags(args)]
    os.environ["OMP_NUM_THREADS"] = "1"  # as the loopback stack's workers
    logging.getLogger("lamina.bus").setLevel(logging.ERROR)  # converge's polls reconnect
    with nodes.running(roles, model, engine, logs, extra=extra) as cluster:
        workers = nodes.workers_of(roles)
        asyncio.run(nodes.converge(cluster, ("a",), workers, timeout=240))
        yield cluster.gateway("a")


def pd_part(args: argparse.Namespace) -> None:
    model = ensure_default_model(args.preset)
    vocab = ModelConfig.from_dir(model).vocab_size
    print(
        f"model: {args.preset} preset; {os.cpu_count()} cores; 2 workers (one engine thread "
        f"each{', on netns hosts' if args.netns else ''}); {args.streams} streams of "
        f"{args.stream_tokens} tokens, a "
        f"{args.long_prompt}-token prompt every {args.long_every:g}s for {args.duration:g}s; "
        f"{args.runs} runs"
    )
    layouts = {"mixed": 0, "disaggregated": 1}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            order = list(layouts) if run % 2 == 0 else list(reversed(layouts))
            for name in order:
                where = Path(tmp) / f"{name}{run}"
                with pd_target(args, model, where, layouts[name]) as base_url:
                    seen = asyncio.run(pd_load(base_url, args, vocab))
                gaps = [g * 1e3 for g in seen["gaps"]]
                longs = [t * 1e3 for t in seen["long_ttft"]]
                rows[name].append(
                    {
                        "itl50": pct(gaps, 0.5),
                        "itl99": pct(gaps, 0.99),
                        "ttft50": pct(longs, 0.5),
                        "ttft99": pct(longs, 0.99),
                    }
                )
    summary = {}
    for name, runs in rows.items():
        summary[name] = medians(runs)
        s = summary[name]
        spread = [r["itl99"] for r in runs]
        print(
            f"  {name:14s} stream ITL p50 {s['itl50']:6.1f} ms  p99 {s['itl99']:7.1f} ms "
            f"({min(spread):.1f}-{max(spread):.1f})   long prompts' TTFT p50 "
            f"{s['ttft50']:7.1f} ms  p99 {s['ttft99']:7.1f} ms"
        )
    d, m = summary["disaggregated"], summary["mixed"]
    print(
        f"disaggregated / mixed: ITL p50 {d['itl50'] / m['itl50']:.2f}x, p99 "
        f"{d['itl99'] / m['itl99']:.2f}x; long TTFT p50 {d['ttft50'] / m['ttft50']:.2f}x, "
        f"p99 {d['ttft99'] / m['ttft99']:.2f}x"
    )


async def moved_lag(stack: Stack, context: int, streams: int, vocab: int) -> tuple[float, int, int]:
    """Seconds from ``ctl drain --move worker-0`` until each of ``streams`` streams of
    ``context`` prompt tokens running there has its next token (the slowest one's), and
    the fetches worker-1 made and failed."""
    rng = random.Random(context)
    url = stack.nats_url
    assert url is not None
    await asyncio.to_thread(ctl.main, ["--nats-url", url, "cordon", "worker-1"])
    await asyncio.sleep(1.5)  # the scheduler has the cordon's heartbeat
    drained_at: list[float] = []
    started = [asyncio.Event() for _ in range(streams)]
    lags: list[float] = []

    async def stream(client: httpx.AsyncClient, index: int) -> None:
        prompt = [rng.randrange(3, vocab) for _ in range(context)]
        body = streamed(prompt, 1000)  # running still when the drain comes
        chunks, after = 0, []
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if not (json.loads(line[6:]).get("choices") or [{}])[0].get("token_ids"):
                    continue
                chunks += 1
                if chunks == 3:
                    started[index].set()
                if drained_at:
                    after.append(time.perf_counter())
                    if len(after) == 24:
                        break
        # The move is the longest silence after the drain (worker-0's tokens in flight
        # may come first): its end is the moved stream's next token.
        edges = [drained_at[0], *after]
        resumed = max(range(1, len(edges)), key=lambda i: edges[i] - edges[i - 1])
        lags.append(edges[resumed] - drained_at[0])

    async with httpx.AsyncClient(base_url=stack.base_url, timeout=600) as client:
        tasks = [asyncio.create_task(stream(client, i)) for i in range(streams)]
        for event in started:
            await event.wait()
        await asyncio.to_thread(ctl.main, ["--nats-url", url, "uncordon", "worker-1"])
        await asyncio.sleep(1.5)
        drained_at.append(time.perf_counter())
        drain = ["--nats-url", url, "--timeout", "30", "drain", "--move", "worker-0"]
        await asyncio.to_thread(ctl.main, drain)
        await asyncio.gather(*tasks)
    await asyncio.sleep(1.0)  # worker-1's next heartbeat counts its fetches
    cluster = httpx.get(stack.metrics_url.replace("/metrics", "/v1/cluster"), timeout=10)
    (moved_to,) = [w for w in cluster.json()["workers"] if w["worker_id"] == "worker-1"]
    return max(lags), moved_to["kv_fetches_total"], moved_to["kv_fetch_failures_total"]


def longer(model: Path, context: int, into: Path) -> Path:
    """A copy of ``model`` whose configured context holds ``context`` tokens (its
    ``max_position_embeddings`` raised: the presets stop at 2048; RoPE and random
    weights run at any length, and the time per token is what is measured)."""
    config = json.loads((model / "config.json").read_text())
    if config["max_position_embeddings"] >= context:
        return model
    into.mkdir(parents=True, exist_ok=True)
    for item in model.iterdir():
        if item.name != "config.json" and not (into / item.name).exists():
            (into / item.name).symlink_to(item)
    config["max_position_embeddings"] = context
    (into / "config.json").write_text(json.dumps(config, indent=2))
    return into


def drain_part(args: argparse.Namespace) -> None:
    model = ensure_default_model(args.preset)
    vocab = ModelConfig.from_dir(model).vocab_size
    print(
        f"model: {args.preset} preset; {os.cpu_count()} cores; 2 workers; {args.streams} "
        f"streams per drain; medians of {args.runs} runs"
    )
    ways = {"transfer": [], "recompute": ["--kv-fetch-timeout", "0"]}
    with tempfile.TemporaryDirectory() as tmp:
        for context in args.contexts:
            lags: dict[str, list[float]] = {way: [] for way in ways}
            moves: dict[str, list[str]] = {way: [] for way in ways}
            for run in range(args.runs):
                order = list(ways) if run % 2 == 0 else list(reversed(ways))
                for way in order:
                    stack = Stack(
                        model=longer(model, context + 1024, Path(tmp) / f"model-{context}"),
                        workers=2,
                        http_port=free_port(),
                        metrics_port=free_port(),
                        log_dir=Path(tmp) / f"{context}-{way}-{run}",
                        worker_args=[
                            "--max-model-len",
                            str(context + 1024),
                            *ways[way],
                            *worker_flags(args),
                        ],
                    )
                    with stack:
                        wait_for_workers(stack.metrics_url, 2)
                        lag, fetched, failed = asyncio.run(
                            moved_lag(stack, context, args.streams, vocab)
                        )
                    lags[way].append(lag)
                    moves[way].append(f"{fetched}/{failed}")
            t, r = statistics.median(lags["transfer"]), statistics.median(lags["recompute"])
            print(
                f"  {context:5d} tokens: drain to every moved stream's next token: transfer "
                f"{t * 1e3:7.1f} ms ({min(lags['transfer']) * 1e3:.0f}-"
                f"{max(lags['transfer']) * 1e3:.0f}), recompute {r * 1e3:7.1f} ms "
                f"({min(lags['recompute']) * 1e3:.0f}-{max(lags['recompute']) * 1e3:.0f}): "
                f"{t / r:.2f}x; fetches/failures per run: {moves}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["tier", "transfer", "pd", "drain"], default="tier")
    parser.add_argument("--streams", type=int, default=4, help="pd, drain: streams")
    parser.add_argument("--stream-tokens", type=int, default=128, help="pd: each one's tokens")
    parser.add_argument("--long-prompt", type=int, default=1536, help="pd: long prompts' tokens")
    parser.add_argument("--long-every", type=float, default=1.5, help="pd: seconds between")
    parser.add_argument("--duration", type=float, default=20.0, help="pd: seconds of load")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1536])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=512, help="tokens of each system prompt")
    parser.add_argument("--question", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--warmup", type=int, default=32, help="requests before measuring")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kv-offload-dir", default="", help="tier: the disk tier's directory")
    parser.add_argument("--netns", action="store_true", help="pd: workers on netns hosts (root)")
    parser.add_argument("--device", default="cpu", help="the engines' device (cuda: a GPU)")
    parser.add_argument("--dtype", default="auto", help="the engines' dtype (e.g. bfloat16)")
    args = parser.parse_args()
    if args.part == "pd":
        pd_part(args)
        return
    if args.part == "drain":
        drain_part(args)
        return
    if args.part == "transfer":
        with NatsServer() as nats:
            asyncio.run(transfer_part(args, nats.url))
        return
    with tempfile.TemporaryDirectory(prefix="lamina-kv-disk-") as scratch:
        tier_part(args, args.kv_offload_dir or scratch)


def tier_part(args: argparse.Namespace, directory: str) -> None:
    model = ensure_default_model(args.preset)
    block = 16
    working_set = args.tenants * (args.prefix // block)
    base = EngineConfig(
        model=model,
        block_size=block,
        num_kv_blocks=working_set // 4,
        max_model_len=args.prefix + args.question + 16,
        max_num_seqs=4,
        **on_device(args),  # type: ignore[arg-type]
    )
    probe = Engine(base)
    block_bytes = kv_block_bytes(probe.runner.model, block)
    vocab = probe.model_config.vocab_size
    probe.close()
    whole = 2 * working_set * block_bytes  # (room to spare: the questions' blocks too)
    layouts = {
        "no tier": base,
        "host": dataclasses.replace(base, kv_offload_bytes=whole),
        "host+disk": dataclasses.replace(
            base,
            kv_offload_bytes=base.num_kv_blocks * block_bytes,  # type: ignore[operator]
            kv_offload_disk_bytes=whole,
            kv_offload_dir=directory,
        ),
    }
    layouts["host+cold disk"] = layouts["host+disk"]
    print(
        f"model: {args.preset} preset; {os.cpu_count()} cores; {args.tenants} tenants x "
        f"{args.prefix} tokens = {working_set} blocks of working set; device pool "
        f"{base.num_kv_blocks} blocks ({block_bytes / 1024:.0f} KiB each); host: "
        f"{whole / 2**20:.0f} MiB in memory; host+disk: {base.num_kv_blocks} blocks in "
        f"memory over {whole / 2**20:.0f} MiB in {directory}"
    )
    results: dict[str, list[dict[str, float]]] = {name: [] for name in layouts}
    for run in range(args.runs):
        requests = workload(args, vocab, seed=run)
        names = list(layouts)
        for name in names[run % len(names) :] + names[: run % len(names)]:
            engine = Engine(layouts[name])
            try:
                cold = name == "host+cold disk"
                results[name].append(serve(engine, requests, args.warmup, cold))
            finally:
                engine.close()
    print(f"medians of {args.runs} runs ({args.requests - args.warmup} measured requests each):")
    summary = {}
    for name, runs in results.items():
        summary[name] = s = medians(runs)
        p50s = [r["p50"] for r in runs]
        loads = "".join(
            f"  {s[f'{m}_loads']:.0f} from {m} at {s[f'{m}_rate']:,.0f}/s"
            for m in ("host", "disk")
            if s[f"{m}_loads"]
        )
        print(
            f"  {name:14s} hit rate {s['hit_rate']:.2f}  TTFT p50 {s['p50']:7.1f} ms "
            f"({min(p50s):.1f}-{max(p50s):.1f})  p90 {s['p90']:7.1f} ms  blocks loaded:"
            + (loads or " none")
        )
    none = summary["no tier"]
    for name in ("host", "host+disk", "host+cold disk"):
        got = summary[name]
        print(
            f"{name} / no tier: TTFT p50 {got['p50'] / none['p50']:.2f}x, "
            f"p90 {got['p90'] / none['p90']:.2f}x; hit rate {got['hit_rate']:.2f} vs "
            f"{none['hit_rate']:.2f}"
        )


if __name__ == "__main__":
    main()
