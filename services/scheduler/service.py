"""The scheduler service: registry from heartbeats, the cluster prefix index from KV
events, admission, placement, forwarding.

Runs in the ``scheduler`` queue group on ``sched.submit`` (replicas share the load), while
every replica hears every heartbeat, every worker's KV events and every other replica's
placement records (counted as pending until the worker's next heartbeat). A placed
request is forwarded to the worker with its stream subject under the gateway's reply
subject (``subjects.worker_stream``: only that worker may publish there), so tokens flow
worker → gateway directly; a rejected one gets a typed ``Rejected`` on that inbox.
A worker whose KV events have a gap, or that this replica has not synced yet (it started
late, or the worker restarted), is asked for a snapshot on ``worker.<id>.kv.sync``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field

import msgspec
from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link

from lamina.libs import spans
from lamina.libs.block_hash import hash_blocks
from lamina.libs.bounded import BoundedDict
from lamina.libs.bus import Bus, NatsConfig
from lamina.libs.config import option
from lamina.libs.errors import BadReply, BusError, NoResponders, PayloadTooLarge, RequestTimeout
from lamina.libs.health import HealthServer
from lamina.libs.service import announce
from lamina.libs.trace_context import sampled_context
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import Cancel, ControlAck, Ping
from lamina.schemas.v1.generate import GenerateRequest, Queued, Rejected, RejectReason
from lamina.schemas.v1.kv import KvEventBatch, KvSnapshot, KvSyncRequest
from lamina.schemas.v1.kv_transfer import KvGrant, KvSource
from lamina.schemas.v1.records import PLACED, QUEUED, PlacementRecord
from lamina.schemas.v1.stats import (
    ClusterStatus,
    ClusterStatusRequest,
    WorkerState,
    WorkerStats,
    WorkerView,
)
from lamina.services.scheduler.admission_queue import AdmissionQueue
from lamina.services.scheduler.placement import (
    CostModel,
    Decision,
    Placer,
    Policy,
    drain_time,
    retry_after,
)
from lamina.services.scheduler.registry import Candidate, Registry

log = logging.getLogger("lamina.scheduler")
tracer = spans.Tracer("lamina.scheduler")

MAX_TRACKED_PLACEMENTS = 10_000
"""Recent placements remembered, to know which worker a resubmission comes back from."""

EXPIRY_TICK_S = 0.05
"""How often queued requests are checked against their deadlines."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler: worker registry, admission and placement."""

    nats: NatsConfig = field(default_factory=NatsConfig)
    scheduler_id: str = option("", "replica id (default: <host>-<pid>)")
    placement: Policy = option(
        Policy.KV, "placement policy: kv (predicted TTFT), load, round-robin"
    )
    prefill_rate_prior: float = option(
        CostModel.prefill_rate_prior, "prefill tokens/s assumed before a worker measured its own"
    )
    decode_rate_prior: float = option(
        CostModel.decode_rate_prior, "decode tokens/s assumed before a worker measured its own"
    )
    decode_weight: float = option(
        CostModel.decode_weight, "weight of running decodes in the predicted TTFT (kv policy)"
    )
    sync_timeout: float = option(5.0, "seconds to wait for a worker's KV snapshot")
    saturation_steps: float = option(
        4.0, "queue requests when every worker has more than this many steps of prefill queued"
    )
    prefill_min_tokens: int = option(
        Placer.prefill_min_tokens,
        "a decode worker (--role decode) computes a prompt itself when fewer of its tokens "
        "are uncached there; from this many, a prefill worker with room computes it",
    )
    max_queue_requests: int = option(1024, "most requests waiting in this replica's queue")
    max_queue_tokens: int = option(1 << 20, "most prompt tokens waiting in its queue")
    max_queue_wait: float = option(30.0, "seconds a request may wait in the queue")
    health_host: str = option("0.0.0.0", "address /health and /ready are served on")
    health_port: int = option(0, "port for /health and /ready (ready: on the bus; 0: off)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", Policy(self.placement))  # ValueError names it


class SchedulerService:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.scheduler_id = config.scheduler_id or f"{socket.gethostname()}-{os.getpid()}"
        self.placer_id = f"{self.scheduler_id}/{secrets.token_hex(4)}"
        """This process's placements' ``placed_by``: unique to it, so a restart under the
        same id counts from 1 without seeming already received."""
        self._placement_seq = 0
        self.registry = Registry(prefill_rate_prior=config.prefill_rate_prior)
        cost = CostModel(config.prefill_rate_prior, config.decode_rate_prior, config.decode_weight)
        self.placer = Placer(
            config.placement,
            cost,
            config.saturation_steps,
            prefill_min_tokens=config.prefill_min_tokens,
        )
        self.queue = AdmissionQueue(config.max_queue_requests, config.max_queue_tokens)
        self._tasks: list[asyncio.Task] = []
        self.bus: Bus | None = None
        self._syncing: dict[str, asyncio.Task] = {}
        self._placed_on: BoundedDict[str, str] = BoundedDict(MAX_TRACKED_PLACEMENTS)
        """Request id -> the worker it was sent to."""
        self._pinging: set[str] = set()
        self._heartbeat_spans: dict[str, trace.SpanContext] = {}
        """Each worker's last traced heartbeat (what a placement span links to)."""
        self._kv_spans: dict[str, trace.SpanContext] = {}
        """Each worker's last traced KV event batch, in the prefix index (linked too)."""
        self.health: HealthServer | None = None
        self._subscribed = False

    def ready(self) -> bool:
        """Subscribed and on the bus: submits reach this replica (the readiness probe)."""
        return self._subscribed and self.bus is not None and self.bus.nc.is_connected

    async def start(self) -> None:
        cfg = self.config
        if cfg.health_port:
            self.health = await HealthServer(cfg.health_host, cfg.health_port, self.ready).start()
        # Not its own placement records back (it subscribes to its peers'): each would cost
        # it a wake-up and a decode, only to be dropped.
        self.bus = bus = await self.config.nats.connect(
            f"scheduler-{self.scheduler_id}", no_echo=True
        )
        bus.on_reconnect.append(self._resync_all)
        await bus.subscribe(subjects.WORKER_STATS_ALL, WorkerStats, self._on_stats, traced=False)
        await bus.subscribe(subjects.WORKER_KV_ALL, KvEventBatch, self._on_kv, traced=False)
        await bus.subscribe(
            subjects.EVENTS_PLACEMENT, PlacementRecord, self._on_peer_placement, traced=False
        )
        await bus.subscribe(
            subjects.SCHED_SUBMIT, GenerateRequest, self._on_submit, queue="scheduler"
        )
        await bus.subscribe(subjects.SCHED_STATUS, ClusterStatusRequest, self._on_status)
        await bus.subscribe(subjects.SCHED_CANCEL, Cancel, self._on_cancel)
        self._tasks.append(asyncio.create_task(self._expire()))
        await bus.flush()  # the server has the subscriptions before it says it is ready
        self._subscribed = True
        await announce(bus, "scheduler", self.scheduler_id)

    async def _on_stats(self, stats: WorkerStats, msg: Msg) -> None:
        if stats.worker_id != subjects.sender_worker(msg.subject):
            self.bus.refused += 1  # one worker posing as another
            return
        _remember_span(msg, stats.worker_id, self._heartbeat_spans)
        if self.registry.heartbeat(stats) and stats.state == WorkerState.READY:
            self._sync(stats.worker_id)
        if stats.worker_id in self.registry.quarantined:
            self._ping(stats.worker_id)
        if self.queue:  # the heartbeat may show room
            await self._dispatch()

    async def _on_kv(self, batch: KvEventBatch, msg: Msg) -> None:
        if batch.worker_id != subjects.sender_worker(msg.subject):
            self.bus.refused += 1
            return
        if not self.registry.kv_events(batch):
            self._sync(batch.worker_id)
        else:
            _remember_span(msg, batch.worker_id, self._kv_spans)

    async def _on_peer_placement(self, record: PlacementRecord, msg: Msg) -> None:
        if record.scheduler_id != self.scheduler_id and record.worker_id is not None:
            self.registry.placed_by_peer(record)

    async def _resync_all(self) -> None:
        """After a reconnect, KV events may have been missed without a gap showing yet (an
        idle worker sends none): every worker's entries are distrusted, and each is asked
        for a snapshot at its next heartbeat (which also shows it is back on the bus)."""
        for worker_id in list(self.registry.index.workers):
            self.registry.index.desync(worker_id)

    def _sync(self, worker_id: str) -> None:
        """Ask ``worker_id`` for its KV snapshot, once at a time per worker."""
        if worker_id not in self._syncing:
            task = asyncio.get_running_loop().create_task(self._fetch_snapshot(worker_id))
            self._syncing[worker_id] = task
            task.add_done_callback(lambda _: self._syncing.pop(worker_id, None))

    async def _fetch_snapshot(self, worker_id: str) -> None:
        subject, timeout = subjects.worker_kv_sync(worker_id), self.config.sync_timeout
        try:
            parts = await self.bus.request_many(
                subject, KvSyncRequest(), KvSnapshot, lambda part: part.last, timeout
            )
        except NoResponders:  # it does not answer kv.sync (yet): its events alone count
            log.warning("%s does not answer KV syncs; its index entries may be stale", worker_id)
            self.registry.assume_synced(worker_id)
            return
        except (RequestTimeout, BadReply) as exc:
            log.warning("no KV snapshot from %s: %s", worker_id, exc)
            return
        self.registry.restore(parts)
        log.info(
            "KV index synced with %s: %d blocks as of event %d",
            worker_id,
            sum(len(p.block_hashes) for p in parts),
            parts[0].next_event_id,
        )

    def _suspect(self, request: GenerateRequest) -> None:
        """A resubmission: the worker the last attempt went to did not see it through (it
        did not accept in time, could not be reached, or was lost). It gets nothing new
        until it answers a ping."""
        worker_id = self._placed_on.pop(request.request_id, None)
        if worker_id is not None and worker_id not in self.registry.quarantined:
            log.warning(
                "%s did not see request %s through; pinging it", worker_id, request.request_id
            )
            self.registry.quarantined.add(worker_id)
            self._ping(worker_id)

    def _ping(self, worker_id: str) -> None:
        if worker_id in self._pinging:
            return
        self._pinging.add(worker_id)
        task = asyncio.get_running_loop().create_task(self._ping_once(worker_id))
        self._tasks.append(task)
        task.add_done_callback(lambda t: (self._pinging.discard(worker_id), self._tasks.remove(t)))

    async def _ping_once(self, worker_id: str) -> None:
        try:
            await self.bus.request(subjects.worker_control(worker_id), Ping(), ControlAck, 1.0)
        except BusError:
            return  # still quarantined; its next heartbeat pings again
        self.registry.quarantined.discard(worker_id)
        log.info("%s answered its ping: placing on it again", worker_id)

    async def _on_submit(self, request: GenerateRequest, msg: Msg) -> None:
        if not msg.reply:
            log.warning("submit %s has no reply subject; dropped", request.request_id)
            return
        if request.attempt:
            self._suspect(request)
        if self.queue:  # others are waiting: this one takes its turn among them
            await self._enqueue(request, msg.reply)
            await self._dispatch()
            return
        decision = self._decide(request)
        if decision.reason == RejectReason.OVERLOADED:
            await self._enqueue(request, msg.reply)
        else:
            await self._send(request, msg.reply, decision)

    def _decide(self, request: GenerateRequest) -> Decision:
        """Where ``request`` goes now, or why not. A traced request's placement is told in
        a span: each candidate's score inputs, and links to what they came from (each
        worker's last traced heartbeat and last traced KV event batch). Placed as it
        arrives, that span is the submit's CONSUMER span, still open (one span fewer on the
        request's path); placed later, from the queue, a ``place`` span of its own."""
        started, started_ns = time.perf_counter(), time.time_ns()
        live = self.registry.candidates()
        decision = self._timed(self._place(request, live), started)
        if not spans.sampled():
            return decision  # an untraced request
        attributes = _placement_attributes(decision, self.placer.policy)
        links = [
            Link(context, {"lamina.link": kind, "lamina.worker_id": worker_id})
            for kind, seen in (("heartbeat", self._heartbeat_spans), ("kv_events", self._kv_spans))
            for worker_id in (c.stats.worker_id for c in live)
            if (context := seen.get(worker_id)) is not None
        ]
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes(attributes)
            for link in links:
                span.add_link(link.context, link.attributes)
        else:
            place = spans.start(
                tracer, "place", attributes=attributes, links=links, start_time=started_ns
            )
            place.end()
        return decision

    @staticmethod
    def _timed(decision: Decision, started: float) -> Decision:
        return dataclasses.replace(decision, decision_s=time.perf_counter() - started)

    def _place(self, request: GenerateRequest, live: list[Candidate]) -> Decision:
        """Where ``request`` goes now among ``live``, or why not; a deadline the chosen
        worker cannot meet by the prediction is a refusal."""
        # A held-back worker (one a moved request left) may still send its blocks: a failed
        # fetch costs the receiver only the compute it would have done anyway.
        senders = [Candidate(entry.stats) for entry in self.registry.view.live()]
        decision = self.placer.place(request, live, self.registry.index.overlap_by_medium, senders)
        if decision.reason == RejectReason.NO_WORKER and (held := self._held_back()):
            # With every live worker held back, admission saw none "alive": say which.
            said = decision.message if live else "no other engine worker is alive"
            message = f"{said}; held back until they answer a ping: {held}"
            decision = dataclasses.replace(decision, message=message)
        deadline = request.sla.deadline_ms
        if decision.worker_id is not None and deadline is not None:
            eta_ms = time.time() * 1000 + (decision.predicted_ttft_s or 0.0) * 1000
            if eta_ms > deadline:
                return self._refusal(
                    decision,
                    RejectReason.DEADLINE_UNMEETABLE,
                    f"the earliest predicted first token is {eta_ms - deadline:.0f} ms past "
                    "the request's deadline",
                )
        return decision

    def _held_back(self) -> str:
        """The live workers left out of placement because a request placed there was
        lost (comma-separated; empty when none)."""
        live = {entry.stats.worker_id for entry in self.registry.view.live()}
        return ", ".join(sorted(self.registry.quarantined & live))

    def _refusal(self, decision: Decision, reason: RejectReason, message: str) -> Decision:
        """A retryable refusal that says when to retry."""
        wait = retry_after(self._drain_time(self.registry.candidates()))
        return Decision(None, reason, message, decision.candidates, retry_after_s=wait)

    def _drain_time(self, live: list[Candidate]) -> float:
        """Seconds until the cluster has worked off its backlog (every worker's queued
        prefill and this queue) at the prefill rates its workers measured."""
        return drain_time(live, self.queue.tokens, self.placer.cost.prefill_rate_prior)

    async def _enqueue(self, request: GenerateRequest, reply: str) -> None:
        """Queue ``request`` (telling its client), or refuse it when the queue is full or
        its deadline cannot be met after the work ahead of it."""
        live = self.registry.candidates()
        drain = self._drain_time(live)
        wait = drain + self.placer.earliest_ttft(
            request, live, self.registry.index.overlap_by_medium
        )
        deadline = request.sla.deadline_ms
        if deadline is not None and time.time() * 1000 + wait * 1000 > deadline:
            message = f"the work ahead of it takes ~{wait:.2f}s, past its deadline"
            decision = Decision(
                None, RejectReason.DEADLINE_UNMEETABLE, message, 0, retry_after_s=retry_after(drain)
            )
        elif not self.queue.push(
            request, reply, time.monotonic(), int(time.time() * 1000), otel_context.get_current()
        ):
            message = (
                f"every worker is saturated and the queue is full ({len(self.queue)} "
                f"requests, {self.queue.tokens} prompt tokens)"
            )
            decision = Decision(
                None, RejectReason.OVERLOADED, message, 0, retry_after_s=retry_after(drain)
            )
        else:
            position = self.queue.position(request.request_id)
            queued = Queued(
                request_id=request.request_id,
                position=position,
                max_wait_s=self.config.max_queue_wait,
            )
            await self.bus.publish(reply, queued)
            await self._record(request, Decision(None, None, "", 0), QUEUED)
            return
        await self._send(request, reply, decision)

    async def _dispatch(self) -> None:
        """Send queued requests, head first, while a worker has room for them."""
        while (waiting := self.queue.peek()) is not None:
            with spans.within(waiting.context):  # its own trace, not the caller's
                decision = self._decide(waiting.request)
                if decision.reason == RejectReason.OVERLOADED:
                    return  # still no room: it keeps its place
                self.queue.pop()
                await self._send(waiting.request, waiting.reply, decision, waiting.queued_at)

    async def _expire(self) -> None:
        """Answer queued requests whose deadline passed, or that waited too long."""
        while True:
            await asyncio.sleep(EXPIRY_TICK_S)
            now_ms = int(time.time() * 1000)
            expired = self.queue.expired(now_ms, time.monotonic(), self.config.max_queue_wait)
            for waiting in expired:
                deadline = waiting.request.sla.deadline_ms
                if deadline is not None and deadline <= now_ms:
                    message = "the deadline passed while queued"
                    decision = Decision(
                        None, RejectReason.DEADLINE_EXCEEDED, message, 0, retryable=False
                    )
                else:
                    wait = self.config.max_queue_wait
                    message = f"no worker had room within {wait:g}s while queued"
                    decision = self._refusal(
                        Decision(None, None, "", 0), RejectReason.OVERLOADED, message
                    )
                with spans.within(waiting.context):
                    await self._send(waiting.request, waiting.reply, decision, waiting.queued_at)

    async def _on_cancel(self, cancel: Cancel, msg: Msg) -> None:
        if self.queue.remove(cancel.request_id) is not None:
            log.info("request %s left the queue (cancelled)", cancel.request_id)

    async def _grant(self, request: GenerateRequest, decision: Decision) -> KvSource | None:
        """Authorise the transfer ``decision`` chose, if any: a one-time grant to its
        sender, and the source (with the same token) for the receiving worker."""
        sender = self.registry.view.workers.get(decision.fetch_from)
        if sender is None or not decision.fetch_blocks:
            return None
        block_size = sender.stats.block_size
        hashes = hash_blocks(request.prompt_token_ids, block_size)
        tokens = decision.fetch_blocks * block_size
        grant = KvGrant(
            grant_id=secrets.token_hex(16),
            token=secrets.token_hex(32),
            receiver=decision.worker_id or "",
            block_hashes=hashes[: decision.fetch_blocks],
            prefill_token_ids=request.prompt_token_ids[:tokens] if decision.prefill else [],
        )
        await self.bus.publish(subjects.worker_kv_send(decision.fetch_from), grant)
        return KvSource(
            worker_id=decision.fetch_from,
            address=sender.stats.kv_address,
            grant_id=grant.grant_id,
            token=grant.token,
            block_hashes=grant.block_hashes,
            prefill=decision.prefill,
        )

    async def _send(
        self,
        request: GenerateRequest,
        reply: str,
        decision: Decision,
        queued_at: float | None = None,
    ) -> None:
        """Forward ``request`` to the chosen worker, or answer its refusal; then record
        (``queued_at``: when it entered the queue, if it comes from there)."""
        if decision.worker_id is None:
            await self.bus.publish(
                reply,
                Rejected(
                    request_id=request.request_id,
                    reason=decision.reason,
                    message=decision.message,
                    retryable=decision.retryable,
                    retry_after_s=decision.retry_after_s,
                ),
            )
        else:
            kv_source = await self._grant(request, decision)  # never the gateway's
            # Numbered with no await before the publish: the numbers go out in order.
            self._placement_seq += 1
            request = msgspec.structs.replace(
                request,
                worker_id=decision.worker_id,
                kv_source=kv_source,
                placed_by=self.placer_id,
                placement_seq=self._placement_seq,
            )
            try:
                await self.bus.publish(  # the worker's span is this one's child
                    subjects.worker_generate(decision.worker_id),
                    request,
                    subjects.worker_stream(reply, decision.worker_id),
                    traced=False,
                )
            except PayloadTooLarge as exc:  # the worker id pushed it over the limit
                message = f"the request is too large to forward: {exc}"
                decision = Decision(
                    None, RejectReason.INVALID_REQUEST, message, decision.candidates
                )
                await self.bus.publish(
                    reply,
                    Rejected(
                        request_id=request.request_id,
                        reason=decision.reason,
                        message=message,
                        param="prompt",
                    ),
                )
            else:
                worker = self.registry.view.workers[decision.worker_id]
                block_size = worker.stats.block_size
                uncached = self.placer.cost.uncached_tokens(
                    len(request.prompt_token_ids),
                    max(decision.prefix_hit_blocks, decision.fetch_blocks),
                    block_size,
                )
                self.registry.placed(
                    decision.worker_id, uncached, self.placer_id, request.placement_seq
                )
                if decision.prefill:  # its prefill leg's tokens are queued there
                    self.registry.placed(decision.fetch_from, decision.fetch_blocks * block_size)
                self._placed_on[request.request_id] = decision.worker_id
        # The record is for telemetry: off the request's critical path. Yielding once lets
        # the client's flusher task put the forward on the wire before the record is built.
        await asyncio.sleep(0)
        queued_s = None if queued_at is None else time.monotonic() - queued_at
        await self._record(request, decision, decision.reason or PLACED, queued_s)

    async def _record(
        self,
        request: GenerateRequest,
        decision: Decision,
        reason: str,
        queued_s: float | None = None,
    ) -> None:
        await self.bus.publish(
            subjects.EVENTS_PLACEMENT,
            PlacementRecord(
                request_id=request.request_id,
                worker_id=decision.worker_id,
                reason=reason,
                candidates=decision.candidates,
                score=decision.score,
                prefix_hit_blocks=decision.prefix_hit_blocks,
                attempt=request.attempt,
                scheduler_id=self.scheduler_id,
                policy=self.placer.policy,
                prompt_tokens=len(request.prompt_token_ids),
                predicted_ttft_s=decision.predicted_ttft_s,
                scored=decision.scored,
                timestamp_ms=int(time.time() * 1000),
                decision_s=decision.decision_s,
                queued_s=queued_s,
                queue_depth=len(self.queue),
                placed_by=request.placed_by or "",
                placement_seq=request.placement_seq,
            ),
            traced=False,  # a record for telemetry and the other replicas, not a hop
        )

    async def _on_status(self, _: ClusterStatusRequest, msg: Msg) -> None:
        views = [
            WorkerView(
                stats=e.stats,
                alive=alive,
                last_seen_ms=e.last_seen_ms,
                quarantined=e.stats.worker_id in self.registry.quarantined,
            )
            for e, alive in self.registry.view.snapshot()
        ]
        status = ClusterStatus(
            scheduler_id=self.scheduler_id,
            workers=views,
            queued=len(self.queue),
            queued_tokens=self.queue.tokens,
        )
        await self.bus.reply(msg, status)

    async def drain(self) -> None:
        """Hand back what waits in the queue (retryable: the gateway resubmits it, and
        another replica takes it); in-flight requests live on workers and gateways."""
        while (waiting := self.queue.peek()) is not None:
            self.queue.pop()
            message = f"scheduler {self.scheduler_id} is shutting down"
            await self._send(
                waiting.request, waiting.reply, Decision(None, RejectReason.DRAINING, message, 0)
            )

    async def close(self) -> None:
        if self.health is not None:
            await self.health.stop()
        for task in [*self._syncing.values(), *self._tasks]:
            task.cancel()
        if self.bus is not None:
            await self.bus.drain()


def _remember_span(msg: Msg, worker_id: str, spans: dict[str, trace.SpanContext]) -> None:
    """Keep the span a traced (sampled) message came under, for placements to link to."""
    if (context := sampled_context(msg.headers)) is not None:
        spans[worker_id] = context


def _placement_attributes(decision: Decision, policy: str) -> dict:
    """A placement span's attributes: the choice, and every candidate's score inputs."""
    scored = decision.scored
    attributes = {
        "lamina.placement.policy": policy,
        "lamina.placement.candidates": decision.candidates,
        "lamina.placement.reason": str(decision.reason or "placed"),
        "lamina.placement.prefix_hit_blocks": decision.prefix_hit_blocks,
        "lamina.candidate.worker_id": [w.worker_id for w in scored],
        "lamina.candidate.overlap_blocks": [w.overlap_blocks for w in scored],
        "lamina.candidate.predicted_ttft_s": [w.predicted_ttft_s for w in scored],
        "lamina.candidate.kv_usage": [w.kv_usage for w in scored],
        "lamina.candidate.num_running": [w.num_running for w in scored],
    }
    if decision.worker_id is not None:
        attributes["lamina.placement.worker_id"] = decision.worker_id
    if decision.predicted_ttft_s is not None:
        attributes["lamina.placement.predicted_ttft_s"] = decision.predicted_ttft_s
    if decision.fetch_from:  # the worker its leading blocks come from, and why
        leg = "prefill_worker_id" if decision.prefill else "fetch_from"
        attributes[f"lamina.placement.{leg}"] = decision.fetch_from
        attributes["lamina.placement.fetch_blocks"] = decision.fetch_blocks
    return attributes
