"""The scheduler's wire contract on a real nats-server. The scheduler runs in this process;
the test plays its neighbours: workers (heartbeats on their stats subjects, requests
taken off their generate subjects) and a gateway (submits with a reply subject)."""

from __future__ import annotations

import asyncio
import secrets
import time

import msgspec
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lamina.libs import spans
from lamina.libs.bus import Bus, NatsConfig, encode
from lamina.libs.trace_context import extract
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import Cancel, ControlAck, Ping
from lamina.schemas.v1.generate import (
    GenerateRequest,
    Queued,
    Rejected,
    Sampling,
    Sla,
    StreamEvent,
)
from lamina.schemas.v1.records import PlacementRecord
from lamina.schemas.v1.stats import ClusterStatus, ClusterStatusRequest
from lamina.services.scheduler.service import SchedulerConfig, SchedulerService
from tests.telemetry.helpers import make_stats


def request(rid: str, prompt_len: int = 8) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model="tiny",
        prompt_token_ids=[7] * prompt_len,
        sampling=Sampling(max_tokens=4),
    )


class Harness:
    """Scheduler replicas, and a test client that heartbeats as ``worker`` and records what
    is forwarded to it and what comes back on the reply subject."""

    def __init__(
        self,
        nats_url: str,
        worker: str,
        replicas: int,
        config: dict[str, object] | None = None,
        **stats: object,
    ) -> None:
        self.nats_url, self.worker, self.stats = nats_url, worker, stats
        self.schedulers = [
            SchedulerService(
                SchedulerConfig(nats=NatsConfig(nats_url), scheduler_id=f"s{i}", **(config or {}))
            )
            for i in range(replicas)
        ]
        self.forwarded: asyncio.Queue[tuple[GenerateRequest, str]] = asyncio.Queue()
        self.replies: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.forward_headers: dict[str, dict[str, str]] = {}

    async def __aenter__(self) -> Harness:
        for scheduler in self.schedulers:
            await scheduler.start()
            await scheduler.bus.flush()  # its subscriptions are in place at the server
        self.bus = bus = await Bus.connect(self.nats_url, "test-neighbours")
        self.reply = bus.inbox()

        async def on_forward(forwarded: GenerateRequest, msg) -> None:
            self.forward_headers[forwarded.request_id] = msg.headers or {}
            self.forwarded.put_nowait((forwarded, msg.reply))

        async def on_reply(event: StreamEvent, _msg) -> None:
            self.replies.put_nowait(event)

        await bus.subscribe(subjects.worker_generate(self.worker), GenerateRequest, on_forward)
        await bus.subscribe(self.reply, StreamEvent, on_reply)
        await self.heartbeat()
        for scheduler in self.schedulers:  # every replica hears every heartbeat
            while self.worker not in scheduler.registry.view.workers:
                await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.bus.close()
        for scheduler in self.schedulers:
            await scheduler.close()

    async def heartbeat(self, **stats: object) -> None:
        beat = dict(num_running=0, num_waiting=0, timestamp_ms=int(time.time() * 1000))
        heartbeat = make_stats(self.worker, **(beat | self.stats | stats))
        await self.bus.publish(subjects.worker_stats(self.worker), heartbeat)

    async def submit(self, submitted: GenerateRequest, traceparent: str | None = None) -> None:
        """Submit as a gateway would, inside the caller's trace when given one."""
        context = extract({"traceparent": traceparent}) if traceparent else None
        await self.bus.publish(subjects.SCHED_SUBMIT, submitted, self.reply, context)


def test_a_submit_is_forwarded_to_the_worker_with_its_stream_subject(nats_url):
    """The worker streams on a subject of its own under the gateway's reply subject."""

    async def main() -> None:
        async with Harness(nats_url, "bus-sched-w", replicas=1) as h:
            await h.submit(request("r1"))
            forwarded, reply = await asyncio.wait_for(h.forwarded.get(), 5)
            assert reply == f"{h.reply}.bus-sched-w"
            assert forwarded.request_id == "r1" and forwarded.worker_id == "bus-sched-w"
            assert forwarded.prompt_token_ids == [7] * 8

    asyncio.run(main())


def test_replicas_form_a_queue_group_each_submit_is_placed_once(nats_url):
    async def main() -> None:
        async with Harness(nats_url, "bus-sched-q", replicas=2, max_num_seqs=64) as h:
            for i in range(20):
                await h.submit(request(f"q{i}"))
            ids = [(await asyncio.wait_for(h.forwarded.get(), 5))[0].request_id for _ in range(20)]
            # The barrier: each replica handles every submit it got and sends its forwards
            # before its drain returns, and the client's drain takes in all sent to it.
            for scheduler in h.schedulers:
                await scheduler.bus.drain()
            await h.bus.drain()
            assert sorted(ids) == sorted(f"q{i}" for i in range(20)) and h.forwarded.empty()

    asyncio.run(main())


def test_a_scheduler_hears_its_peers_placement_records_not_its_own(nats_url, monkeypatch):
    """Its own come back from the server only to be dropped (a wake-up each); a peer's
    tell it of load placed since the worker's heartbeat."""
    heard: list[PlacementRecord] = []
    on_peer_placement = SchedulerService._on_peer_placement

    async def hearing(self, record: PlacementRecord, msg) -> None:
        heard.append(record)
        await on_peer_placement(self, record, msg)

    monkeypatch.setattr(SchedulerService, "_on_peer_placement", hearing)

    async def main() -> None:
        async with Harness(nats_url, "bus-sched-echo", replicas=1) as h:
            (scheduler,) = h.schedulers
            records: asyncio.Queue[PlacementRecord] = asyncio.Queue()

            async def on_record(record: PlacementRecord, _msg) -> None:
                records.put_nowait(record)

            await h.bus.subscribe(subjects.EVENTS_PLACEMENT, PlacementRecord, on_record)
            await h.bus.flush()
            for i in range(5):
                await h.submit(request(f"e{i}"))
            for _ in range(5):
                await asyncio.wait_for(records.get(), 5)
            # Whatever the server sent the scheduler before answering this ping (an echo of
            # its records included) is queued for its subscriptions ahead of the peer's.
            await scheduler.bus.flush()
            assert scheduler.registry.candidates()[0].pending == 5
            peer = PlacementRecord(
                request_id="p1",
                worker_id="bus-sched-echo",
                reason="placed",
                candidates=1,
                scheduler_id="a-peer",
                prompt_tokens=40,
                timestamp_ms=int(time.time() * 1000) + 1,  # after the worker's heartbeat
            )
            await h.bus.publish(subjects.EVENTS_PLACEMENT, peer)
            deadline = time.monotonic() + 5
            while scheduler.registry.candidates()[0].pending == 5:
                assert time.monotonic() < deadline, "the peer's placement was not counted"
                await asyncio.sleep(0.01)
            assert [record.request_id for record in heard] == ["p1"]  # and none of its own

    asyncio.run(main())


def test_a_forward_over_max_payload_is_rejected_not_lost(nats_url):
    """The worker id the scheduler adds can push a submit that fit over the limit."""
    worker = "w" * 200

    async def main() -> None:
        async with Harness(nats_url, worker, replicas=1, max_model_len=10**7) as h:
            limit = h.bus.max_payload
            # ~150 bytes under the limit: room for the trace context headers, not for
            # the ~215 bytes of worker id the forward adds.
            n = (limit - len(encode(request("big", 0)))) // 2 - 75  # "7," per token
            submitted = request("big", n)
            assert limit - 200 < len(encode(submitted)) <= limit - 100
            await h.submit(submitted)
            rejected = await asyncio.wait_for(h.replies.get(), 5)
            assert isinstance(rejected, Rejected) and rejected.reason == "invalid_request"
            assert rejected.param == "prompt" and "max_payload" in rejected.message
            assert h.forwarded.empty()

    asyncio.run(main())


def sla_request(rid: str, priority: int = 0, deadline_in_ms: int | None = None) -> GenerateRequest:
    deadline = None if deadline_in_ms is None else int(time.time() * 1000) + deadline_in_ms
    return msgspec.structs.replace(request(rid), sla=Sla(priority=priority, deadline_ms=deadline))


async def next_reply(h: Harness) -> StreamEvent:
    return await asyncio.wait_for(h.replies.get(), 5)


def test_a_saturated_cluster_queues_by_priority_and_deadline_and_answers_at_once_when_full(
    nats_url,
):
    config = {"max_queue_requests": 3, "max_queue_wait": 1.0}
    # One worker whose waiting requests fill its max_num_seqs: saturated until it says not.
    busy = {"num_waiting": 8, "max_num_seqs": 8, "prefill_tokens_per_s": 20_000.0}

    async def main() -> None:
        async with Harness(nats_url, "bus-sched-sla", replicas=1, config=config, **busy) as h:
            await h.submit(sla_request("low", priority=5))
            await h.submit(sla_request("late", priority=1, deadline_in_ms=60_000))
            await h.submit(sla_request("soon", priority=1, deadline_in_ms=30_000))
            queued = [await next_reply(h) for _ in range(3)]
            assert [type(e) for e in queued] == [Queued] * 3
            assert [e.position for e in queued] == [0, 0, 0]  # each was the head when queued
            # The queue holds three: a fourth is refused at once, with when to retry.
            await h.submit(sla_request("extra"))
            full = await next_reply(h)
            assert isinstance(full, Rejected) and full.reason == "overloaded" and full.retryable
            assert full.retry_after_s >= 1
            # A client that hangs up leaves the queue.
            await h.bus.publish(subjects.SCHED_CANCEL, Cancel(request_id="late"))
            await h.bus.flush()
            # A heartbeat with room lets the queue drain: priority first, then deadline.
            await h.heartbeat(**(busy | {"num_waiting": 0}))
            order = [(await asyncio.wait_for(h.forwarded.get(), 5))[0].request_id for _ in "ab"]
            assert order == ["soon", "low"]
            # A request whose deadline passes while queued is told so, and not retried.
            await h.heartbeat(**busy)
            await h.submit(sla_request("expiring", deadline_in_ms=800))
            assert isinstance(await next_reply(h), Queued)
            expired = await next_reply(h)
            assert isinstance(expired, Rejected) and expired.reason == "deadline_exceeded"
            assert not expired.retryable
            # One that cannot be served before its deadline is refused at once.
            await h.submit(sla_request("hopeless", deadline_in_ms=-1))
            hopeless = await next_reply(h)
            assert isinstance(hopeless, Rejected) and hopeless.reason == "deadline_unmeetable"

    asyncio.run(main())


def test_a_queued_request_is_sent_on_in_its_own_trace(nats_url, monkeypatch):
    """Dispatched later, from a heartbeat's handler, a queued request still carries the
    trace it arrived in: the worker's span joins that trace, not none or another's. Its
    placement is told where it happened: the refusal that queued it on the submit's span,
    the placement that sent it on in a ``place`` span of that trace."""
    busy = {"num_waiting": 8, "max_num_seqs": 8, "prefill_tokens_per_s": 20_000.0}
    traces = {"a": secrets.token_hex(16), "b": secrets.token_hex(16)}
    exporter = InMemorySpanExporter()
    provider = spans.RecordingProvider()  # as the services record spans
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)

    async def main() -> None:
        async with Harness(nats_url, "bus-sched-trace", replicas=1, **busy) as h:
            for rid, trace_id in traces.items():
                await h.submit(request(rid), f"00-{trace_id}-{secrets.token_hex(8)}-01")
                assert isinstance(await next_reply(h), Queued)
            await h.heartbeat(**(busy | {"num_waiting": 0}))  # room: the queue drains
            for _ in traces:
                await asyncio.wait_for(h.forwarded.get(), 5)
            for rid, trace_id in traces.items():
                assert h.forward_headers[rid]["traceparent"].split("-")[1] == trace_id

    asyncio.run(main())
    spans.flush()
    recorded = exporter.get_finished_spans()
    for rid, trace_id in traces.items():
        in_trace = [s for s in recorded if f"{s.context.trace_id:032x}" == trace_id]
        (submit,) = [s for s in in_trace if s.name == "lamina.v1.sched.submit process"]
        places = sorted((s for s in in_trace if s.name == "place"), key=lambda s: s.end_time)
        # Each try from the queue is a place span; the last sent it on.
        assert places[-1].attributes["lamina.placement.reason"] == "placed"
        assert places[-1].attributes["lamina.placement.worker_id"] == "bus-sched-trace"
        assert all(p.attributes["lamina.placement.reason"] == "overloaded" for p in places[:-1])
        if rid == "a":  # it found the queue empty: placed as it arrived, and refused
            assert submit.attributes["lamina.placement.reason"] == "overloaded"
        else:  # it queued behind a without a placement of its own
            assert "lamina.placement.reason" not in submit.attributes


def test_a_scheduler_that_shuts_down_hands_its_queue_back_as_retryable(nats_url):
    busy = {"num_waiting": 8, "max_num_seqs": 8}

    async def main() -> None:
        async with Harness(nats_url, "bus-sched-drain", replicas=1, **busy) as h:
            await h.submit(sla_request("waiting"))
            assert isinstance(await next_reply(h), Queued)
            await h.schedulers[0].drain()
            handed_back = await next_reply(h)
            assert isinstance(handed_back, Rejected) and handed_back.reason == "draining"
            assert handed_back.retryable and not h.schedulers[0].queue

    asyncio.run(main())


def test_a_heartbeat_out_of_bounds_is_not_believed(nats_url):
    """A forged heartbeat (negative queued tokens, so its load would always win; or a
    negative interval, which made every worker look dead) does not decode: dropped. One
    for a worker other than its subject names is dropped too."""

    async def main() -> None:
        async with Harness(nats_url, "bus-sched-real", replicas=1) as h:
            registry = h.schedulers[0].registry
            for forged in (
                {"num_queued_prefill_tokens": -(10**9)},
                {"heartbeat_interval_s": -1.0},
                {"kv_cache_usage": 7.0},
            ):
                stats = make_stats("bus-sched-forged", **forged)
                await h.bus.publish(subjects.worker_stats("bus-sched-forged"), stats)
            # Well-formed, but on another worker's subject: one worker posing as another.
            posing = make_stats("bus-sched-forged", num_queued_prefill_tokens=0)
            await h.bus.publish(subjects.worker_stats("bus-sched-late"), posing)
            # The barrier: a good heartbeat sent after them has been handled.
            await h.bus.publish(
                subjects.worker_stats("bus-sched-late"), make_stats("bus-sched-late")
            )
            while "bus-sched-late" not in registry.view.workers:
                await asyncio.sleep(0.01)
            assert "bus-sched-forged" not in registry.view.workers
            assert registry.view.workers["bus-sched-real"].stats.heartbeat_interval_s > 0

    asyncio.run(main())


def test_a_worker_that_did_not_see_a_request_through_is_skipped_until_it_answers_a_ping(
    nats_url,
):
    """A forged heartbeat's worker (here: the test's, which answers nothing) draws one
    request at most: its resubmission takes the worker out of placement, and it comes
    back only once it answers a ping."""

    async def main() -> None:
        async with Harness(nats_url, "bus-sched-ghost", replicas=1) as h:

            async def quarantined() -> list[bool]:
                status = await h.bus.request(
                    subjects.SCHED_STATUS, ClusterStatusRequest(), ClusterStatus
                )
                return [w.quarantined for w in status.workers]

            await h.submit(request("first"))
            forwarded, _ = await asyncio.wait_for(h.forwarded.get(), 5)
            assert forwarded.request_id == "first"
            # The gateway resubmits it (the ghost never accepted): the ghost is skipped.
            await h.submit(msgspec.structs.replace(request("first"), attempt=1))
            refused = await next_reply(h)
            assert isinstance(refused, Rejected) and refused.reason == "no_worker"
            assert "held back until they answer a ping: bus-sched-ghost" in refused.message
            assert await quarantined() == [True]  # and an operator's status shows why

            async def answer(ping: Ping, msg) -> None:
                ack = ControlAck(worker_id="bus-sched-ghost", ok=True, state="ready")
                await h.bus.reply(msg, ack)

            await h.bus.subscribe(subjects.worker_control("bus-sched-ghost"), Ping, answer)
            await h.bus.flush()
            await h.heartbeat()  # its next heartbeat pings it again; now it answers
            while await quarantined() != [False]:
                await asyncio.sleep(0.01)
            await h.submit(request("second"))
            forwarded, _ = await asyncio.wait_for(h.forwarded.get(), 5)
            assert forwarded.request_id == "second"

    asyncio.run(main())
