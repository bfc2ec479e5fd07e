"""KV between two worker services on a real nats-server, this test acting as their
scheduler: a grant to the worker that holds a prefix and the source in the request to
the other. The receiver fetches the blocks, serves the prompt as a cache hit with the
holder's own tokens, and both heartbeats count what moved; a fetch that cannot happen
(the grant never reached the sender) costs the request nothing but the recompute."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator

from lamina.libs.block_hash import hash_blocks
from lamina.libs.bus import Bus
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.generate import Finished, GenerateRequest, Sampling, Tokens
from lamina.schemas.v1.kv_transfer import KvGrant, KvSource
from lamina.services.engine_worker.service import WorkerService
from tests.bus.test_worker import _stream, worker_config

PREFIX = list(range(5, 69))  # 4 blocks of 16
QUESTION = [*PREFIX, 100, 101, 102]
OTHER = [*range(200, 264), 7]  # 4 blocks of its own


def _request(rid: str, prompt: list[int], source: KvSource | None = None) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model="lamina-tiny",
        prompt_token_ids=prompt,
        sampling=Sampling(max_tokens=8, temperature=0, ignore_eos=True),
        kv_source=source,
    )


@contextlib.asynccontextmanager
async def _workers(*configs) -> AsyncIterator[tuple[Bus, list[WorkerService]]]:
    """The workers ``configs`` describe, started in order, and a bus client acting as
    their scheduler; drained and closed, last first."""
    workers = [WorkerService(config) for config in configs]
    for worker in workers:
        await worker.start()
    bus = await Bus.connect(configs[0].nats.nats_url, "bus-test-scheduler")
    try:
        yield bus, workers
    finally:
        await bus.close()
        for worker in reversed(workers):
            await worker.drain()
            await worker.close()


def _output(events) -> tuple[list[int], Finished]:
    *_, last = events
    assert isinstance(last, Finished), events
    tokens = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
    return tokens + last.token_ids, last


def test_a_worker_serves_a_prefix_fetched_from_another_and_falls_back_when_it_cannot(
    nats_url, tiny_model
):
    async def main() -> None:
        configs = (worker_config(nats_url, w, tiny_model) for w in ("holder", "receiver"))
        async with _workers(*configs) as (bus, (holder, receiver)):
            assert holder.worker_stats().kv_layout == receiver.worker_stats().kv_layout != ""
            address = holder.worker_stats().kv_address
            assert address.startswith("127.0.0.1:")
            want, _ = _output(await _stream(bus, _request("a", QUESTION), "holder"))
            other, _ = _output(await _stream(bus, _request("b", OTHER), "holder"))

            hashes = hash_blocks(QUESTION, 16)
            grant = KvGrant(
                grant_id=secrets.token_hex(16),
                token=secrets.token_hex(32),
                receiver="receiver",
                block_hashes=hashes,
            )
            await bus.publish(subjects.worker_kv_send("holder"), grant)
            source = KvSource(
                worker_id="holder",
                address=address,
                grant_id=grant.grant_id,
                token=grant.token,
                block_hashes=hashes,
            )
            got, finished = _output(await _stream(bus, _request("c", QUESTION, source), "receiver"))
            assert got == want
            assert finished.usage.cached_tokens == len(PREFIX)  # fetched, not computed
            stats = receiver.worker_stats()
            assert (stats.kv_fetches_total, stats.kv_fetched_blocks_total) == (1, 4)
            assert stats.kv_fetch_blocks_per_s > 0 and stats.kv_fetch_failures_total == 0
            assert holder.worker_stats().kv_sent_blocks_total == 4

            # A grant the holder never got: the receiver computes the prompt, exactly.
            unknown = KvSource(
                worker_id="holder",
                address=address,
                grant_id=secrets.token_hex(16),
                token=secrets.token_hex(32),
                block_hashes=hash_blocks(OTHER, 16),
            )
            got, finished = _output(await _stream(bus, _request("d", OTHER, unknown), "receiver"))
            assert got == other and finished.usage.cached_tokens == 0
            assert receiver.worker_stats().kv_fetch_failures_total == 1

    asyncio.run(main())


def _grant_and_source(
    sender: WorkerService, receiver: str, prompt: list[int], blocks: int, prefill: bool
) -> tuple[KvGrant, KvSource]:
    hashes = hash_blocks(prompt, 16)[:blocks]
    grant = KvGrant(
        grant_id=secrets.token_hex(16),
        token=secrets.token_hex(32),
        receiver=receiver,
        block_hashes=hashes,
        prefill_token_ids=prompt[: 16 * blocks] if prefill else [],
    )
    source = KvSource(
        worker_id=sender.worker_id,
        address=sender.worker_stats().kv_address,
        grant_id=grant.grant_id,
        token=grant.token,
        block_hashes=hashes,
        prefill=prefill,
    )
    return grant, source


def test_a_prefill_leg_computes_the_prompt_on_one_worker_and_the_other_streams_from_it(
    nats_url, tiny_model
):
    """Disaggregated: the grant names the prompt's full blocks' tokens; the prefill worker
    computes them at once (streaming nothing), the decode worker fetches them once they
    are cached and computes only the last partial block. Its output equals its own run of
    the whole prompt. A leg whose grant never reaches the prefill worker: the decode
    worker waits (its stream kept alive, in seq order) and computes the prompt itself."""

    async def main() -> None:
        async with _workers(
            worker_config(nats_url, "prefiller", tiny_model, role="prefill"),
            worker_config(nats_url, "decoder", tiny_model, role="decode", stream_keepalive=0.2),
        ) as (bus, (prefiller, decoder)):
            assert (prefiller.worker_stats().role, decoder.worker_stats().role) == (
                "prefill",
                "decode",
            )
            question, _ = _output(await _stream(bus, _request("q", QUESTION), "decoder"))

            grant, source = _grant_and_source(prefiller, "decoder", QUESTION, 4, prefill=True)
            await bus.publish(subjects.worker_kv_send("prefiller"), grant)
            got, finished = _output(
                await _stream(bus, _request("leg", QUESTION, source), "decoder")
            )
            assert got == question
            assert finished.usage.cached_tokens == len(PREFIX)  # computed there, not here
            assert prefiller.worker_stats().kv_prefills_total == 1
            assert prefiller.worker_stats().kv_sent_blocks_total == 4
            await asyncio.sleep(0.3)  # the engine's stats, refreshed every 0.1 s
            assert prefiller.engine_thread.stats.prompt_tokens_total == len(PREFIX)

            # The grant is lost on the way: the decode worker computes the prompt.
            _, lost = _grant_and_source(prefiller, "decoder", OTHER, 4, prefill=True)
            events = await _stream(bus, _request("lost", OTHER, lost), "decoder")
            got, finished = _output(events)
            assert finished.usage.cached_tokens == 0
            assert got == _output(await _stream(bus, _request("whole", OTHER), "prefiller"))[0]
            seqs = [e.seq for e in events if isinstance(e, Tokens | Finished)]
            assert seqs == list(range(1, len(seqs) + 1))
            waiting = [e for e in events if isinstance(e, Tokens) and not e.token_ids]
            assert len(waiting) >= 3  # the sender waits 2 s for a grant; 0.2 s keep-alives
            assert decoder.worker_stats().kv_fetch_failures_total == 1

    asyncio.run(main())


def test_a_tensor_parallel_worker_sends_its_blocks_whole_to_a_one_process_worker(nats_url, stories):
    """The holder's two ranks each hold half of every block's KV heads: the transfer
    carries them whole, and the receiver's pool takes them as its own. A trained model:
    its greedy tokens do not hang on the split's rounding."""
    from lamina.services.engine_worker.engine.config import EngineConfig

    async def main() -> None:
        split = EngineConfig(model=stories, tensor_parallel_size=2, max_model_len=256)
        whole = EngineConfig(model=stories, max_model_len=256)
        async with _workers(
            worker_config(nats_url, "holder", stories, engine=split),
            worker_config(nats_url, "receiver", stories, engine=whole),
        ) as (bus, (holder, receiver)):
            assert holder.worker_stats().kv_layout == receiver.worker_stats().kv_layout
            assert holder.worker_stats().tensor_parallel_size == 2
            want, _ = _output(await _stream(bus, _request("a", QUESTION), "holder"))
            grant, source = _grant_and_source(holder, "receiver", QUESTION, 4, prefill=False)
            await bus.publish(subjects.worker_kv_send("holder"), grant)
            got, finished = _output(await _stream(bus, _request("b", QUESTION, source), "receiver"))
            assert got == want
            assert finished.usage.cached_tokens == len(PREFIX)  # fetched, not computed
            assert receiver.worker_stats().kv_fetched_blocks_total == 4
            assert holder.worker_stats().kv_sent_blocks_total == 4

    asyncio.run(main())
