"""The scheduler's cluster prefix index over a real nats-server: the test plays two
workers (heartbeats, KV events, answers to ``kv.sync``) and a gateway; the scheduler
syncs each worker, places a cached prefix where it is cached, resyncs after a gap and
after a restart, and says why in its placement records."""

from __future__ import annotations

import asyncio
import time

from lamina.libs.block_hash import hash_blocks
from lamina.libs.bus import Bus, NatsConfig
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.generate import GenerateRequest, Sampling
from lamina.schemas.v1.kv import BlockStored, KvEventBatch, KvSnapshot, KvSyncRequest
from lamina.schemas.v1.records import PlacementRecord
from lamina.services.scheduler.prefix_index import PrefixIndex
from lamina.services.scheduler.service import SchedulerConfig, SchedulerService
from tests.telemetry.helpers import make_stats

BS = 16
PROMPT = list(range(3, 3 + 4 * BS + 5))  # 4 full blocks and a partial one
HASHES = hash_blocks(PROMPT, BS)


class Workers:
    """Two workers' bus side, as the test scripts them."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.caches: dict[str, tuple[list[int], int]] = {"a": ([], 0), "b": ([], 0)}
        self.syncs: asyncio.Queue[str] = asyncio.Queue()
        self.forwarded: asyncio.Queue[tuple[str, GenerateRequest]] = asyncio.Queue()
        self.records: asyncio.Queue[PlacementRecord] = asyncio.Queue()
        self.incarnations = {"a": "a-1", "b": "b-1"}

    async def start(self) -> None:
        for worker in self.caches:
            await self.bus.subscribe(
                subjects.worker_kv_sync(worker), KvSyncRequest, self._answer(worker)
            )
            await self.bus.subscribe(
                subjects.worker_generate(worker), GenerateRequest, self._take(worker)
            )

        async def on_record(record: PlacementRecord, _msg) -> None:
            self.records.put_nowait(record)

        await self.bus.subscribe(subjects.EVENTS_PLACEMENT, PlacementRecord, on_record)
        await self.bus.flush()

    def _answer(self, worker: str):
        async def answer(_: KvSyncRequest, msg) -> None:
            hashes, next_event_id = self.caches[worker]
            # Two parts, as a worker with a large cache sends them.
            halves = [hashes[: len(hashes) // 2], hashes[len(hashes) // 2 :]]
            for n, part in enumerate(halves):
                snapshot = KvSnapshot(
                    worker_id=worker,
                    incarnation=self.incarnation(worker),
                    block_size=BS,
                    next_event_id=next_event_id,
                    block_hashes=part,
                    part=n,
                    last=n == 1,
                )
                await self.bus.publish(msg.reply, snapshot)
            self.syncs.put_nowait(worker)

        return answer

    def _take(self, worker: str):
        async def take(request: GenerateRequest, _msg) -> None:
            self.forwarded.put_nowait((worker, request))

        return take

    def incarnation(self, worker: str) -> str:
        return self.incarnations[worker]

    async def heartbeat(self, worker: str, **stats: object) -> None:
        beat = make_stats(
            worker,
            model="tiny",
            num_running=0,
            num_waiting=0,
            num_queued_prefill_tokens=0,
            max_model_len=1024,
            prefill_tokens_per_s=1000.0,
            incarnation=self.incarnation(worker),
            timestamp_ms=int(time.time() * 1000),
            **stats,
        )
        await self.bus.publish(subjects.worker_stats(worker), beat)


async def submit(bus: Bus, request_id: str) -> None:
    request = GenerateRequest(
        request_id=request_id,
        model="tiny",
        prompt_token_ids=PROMPT,
        sampling=Sampling(max_tokens=4),
    )
    await bus.publish(subjects.SCHED_SUBMIT, request, reply=bus.inbox())


def incarnation_of(index: PrefixIndex, worker: str) -> str | None:
    """The incarnation the index has synced for ``worker``, if any."""
    kv = index.workers.get(worker)
    return kv.incarnation if kv is not None and kv.synced else None


async def until(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_the_index_syncs_places_by_prefix_and_resyncs_after_gaps_and_restarts(nats_url):
    async def main() -> None:
        scheduler = SchedulerService(
            SchedulerConfig(nats=NatsConfig(nats_url), scheduler_id="s-kv")
        )
        await scheduler.start()
        await scheduler.bus.flush()
        bus = await Bus.connect(nats_url, "test-kv-workers")
        workers = Workers(bus)
        workers.caches["a"] = (HASHES, 10)  # "a" has the whole prompt's blocks cached
        await workers.start()
        index = scheduler.registry.index
        try:
            # A first heartbeat from a ready worker makes the scheduler sync it.
            for worker in ("a", "b"):
                await workers.heartbeat(worker)
            assert {await asyncio.wait_for(workers.syncs.get(), 5) for _ in range(2)} == {
                "a",
                "b",
            }
            await until(lambda: incarnation_of(index, "a") == "a-1", "a synced")
            await until(lambda: incarnation_of(index, "b") == "b-1", "b synced")
            assert index.overlap(PROMPT, ["a", "b"]) == {"a": 4, "b": 0}

            await submit(bus, "r1")
            worker, _ = await asyncio.wait_for(workers.forwarded.get(), 5)
            record = await asyncio.wait_for(workers.records.get(), 5)
            assert worker == "a"
            assert (record.worker_id, record.prefix_hit_blocks, record.policy) == ("a", 4, "kv")
            assert {s.worker_id: s.overlap_blocks for s in record.scored} == {"a": 4, "b": 0}
            # 5 uncached tokens at 1000 tokens/s, against all 69 on "b".
            predicted = {s.worker_id: s.predicted_ttft_s for s in record.scored}
            assert predicted == {"a": 0.005, "b": 0.069} and record.predicted_ttft_s == 0.005
            assert record.prompt_tokens == len(PROMPT) and record.scheduler_id == "s-kv"

            # Events 10 and 11 are lost: event 12 is a gap, and "a" is asked again.
            workers.caches["a"] = (HASHES[:1], 13)
            lost = BlockStored(event_id=12, parent_hash=HASHES[2], block_hashes=HASHES[3:])
            batch = KvEventBatch(
                worker_id="a", block_size=BS, events=[lost], incarnation=workers.incarnation("a")
            )
            await bus.publish(subjects.worker_kv("a"), batch)
            assert await asyncio.wait_for(workers.syncs.get(), 5) == "a"
            await until(lambda: index.workers["a"].next_event_id == 13, "a resynced")
            assert index.overlap(PROMPT, ["a", "b"]) == {"a": 1, "b": 0}

            # "b" restarts under its id: what was known of it is dropped, and it is synced.
            cached = BlockStored(event_id=0, parent_hash=0, block_hashes=HASHES)
            index.apply("b", "b-1", BS, [cached])
            workers.incarnations["b"] = "b-2"
            await workers.heartbeat("b")
            assert await asyncio.wait_for(workers.syncs.get(), 5) == "b"
            await until(lambda: incarnation_of(index, "b") == "b-2", "b's new incarnation")
            assert index.overlap(PROMPT, ["b"]) == {"b": 0}
        finally:
            await bus.drain()
            await scheduler.close()

    asyncio.run(main())


def test_a_placement_counts_as_pending_at_both_replicas_until_a_heartbeat_shows_it(nats_url):
    """The replica that placed a request counts it at once, the other from its record;
    a heartbeat the worker sent before the forward reached it (its ``placements_seen``
    short of the forward's number) leaves both counting it, and only one that shows it
    received ends the count. (A heartbeat that wiped the count whatever it showed let a
    burst send a worker more than it takes: it refused the excess with a 429.)"""

    async def main() -> list[tuple[int, int]]:
        replicas = [
            SchedulerService(SchedulerConfig(nats=NatsConfig(nats_url), scheduler_id=f"s-peer-{i}"))
            for i in range(2)
        ]
        for replica in replicas:
            await replica.start()
            await replica.bus.flush()
        bus = await Bus.connect(nats_url, "test-kv-peers")
        workers = Workers(bus)
        await workers.start()
        try:
            await workers.heartbeat("a")
            for replica in replicas:
                await until(lambda r=replica: "a" in r.registry.view.workers, "the heartbeat")
            await submit(bus, "burst-1")
            _, forwarded = await asyncio.wait_for(workers.forwarded.get(), 5)
            record = await asyncio.wait_for(workers.records.get(), 5)
            placer = next(r for r in replicas if r.scheduler_id == record.scheduler_id)
            other = next(r for r in replicas if r is not placer)
            assert forwarded.placed_by == record.placed_by == placer.placer_id
            assert forwarded.placement_seq == record.placement_seq == 1

            def pending() -> tuple[int, int]:
                return tuple(r.registry.candidates()[0].pending for r in (placer, other))

            await until(lambda: pending()[1] == 1, "the peer's record")
            counts = [pending()]

            async def beat(seen: dict[str, int]) -> None:
                await workers.heartbeat("a", placements_seen=seen)
                for replica in replicas:
                    await until(
                        lambda r=replica: (
                            r.registry.view.workers["a"].stats.placements_seen == seen
                        ),
                        "the heartbeat",
                    )
                counts.append(pending())

            await beat({placer.placer_id: 0, "another-placer/1": 5})
            await beat({forwarded.placed_by: forwarded.placement_seq})
            return counts
        finally:
            await bus.drain()
            for replica in replicas:
                await replica.close()

    assert asyncio.run(main()) == [(1, 1), (1, 1), (0, 0)]


def test_a_scheduler_that_reconnects_resyncs_every_worker():
    """Events published while it was cut off are lost without a gap showing (an idle
    worker sends no more): after a reconnect it asks every worker again, at its next
    heartbeat."""
    from lamina.libs.nats_server import NatsServer, free_port

    port = free_port()

    async def main() -> list[str]:
        server = NatsServer(port=port).start()
        scheduler = SchedulerService(
            SchedulerConfig(nats=NatsConfig(server.url), scheduler_id="s-re")
        )
        await scheduler.start()
        bus = await Bus.connect(server.url, "test-kv-reconnect")
        workers = Workers(bus)
        await workers.start()
        try:
            await workers.heartbeat("a")
            synced = [await asyncio.wait_for(workers.syncs.get(), 5)]
            server.stop()
            await until(lambda: not scheduler.bus.nc.is_connected, "the scheduler noticing")
            server = NatsServer(port=port).start()  # the same address, a fresh server
            await until(lambda: scheduler.bus.nc.is_connected and bus.nc.is_connected, "both back")
            for connection in (scheduler.bus, bus):  # the subscriptions are at the new server
                await connection.flush()
            # The worker is back, heartbeating as a worker does (the scheduler's reconnect
            # callback may run after the first): the scheduler asks it again.
            deadline = time.monotonic() + 10
            while workers.syncs.empty():
                assert time.monotonic() < deadline, "no KV sync after the reconnect"
                await workers.heartbeat("a")
                await asyncio.sleep(0.25)
            synced.append(workers.syncs.get_nowait())
            return synced
        finally:
            await bus.close()
            await scheduler.close()
            server.stop()

    assert asyncio.run(asyncio.wait_for(main(), 30)) == ["a", "a"]
