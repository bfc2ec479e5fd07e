"""KV that moves, part one: the host tier against none, on a multi-tenant prefix workload
whose working set is four times the device pool.

Each of ``--tenants`` tenants has a system prompt of ``--prefix`` tokens; each request is
a random tenant's prompt plus a fresh question of ``--question`` tokens, with a few
output tokens, one request at a time, in process (the engine alone: no bus). The device
pool holds a quarter of the tenants' prompts; with ``--kv-offload-bytes`` the rest wait
in the host tier. Printed per layout: the prefix-cache hit rate, p50 and p90 time to
first token (from ``add_request`` to its first token), blocks loaded back, and the
ratios of the tier's to none's. Both layouts see the same requests; the runs alternate
which goes first.

Not a test: run it by hand on an otherwise idle machine.

    .venv/bin/python benchmarks/kv_moves.py            # small preset, 16 tenants x 512
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import time

from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.engine_worker.engine.runner import kv_block_bytes


def workload(args: argparse.Namespace, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prefix)] for _ in range(args.tenants)]
    return [
        rng.choice(prompts) + [rng.randrange(3, vocab) for _ in range(args.question)]
        for _ in range(args.requests)
    ]


def serve(engine: Engine, requests: list[list[int]], warmup: int) -> dict[str, float]:
    """TTFTs (ms) and the cache's counters over ``requests`` after the first ``warmup``."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ttfts: list[float] = []
    before = None
    for n, prompt in enumerate(requests):
        if n == warmup:
            before = engine.stats()
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
        "loads": after.host_kv_loads_total - before.host_kv_loads_total,
        "load_rate": after.host_kv_load_blocks_per_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=512, help="tokens of each system prompt")
    parser.add_argument("--question", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--warmup", type=int, default=32, help="requests before measuring")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kv-offload-dir", default="", help="the tier in a file here")
    args = parser.parse_args()
    model = ensure_default_model(args.preset)
    block = 16
    working_set = args.tenants * (args.prefix // block)
    base = EngineConfig(
        model=model,
        block_size=block,
        num_kv_blocks=working_set // 4,
        max_model_len=args.prefix + args.question + 16,
        max_num_seqs=4,
    )
    probe = Engine(base)
    block_bytes = kv_block_bytes(probe.runner.model, block)
    vocab = probe.model_config.vocab_size
    probe.close()
    tier = dataclasses.replace(
        base, kv_offload_bytes=2 * working_set * block_bytes, kv_offload_dir=args.kv_offload_dir
    )
    where = f"in {args.kv_offload_dir}" if args.kv_offload_dir else "in memory"
    print(
        f"model: {args.preset} preset; {os.cpu_count()} cores; {args.tenants} tenants x "
        f"{args.prefix} tokens = {working_set} blocks of working set; device pool "
        f"{base.num_kv_blocks} blocks ({block_bytes / 1024:.0f} KiB each); tier "
        f"{tier.kv_offload_bytes / 2**20:.0f} MiB {where}"
    )
    layouts = {"no tier": base, "host tier": tier}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in layouts}
    for run in range(args.runs):
        requests = workload(args, vocab, seed=run)
        order = list(layouts) if run % 2 == 0 else list(reversed(layouts))
        for name in order:
            engine = Engine(layouts[name])
            try:
                results[name].append(serve(engine, requests, args.warmup))
            finally:
                engine.close()
    print(f"medians of {args.runs} runs ({args.requests - args.warmup} measured requests each):")
    summary = {}
    for name, runs in results.items():
        summary[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        s = summary[name]
        p50s = [r["p50"] for r in runs]
        print(
            f"  {name:10s} hit rate {s['hit_rate']:.2f}  TTFT p50 {s['p50']:7.1f} ms "
            f"({min(p50s):.1f}-{max(p50s):.1f})  p90 {s['p90']:7.1f} ms  "
            f"blocks loaded {s['loads']:.0f}"
            + (f" at {s['load_rate']:,.0f} blocks/s" if s["load_rate"] else "")
        )
    none, host = summary["no tier"], summary["host tier"]
    print(
        f"host tier / no tier: TTFT p50 {host['p50'] / none['p50']:.2f}x, "
        f"p90 {host['p90'] / none['p90']:.2f}x; hit rate {host['hit_rate']:.2f} vs "
        f"{none['hit_rate']:.2f}"
    )


if __name__ == "__main__":
    main()
