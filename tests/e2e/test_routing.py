"""KV-aware placement on a real stack of three workers: repeats of a long prefix go to the
worker that has it cached, or to one that fetches it from that worker, concurrent ones
included (their usage says so), while distinct prompts sent at once spread over the
workers."""

from __future__ import annotations

import asyncio

import httpx

from lamina.libs.bus import Bus
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.kv import BlockStored, KvEventBatch
from lamina.schemas.v1.records import PlacementRecord
from tests.e2e.conftest import make_stack

PREFIX = [(7 * i) % 400 + 5 for i in range(320)]  # 20 blocks of 16, the "system prompt"
BLOCK = 16


async def complete(client: httpx.AsyncClient, prompt: list[int]) -> dict:
    response = await client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0}
    )
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def cached_tokens(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_a_shared_prefix_lands_where_it_is_cached_and_distinct_prompts_spread(tiny_model, tmp_path):
    stack = make_stack(
        tiny_model,
        tmp_path,
        workers=3,
        worker_args=["--num-kv-blocks", "256", "--max-model-len", "1024"],
    )

    async def main(base_url: str, nats_url: str) -> tuple[list[int], list[str], list[str]]:
        placed: list[PlacementRecord] = []
        stored: asyncio.Queue[str] = asyncio.Queue()
        bus = await Bus.connect(nats_url, "test-routing")

        async def on_record(record: PlacementRecord, _msg) -> None:
            placed.append(record)

        async def on_kv(batch: KvEventBatch, _msg) -> None:
            if any(isinstance(e, BlockStored) for e in batch.events):
                stored.put_nowait(batch.worker_id)

        await bus.subscribe(subjects.EVENTS_PLACEMENT, PlacementRecord, on_record)
        await bus.subscribe(subjects.WORKER_KV_ALL, KvEventBatch, on_kv)
        await bus.flush()
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            first = await complete(client, [*PREFIX, 1, 2, 3])
            assert cached_tokens(first) == 0
            holder = await asyncio.wait_for(stored.get(), 10)
            # The scheduler hears the same KV events; give it a moment to index them.
            await asyncio.sleep(0.2)
            placed.clear()
            repeats = await asyncio.gather(
                *(complete(client, [*PREFIX, 50 + i, 60 + i]) for i in range(8))
            )
            prefix_workers = [r.worker_id for r in placed]
            # Each repeat goes to a worker that holds the prefix (the first, or one that
            # fetched it since), or to one that fetches it from such: none computes it.
            full = len(PREFIX) // BLOCK
            chosen = [next(s for s in r.scored if s.worker_id == r.worker_id) for r in placed]
            served = [(s.worker_id, s.overlap_blocks, s.fetch_from, s.fetch_blocks) for s in chosen]
            assert chosen and all(max(s.overlap_blocks, s.fetch_blocks) == full for s in chosen), (
                holder,
                served,
            )
            # Let every worker's heartbeat (0.5 s) report the rates its repeats measured:
            # one that computed only two-token tails must not look slower for it.
            await asyncio.sleep(1.5)
            placed.clear()
            # Distinct long prompts at once: nothing cached anywhere, so queued work decides.
            distinct = [[(i * 31 + j * 7) % 400 + 500 for j in range(300)] for i in range(6)]
            await asyncio.gather(*(complete(client, prompt) for prompt in distinct))
            await bus.flush()
            spread = [r.worker_id for r in placed]
        await bus.drain()
        return [cached_tokens(u) for u in repeats], prefix_workers, spread

    with stack:
        cached, prefix_workers, spread = asyncio.run(main(stack.base_url, stack.nats_url))
    # Every repeat found the prefix cached (all its full blocks: 20 of 16 tokens)...
    assert cached == [len(PREFIX) // BLOCK * BLOCK] * 8, cached
    # ...because each went where it was cached, or fetched it from there.
    assert len(prefix_workers) == 8
    assert len(spread) == 6 and len(set(spread)) >= 2, spread
