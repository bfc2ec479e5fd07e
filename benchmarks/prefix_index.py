"""The scheduler's cluster prefix index at scale: memory per cached block, event intake,
and the time of one lookup, against the obvious peer in the same run: a set of hashes per
worker, each walked over the prompt separately.

Workers' caches are built from shared prefixes (tenants' system prompts), so the lookup
walks a long common prefix, as placement does for a multi-tenant workload.

    .venv/bin/python benchmarks/prefix_index.py                 # 1M blocks over 8 workers
    .venv/bin/python benchmarks/prefix_index.py --blocks 100000 --workers 4
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc

from timing import median_ms

from lamina.libs.block_hash import ROOT_HASH, hash_block, hash_blocks
from lamina.schemas.v1.kv import BlockStored
from lamina.services.scheduler.prefix_index import PrefixIndex

BLOCK = 16


class PerWorkerSets:
    """The peer: each worker's cached hashes in a set, a lookup walks the prompt per worker."""

    def __init__(self) -> None:
        self.sets: dict[str, set[int]] = {}

    def add(self, worker: str, hashes: list[int]) -> None:
        self.sets.setdefault(worker, set()).update(hashes)

    def overlap(self, tokens: list[int], workers: list[str]) -> dict[str, int]:
        result = {}
        for worker in workers:
            cached, parent, blocks = self.sets.get(worker, set()), ROOT_HASH, 0
            for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
                parent = hash_block(parent, tokens[start : start + BLOCK])
                if parent not in cached:
                    break
                blocks += 1
            result[worker] = blocks
        return result


def sequences(total_blocks: int, workers: int, prompt_blocks: int, seed: int) -> dict:
    """Per worker, sequences of ``prompt_blocks`` blocks: one shared prefix of half the
    prompt (the tenant's system prompt, on every worker) and distinct tails."""
    rng = random.Random(seed)
    shared = [rng.randrange(1000) for _ in range(prompt_blocks // 2 * BLOCK)]
    per_worker = total_blocks // workers
    tails = per_worker // (prompt_blocks - prompt_blocks // 2)
    caches = {}
    for w in range(workers):
        seqs = []
        for _ in range(tails):
            tail = [
                rng.randrange(1000) for _ in range((prompt_blocks - prompt_blocks // 2) * BLOCK)
            ]
            seqs.append(shared + tail)
        caches[f"w{w}"] = seqs
    return {"shared": shared, "caches": caches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000, help="cached blocks in all")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--prompt-blocks", type=int, default=256, help="blocks per prompt")
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()

    data = sequences(args.blocks, args.workers, args.prompt_blocks, seed=1)
    hashed = {w: [hash_blocks(seq, BLOCK) for seq in seqs] for w, seqs in data["caches"].items()}
    events = {
        w: [
            BlockStored(event_id=i, parent_hash=ROOT_HASH, block_hashes=hashes)
            for i, hashes in enumerate(seqs)
        ]
        for w, seqs in hashed.items()
    }
    entries = sum(len(set(h for hs in seqs for h in hs)) for seqs in hashed.values())

    gc.collect()
    tracemalloc.start()
    index = PrefixIndex()
    started = time.perf_counter()
    for worker, batch in events.items():
        index.apply(worker, "i1", BLOCK, batch)
    intake = time.perf_counter() - started
    index_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()

    gc.collect()
    tracemalloc.start()
    peer = PerWorkerSets()
    for worker, seqs in hashed.items():
        for hashes in seqs:
            peer.add(worker, hashes)
    peer_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()

    workers = list(events)
    # A prompt that shares the system prompt and the first tail of w0's cache.
    prompt = data["caches"]["w0"][0] + [7] * BLOCK
    assert index.overlap(prompt, workers) == peer.overlap(prompt, workers)
    ours = median_ms(lambda: index.overlap(prompt, workers), args.runs)
    theirs = median_ms(lambda: peer.overlap(prompt, workers), args.runs)
    miss = [9] * len(prompt)
    ours_miss = median_ms(lambda: index.overlap(miss, workers), args.runs)
    theirs_miss = median_ms(lambda: peer.overlap(miss, workers), args.runs)

    print(
        f"{entries:,} cached (block, worker) entries over {args.workers} workers, "
        f"{args.prompt_blocks}-block prompts sharing a {args.prompt_blocks // 2}-block prefix"
    )
    print(
        f"memory: index {index_bytes / entries:.0f} B/entry ({index_bytes / 2**20:.0f} MiB), "
        f"per-worker sets {peer_bytes / entries:.0f} B/entry ({peer_bytes / 2**20:.0f} MiB)"
    )
    print(f"intake: {entries / intake / 1e6:.2f} M blocks/s ({intake:.2f} s for all)")
    print(
        f"lookup, {len(prompt) // BLOCK}-block prompt, hit on every worker's prefix: index "
        f"{ours:.3f} ms vs per-worker walks {theirs:.3f} ms -> {theirs / ours:.1f}x"
    )
    print(
        f"lookup, a prompt nobody has: index {ours_miss:.3f} ms vs per-worker walks "
        f"{theirs_miss:.3f} ms -> {theirs_miss / ours_miss:.1f}x"
    )


if __name__ == "__main__":
    main()
