"""The engine worker's wire contract, against a real nats-server with the worker service
running in this process: what a scheduler (or anything else) that sends it a request sees
on the reply subject."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest

from lamina.libs.bus import Bus, NatsConfig
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import ControlAck, Drain, ResetPrefixCache, Resume
from lamina.schemas.v1.errors import BadMessage
from lamina.schemas.v1.generate import (
    Accepted,
    Failed,
    Finished,
    GenerateRequest,
    Rejected,
    RejectReason,
    Sampling,
    StreamBatch,
    StreamEvent,
    Tokens,
)
from lamina.schemas.v1.kv import (
    AllBlocksCleared,
    BlockStored,
    KvEventBatch,
    KvSnapshot,
    KvSyncRequest,
)
from lamina.schemas.v1.stats import GatewayAlive, WorkerState, WorkerStats
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.service import WorkerConfig, WorkerIdInUse, WorkerService

WORKER = "bus-test-worker"


def worker_config(nats_url: str, worker_id: str, model: Path, **options) -> WorkerConfig:
    options.setdefault("engine", EngineConfig(model=model))
    return WorkerConfig(nats=NatsConfig(nats_url), worker_id=worker_id, **options)


def tiny_request(rid: str, prompt: list[int] | None = None, **sampling) -> GenerateRequest:
    """A request for the tiny model: ``prompt`` (default ``[5, 6, 7]``), ``sampling``."""
    return GenerateRequest(
        request_id=rid,
        model="lamina-tiny",
        prompt_token_ids=prompt or [5, 6, 7],
        sampling=Sampling(**sampling),
    )


async def _stream(bus: Bus, request: GenerateRequest, worker_id: str = WORKER) -> list[StreamEvent]:
    """Every event on the reply subject up to the last one (Finished, Rejected, Failed, or
    the ``BadMessage`` of a request that did not decode)."""
    events: list[StreamEvent | BadMessage] = []
    done = asyncio.Event()

    async def on_event(event: StreamEvent | BadMessage, _msg) -> None:
        events.append(event)
        if not isinstance(event, Accepted | Tokens):
            done.set()

    inbox = bus.inbox()
    sub = await bus.subscribe(inbox, StreamEvent | BadMessage, on_event)
    await bus.publish(subjects.worker_generate(worker_id), request, reply=inbox)
    await asyncio.wait_for(done.wait(), 30)
    await sub.unsubscribe()
    return events


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_request_streams_accepted_then_ordered_tokens_then_finished(
    nats_url, tiny_model, quantization
):
    """Accepted (saying how the worker computes, as its heartbeat does), then the tokens
    in order, then Finished; a prompt over the context is rejected."""

    async def main() -> None:
        engine = EngineConfig(model=tiny_model, quantization=quantization)
        worker = WorkerService(worker_config(nats_url, WORKER, tiny_model, engine=engine))
        await worker.start()
        stats = worker.worker_stats()
        assert (stats.dtype, stats.weight_dtype) == ("float32", quantization or "float32")
        numerics = f"cpu/float32/{quantization or 'float32'}/auto"
        assert stats.numerics() == numerics
        bus = await Bus.connect(nats_url, "bus-test-client")
        try:
            streams = await asyncio.gather(
                *(
                    _stream(
                        bus,
                        GenerateRequest(
                            request_id=f"r{i}",
                            model="lamina-tiny",
                            prompt_token_ids=[5 + i, 6, 7, 8],
                            sampling=Sampling(max_tokens=9, temperature=0, ignore_eos=True),
                        ),
                    )
                    for i in range(4)
                )
            )
            for i, events in enumerate(streams):
                first, *middle, last = events
                assert first == Accepted(
                    request_id=f"r{i}", worker_id=WORKER, seq=0, numerics=numerics
                )
                assert all(isinstance(e, Tokens) for e in middle)
                assert isinstance(last, Finished)
                assert [e.seq for e in events] == list(range(len(events)))
                tokens = [t for e in middle for t in e.token_ids] + last.token_ids
                assert len(tokens) == last.usage.completion_tokens == 9
                assert last.usage.prompt_tokens == 4

            rejected = await _stream(
                bus,
                GenerateRequest(
                    request_id="too-long",
                    model="lamina-tiny",
                    prompt_token_ids=[5] * 100_000,
                    sampling=Sampling(max_tokens=1),
                ),
            )
            assert len(rejected) == 1 and isinstance(rejected[0], Rejected)
            assert rejected[0].reason == "invalid_request"
        finally:
            await bus.close()
            await worker.drain()
            await worker.close()

    asyncio.run(main())


def test_a_second_worker_under_a_running_workers_id_refuses_to_start(nats_url, tiny_model):
    async def main() -> None:
        config = worker_config(nats_url, "dup-worker", tiny_model)
        first = WorkerService(config)
        await first.start()
        second = WorkerService(config)
        try:
            with pytest.raises(WorkerIdInUse, match="'dup-worker' is already in use"):
                await second.start()
            assert second.engine_thread is None  # refused before loading the model
            assert first.state == "ready"  # the ping changed nothing
        finally:
            await second.bus.close()
            await first.drain()
            await first.close()

    asyncio.run(main())


def test_drain_resume_reset_and_kv_events(nats_url, tiny_model):
    """Control commands change what the worker does with the next request, and its prefix
    cache's changes reach ``worker.<id>.kv`` as they happen, a reset included."""
    worker_id = "bus-ctl-worker"

    def generate(rid: str) -> GenerateRequest:  # two full 16-token blocks
        return tiny_request(rid, list(range(5, 45)), max_tokens=2, temperature=0, ignore_eos=True)

    async def main() -> None:
        worker = WorkerService(worker_config(nats_url, worker_id, tiny_model))
        await worker.start()
        bus = await Bus.connect(nats_url, "bus-test-control")
        kv: asyncio.Queue[KvEventBatch] = asyncio.Queue()

        async def on_kv(batch: KvEventBatch, _msg) -> None:
            kv.put_nowait(batch)

        async def control(command) -> ControlAck:
            return await bus.request(
                subjects.worker_control(worker_id), command, ControlAck, timeout=10
            )

        async def stream(rid: str) -> list[StreamEvent]:
            return await _stream(bus, generate(rid), worker_id)

        try:
            await bus.subscribe(subjects.worker_kv(worker_id), KvEventBatch, on_kv)
            assert isinstance((await stream("before"))[-1], Finished)
            stored = await asyncio.wait_for(kv.get(), 10)
            assert stored.worker_id == worker_id and stored.block_size == 16
            first = stored.events[0]
            assert isinstance(first, BlockStored) and len(first.block_hashes) >= 2

            assert (await control(Drain())).state == "draining"
            (rejected,) = await stream("while-draining")
            assert isinstance(rejected, Rejected) and rejected.reason == "draining"
            assert rejected.retryable

            assert (await control(Resume())).state == "ready"
            assert isinstance((await stream("after"))[-1], Finished)

            assert (await control(ResetPrefixCache())).ok
            batches = [stored]
            while not isinstance(batches[-1].events[-1], AllBlocksCleared):
                batches.append(await asyncio.wait_for(kv.get(), 5))  # no request is running
            ids = [e.event_id for b in batches for e in b.events]
            assert ids == list(range(ids[0], ids[0] + len(ids)))  # numbered without gaps
        finally:
            await bus.close()
            await worker.drain()
            await worker.close()

    asyncio.run(main())


def test_a_worker_heartbeats_starting_before_its_model_is_loaded(nats_url, tiny_model):
    worker_id = "bus-starting-worker"

    async def main() -> list[WorkerStats]:
        bus = await Bus.connect(nats_url, "bus-test-stats")
        seen: list[WorkerStats] = []

        async def on_stats(stats: WorkerStats, _msg) -> None:
            seen.append(stats)

        await bus.subscribe(subjects.worker_stats(worker_id), WorkerStats, on_stats)
        await bus.flush()
        worker = WorkerService(worker_config(nats_url, worker_id, tiny_model))
        try:
            await worker.start()
            while not seen or seen[-1].state != "ready":
                await asyncio.sleep(0.01)
        finally:
            await worker.drain()
            await worker.close()
            await bus.close()
        return seen

    seen = asyncio.run(asyncio.wait_for(main(), 60))
    assert seen[0].state == "starting" and seen[0].model == "lamina-tiny"
    assert seen[0].total_kv_blocks == 0  # no pool yet
    ready = next(s for s in seen if s.state == "ready")
    assert ready.total_kv_blocks > 0 and ready.max_model_len > 0


def test_a_failed_step_degrades_the_worker_until_resumed(nats_url, tiny_model):
    worker_id = "bus-degraded-worker"

    def generate(rid: str) -> GenerateRequest:
        return tiny_request(rid, max_tokens=3, temperature=0, ignore_eos=True)

    def break_step(engine) -> None:  # a fault injected on the engine thread
        def fail() -> None:
            raise RuntimeError("injected fault")

        engine.step = fail

    async def main() -> None:
        worker = WorkerService(worker_config(nats_url, worker_id, tiny_model))
        await worker.start()
        bus = await Bus.connect(nats_url, "bus-test-degraded")
        try:
            await asyncio.to_thread(worker.engine_thread.call(break_step).wait, 10)
            accepted, failed = await _stream(bus, generate("hit"), worker_id)
            assert isinstance(accepted, Accepted)
            assert isinstance(failed, Failed) and failed.retryable and not failed.tokens_sent
            while worker.state != "degraded":
                await asyncio.sleep(0.01)
            (rejected,) = await _stream(bus, generate("refused"), worker_id)
            assert isinstance(rejected, Rejected) and rejected.reason == "degraded"
            assert rejected.retryable

            await asyncio.to_thread(
                worker.engine_thread.call(lambda e: delattr(e, "step")).wait, 10
            )
            ack = await bus.request(
                subjects.worker_control(worker_id), Resume(), ControlAck, timeout=10
            )
            assert ack.state == "ready"
            assert isinstance((await _stream(bus, generate("again"), worker_id))[-1], Finished)
        finally:
            await bus.close()
            await worker.drain()
            await worker.close()

    asyncio.run(asyncio.wait_for(main(), 60))


async def _heartbeats(bus: Bus, worker_id: str) -> asyncio.Queue[WorkerStats]:
    """Each heartbeat of ``worker_id`` from now on, in order."""
    heartbeats: asyncio.Queue[WorkerStats] = asyncio.Queue()

    async def on_stats(stats: WorkerStats, _msg) -> None:
        heartbeats.put_nowait(stats)

    await bus.subscribe(subjects.worker_stats(worker_id), WorkerStats, on_stats)
    return heartbeats


def test_a_worker_heartbeats_before_schedulers_would_count_it_full_and_not_while_idle(
    nats_url, tiny_model
):
    """A scheduler counts what it placed on a worker since its last heartbeat as waiting
    there, and counts the worker full once those and the heartbeat's waiting ones reach
    ``max_num_seqs``. With the heartbeat interval at ten minutes and two sequences, each
    request (half of them) is still followed by a heartbeat built after it was sent, so
    that count drops back; below half nothing extra goes, and an idle worker sends none."""
    worker_id = "bus-test-prompt-beats"

    async def run(max_num_seqs: int, requests: int) -> list[list[WorkerStats]]:
        """Each request's heartbeats: those built after it was sent, before the next."""
        engine = EngineConfig(model=tiny_model, max_num_seqs=max_num_seqs)
        config = worker_config(nats_url, worker_id, tiny_model, stats_interval=600, engine=engine)
        worker = WorkerService(config)
        await worker.start()
        bus = await Bus.connect(nats_url, "bus-test-prompt-beats-client")
        heartbeats = await _heartbeats(bus, worker_id)
        await bus.flush()
        seen: list[list[WorkerStats]] = []
        try:
            await asyncio.sleep(0.5)
            assert heartbeats.empty()  # idle: nothing to tell
            for i in range(requests):
                sent_ms = time.time() * 1000
                request = tiny_request(f"short-{i}", max_tokens=3, ignore_eos=True)
                events = await _stream(bus, request, worker_id)
                assert isinstance(events[-1], Finished)
                await asyncio.sleep(0.3)
                seen.append([])
                while not heartbeats.empty():
                    stats = heartbeats.get_nowait()
                    assert stats.timestamp_ms >= sent_ms
                    seen[-1].append(stats)
            await asyncio.sleep(0.5)
            assert heartbeats.empty()  # idle again
        finally:
            await bus.close()
            await worker.drain()
            await worker.close()
        return seen

    async def main() -> None:
        assert all(await run(max_num_seqs=2, requests=3))  # one of two: half
        assert await run(max_num_seqs=8, requests=3) == [[], [], []]  # three of eight

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_dead_engine_thread_turns_the_worker_failed(nats_url, tiny_model):
    """The seed that used to kill the engine thread is refused at decode; whatever else
    kills it turns the worker ``failed`` in its next heartbeat (with the reason), fails what
    it held as retryable, and refuses new work as ``failed``; ``Resume`` cannot revive it."""
    worker_id = "bus-test-failed"

    def generate(rid: str, **sampling) -> GenerateRequest:
        return tiny_request(rid, **({"max_tokens": 200, "ignore_eos": True} | sampling))

    async def main() -> None:
        worker = WorkerService(worker_config(nats_url, worker_id, tiny_model, stats_interval=0.1))
        await worker.start()
        bus = await Bus.connect(nats_url, "bus-test-failed-client")
        heartbeats = await _heartbeats(bus, worker_id)
        try:
            (bad,) = await _stream(bus, generate("seed", seed=2**64 + 1), worker_id)
            assert isinstance(bad, BadMessage) and "seed" in bad.error

            def break_events(engine) -> None:
                take = engine.take_kv_events

                def fail() -> list:  # read after every step, outside the step
                    if engine.requests:
                        raise RuntimeError("injected fault")
                    return take()

                engine.take_kv_events = fail

            await asyncio.to_thread(worker.engine_thread.call(break_events).wait, 10)
            accepted, failed = await _stream(bus, generate("held"), worker_id)
            assert isinstance(accepted, Accepted)
            assert isinstance(failed, Failed) and failed.retryable
            stats = await heartbeats.get()
            while stats.state != WorkerState.FAILED:
                stats = await asyncio.wait_for(heartbeats.get(), 10)
            assert "injected fault" in stats.state_reason
            (rejected,) = await _stream(bus, generate("refused"), worker_id)
            assert isinstance(rejected, Rejected) and rejected.reason == RejectReason.FAILED
            ack = await bus.request(
                subjects.worker_control(worker_id), Resume(), ControlAck, timeout=10
            )
            assert not ack.ok and ack.state == WorkerState.FAILED
        finally:
            await bus.close()
            await worker.drain()
            await worker.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_resume_cannot_undo_a_shutdown_drain(nats_url, tiny_model):
    worker_id = "bus-test-shutdown"

    async def main() -> None:
        worker = WorkerService(worker_config(nats_url, worker_id, tiny_model))
        await worker.start()
        bus = await Bus.connect(nats_url, "bus-test-shutdown-client")
        try:
            await worker.drain()  # what SIGTERM does
            ack = await bus.request(
                subjects.worker_control(worker_id), Resume(), ControlAck, timeout=10
            )
            assert not ack.ok and ack.state == WorkerState.DRAINING and "SIGTERM" in ack.message
        finally:
            await bus.close()
            await worker.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_kv_snapshot_is_the_cache_the_events_describe(nats_url, tiny_model):
    """What ``kv.sync`` answers is what a receiver of every KV event would hold, as of the
    event id it names, under the incarnation the heartbeats and events carry."""
    worker_id = "bus-kv-sync-worker"

    async def main() -> None:
        worker = WorkerService(worker_config(nats_url, worker_id, tiny_model))
        await worker.start()
        bus = await Bus.connect(nats_url, "bus-test-kv-sync")
        batches: list[KvEventBatch] = []

        async def on_kv(batch: KvEventBatch, _msg) -> None:
            batches.append(batch)

        try:
            await bus.subscribe(subjects.worker_kv(worker_id), KvEventBatch, on_kv)
            for i in range(3):  # three prompts of three full blocks each
                prompt = [5 + i, *range(100, 147)]
                request = GenerateRequest(
                    request_id=f"s{i}",
                    model="lamina-tiny",
                    prompt_token_ids=prompt,
                    sampling=Sampling(max_tokens=2, temperature=0, ignore_eos=True),
                )
                assert isinstance((await _stream(bus, request, worker_id))[-1], Finished)
            parts: asyncio.Queue[KvSnapshot] = asyncio.Queue()

            async def on_part(part: KvSnapshot, _msg) -> None:
                parts.put_nowait(part)

            inbox = bus.inbox()
            await bus.subscribe(inbox, KvSnapshot, on_part)
            await bus.publish(subjects.worker_kv_sync(worker_id), KvSyncRequest(), reply=inbox)
            snapshot = await asyncio.wait_for(parts.get(), 10)
            await bus.drain()  # the barrier: every event published before it has arrived
            held: set[int] = set()
            for event in (e for b in batches for e in b.events):
                if event.event_id < snapshot.next_event_id:
                    held |= set(event.block_hashes) if isinstance(event, BlockStored) else set()
            assert snapshot.last and snapshot.worker_id == worker_id
            assert set(snapshot.block_hashes) == held and len(held) == 3 * 3
            assert snapshot.next_event_id == sum(len(b.events) for b in batches)
            assert {b.incarnation for b in batches} == {snapshot.incarnation}
            assert worker.worker_stats().incarnation == snapshot.incarnation
        finally:
            await bus.close()
            await worker.drain()
            await worker.close()

    asyncio.run(main())


def test_a_worker_stops_the_requests_of_a_gateway_that_stopped_heartbeating(nats_url, tiny_model):
    worker_id = "bus-orphan-worker"

    async def main() -> tuple[list, list]:
        worker = WorkerService(worker_config(nats_url, worker_id, tiny_model, stats_interval=0.1))
        await worker.start()
        bus = await Bus.connect(nats_url, "bus-test-gateway")
        prefix = bus.inbox()
        alive = GatewayAlive(gateway_id="gw-test", inbox_prefix=prefix, interval_s=0.1)
        orphan: list = []
        try:
            await bus.subscribe(f"{prefix}.>", StreamEvent, lambda e, m: _append(orphan, e))
            await bus.publish(subjects.gateway_alive("gw-test"), alive)
            await bus.flush()
            long = GenerateRequest(
                request_id="orphan",
                model="lamina-tiny",
                prompt_token_ids=[5, 6, 7, 8],
                sampling=Sampling(max_tokens=2000, ignore_eos=True),  # seconds of work
            )
            reply = subjects.worker_stream(f"{prefix}.1", worker_id)  # as a scheduler forwards
            await bus.publish(subjects.worker_generate(worker_id), long, reply=reply)
            while not any(isinstance(e, Tokens) for e in orphan):
                await asyncio.sleep(0.01)
            # The gateway goes silent (no more heartbeats): within three intervals plus a
            # check, the worker drops the request and frees its blocks.
            deadline = time.monotonic() + 5
            while worker.engine_thread.replies() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            # A requester that never heartbeat (a test client, say) is left alone.
            kept = msgspec.structs.replace(
                long, request_id="kept", sampling=Sampling(max_tokens=20, ignore_eos=True)
            )
            other = await _stream(bus, kept, worker_id)
            engine = worker.engine_thread.engine
            return orphan, other, engine.blocks.num_free_blocks == engine.blocks.num_blocks
        finally:
            await bus.close()
            await worker.drain()
            await worker.close()

    orphan, other, all_free = asyncio.run(main())
    assert not any(isinstance(e, Finished) for e in orphan)  # stopped, not finished
    assert isinstance(other[-1], Finished) and other[-1].usage.completion_tokens == 20
    assert all_free


async def _append(events: list, event) -> None:
    events.append(event)


def test_a_request_waiting_in_the_engine_gets_keep_alives_and_a_full_worker_refuses(
    nats_url, tiny_model
):
    """With one sequence running and one waiting (``max_num_seqs`` 1, one more may wait),
    the waiting one's stream hears empty ``Tokens`` until it runs, and a third request is
    refused up front: ``overloaded``, retryable, with when to retry. The heartbeat
    reports the last placement it handled (held or refused) from each placer."""
    worker_id = "bus-full-worker"
    seen: list[dict[str, int]] = []

    async def main() -> tuple[list, list, list]:
        engine = EngineConfig(model=tiny_model, max_num_seqs=1)
        config = worker_config(
            nats_url, worker_id, tiny_model, engine=engine, max_waiting_seqs=1, stream_keepalive=0.2
        )
        worker = WorkerService(config)
        await worker.start()
        bus = await Bus.connect(nats_url, "bus-test-full")
        try:
            long = GenerateRequest(
                request_id="running",
                model="lamina-tiny",
                prompt_token_ids=[5, 6, 7, 8],
                sampling=Sampling(max_tokens=400, ignore_eos=True),
                placed_by="s-1/ab",
                placement_seq=7,
            )
            running = asyncio.create_task(_stream(bus, long, worker_id))
            while not worker.engine_thread.num_requests:
                await asyncio.sleep(0.01)
            seen.append(worker.worker_stats().placements_seen)
            unplaced = msgspec.structs.replace(long, request_id="waiting", placed_by=None)
            waiting = asyncio.create_task(_stream(bus, unplaced, worker_id))
            while worker.engine_thread.num_requests < 2:
                await asyncio.sleep(0.01)
            seen.append(worker.worker_stats().placements_seen)
            third = msgspec.structs.replace(long, request_id="x", placement_seq=8)
            refused = await _stream(bus, third, worker_id)
            seen.append(worker.worker_stats().placements_seen)
            return await running, await waiting, refused
        finally:
            await bus.close()
            await worker.drain()
            await worker.close()

    running, waiting, refused = asyncio.run(main())
    assert isinstance(running[-1], Finished) and isinstance(waiting[-1], Finished)
    assert [e.seq for e in waiting[1:]] == list(range(1, len(waiting)))  # no gap
    tokens = [e for e in waiting if isinstance(e, Tokens)]
    keep_alives = [e for e in tokens if not e.token_ids]
    assert keep_alives and tokens[: len(keep_alives)] == keep_alives  # before it ran
    (rejected,) = refused
    assert isinstance(rejected, Rejected) and rejected.reason == RejectReason.OVERLOADED
    assert rejected.retryable and rejected.retry_after_s == 1.0
    assert rejected.worker_id == worker_id  # the gateway submits it again
    assert seen == [{"s-1/ab": 7}, {"s-1/ab": 7}, {"s-1/ab": 8}]


def test_a_tensor_parallel_worker_reports_its_ranks_and_fails_as_a_group(nats_url, tiny_model):
    """A worker of two ranks heartbeats its shape and each rank; a rank killed mid-stream
    fails the stream as retryable (its KV is lost: ``failed``), turns the worker ``failed``
    naming the rank, and asks its process to exit, for its supervisor to restart the
    group."""
    worker_id = "bus-test-tp"

    async def main() -> None:
        engine = EngineConfig(model=tiny_model, tensor_parallel_size=2)
        worker = WorkerService(
            worker_config(nats_url, worker_id, tiny_model, stats_interval=0.1, engine=engine)
        )
        await worker.start()
        bus = await Bus.connect(nats_url, "bus-test-tp-client")
        heartbeats = await _heartbeats(bus, worker_id)
        try:
            stats = await asyncio.wait_for(heartbeats.get(), 10)
            assert stats.tensor_parallel_size == 2 and stats.numerics().endswith("/tp2")
            assert [rank.rank for rank in stats.ranks] == [0, 1]
            assert all(rank.weight_bytes and rank.kv_bytes for rank in stats.ranks)
            request = GenerateRequest(
                request_id="long",
                model="lamina-tiny",
                prompt_token_ids=[5, 6, 7],
                sampling=Sampling(max_tokens=1000, ignore_eos=True),
            )
            events: list[StreamEvent] = []
            done = asyncio.Event()

            async def on_event(event: StreamEvent, _msg) -> None:
                events.append(event)
                if isinstance(event, Tokens) and event.token_ids and len(events) == 3:
                    os.kill(stats.ranks[1].pid, signal.SIGKILL)  # mid-stream
                if not isinstance(event, Accepted | Tokens):
                    done.set()

            inbox = bus.inbox()
            await bus.subscribe(inbox, StreamEvent, on_event)
            await bus.publish(subjects.worker_generate(worker_id), request, reply=inbox)
            await asyncio.wait_for(done.wait(), 30)
            failed = events[-1]
            assert isinstance(failed, Failed) and failed.retryable and failed.tokens_sent
            assert failed.reason == RejectReason.FAILED and "rank 1 of 2" in failed.message
            while stats.state != WorkerState.FAILED:
                stats = await asyncio.wait_for(heartbeats.get(), 10)
            assert "rank 1 of 2" in stats.state_reason
            reason = await asyncio.wait_for(worker.failure.reason, 10)
            assert "rank 1 of 2" in reason
        finally:
            await bus.close()
            await worker.close()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_gateway_that_reads_batches_gets_each_step_of_its_streams_as_one_message(
    nats_url, tiny_model
):
    """Once a gateway's heartbeat says it reads ``StreamBatch``, the worker sends it every
    stream's events of a step together on its batch subject: each stream complete and in
    ``seq`` order, in fewer messages than events (here four streams a step, so about a
    quarter)."""
    worker_id = "bus-batch-worker"

    async def main() -> tuple[dict[str, list], int, list[str]]:
        worker = WorkerService(worker_config(nats_url, worker_id, tiny_model))
        await worker.start()
        bus = await Bus.connect(nats_url, "bus-test-batch-gateway")
        prefix = bus.inbox()
        alive = GatewayAlive(
            gateway_id="gw-batch", inbox_prefix=prefix, interval_s=1.0, stream_batches=True
        )
        streams: dict[str, list] = {f"a{i}": [] for i in range(4)}
        subjects_seen: list[str] = []
        ended = asyncio.Event()

        async def on_message(message: StreamEvent | StreamBatch, msg) -> None:
            subjects_seen.append(msg.subject)
            if isinstance(message, StreamBatch):
                items = [(item.attempt, item.event) for item in message.events]
            else:  # on the attempt's own subject
                items = [(msg.subject.rsplit(".", 2)[1], message)]
            for attempt, event in items:
                streams[attempt].append(event)
            if sum(isinstance(e[-1], Finished) for e in streams.values() if e) == 4:
                ended.set()

        try:
            await bus.subscribe(f"{prefix}.>", StreamEvent | StreamBatch, on_message)
            await bus.publish(subjects.gateway_alive("gw-batch"), alive)
            await bus.flush()
            while prefix not in worker._batching:
                await asyncio.sleep(0.01)
            for attempt in streams:
                request = GenerateRequest(
                    request_id=f"r-{attempt}",
                    model="lamina-tiny",
                    prompt_token_ids=[5, 6, 7, 8],
                    sampling=Sampling(max_tokens=40, ignore_eos=True),
                )
                reply = subjects.worker_stream(f"{prefix}.{attempt}", worker_id)
                await bus.publish(subjects.worker_generate(worker_id), request, reply=reply)
            await asyncio.wait_for(ended.wait(), 30)
            return streams, len(subjects_seen), sorted(set(subjects_seen))
        finally:
            await bus.close()
            await worker.drain()
            await worker.close()

    streams, messages, seen = asyncio.run(main())
    assert seen == [subjects.stream_batch(seen[0].rsplit(".", 2)[0], worker_id)]
    for attempt, events in streams.items():
        assert events[0] == Accepted(
            request_id=f"r-{attempt}", worker_id=worker_id, numerics=events[0].numerics
        )
        assert [e.seq for e in events] == list(range(len(events)))
        assert all(e.request_id == f"r-{attempt}" for e in events)
        assert events[-1].usage.completion_tokens == 40
        assert sum(len(e.token_ids) for e in events[1:]) == 40
    assert messages < sum(len(e) for e in streams.values()) / 2
