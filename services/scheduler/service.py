"""The scheduler service: registry from heartbeats, the cluster prefix index from KV
events, admission, placement, forwarding.

Runs in the ``scheduler`` queue group on ``sched.submit`` (replicas share the load), while
every replica hears every heartbeat, every worker's KV events and every other replica's
placement records (counted as pending until the worker's next heartbeat). A placed
request is forwarded to the worker with the gateway's reply inbox unchanged, so tokens
flow worker → gateway directly; a rejected one gets a typed ``Rejected`` on that inbox.
A worker whose KV events have a gap, or that this replica has not synced yet (it started
late, or the worker restarted), is asked for a snapshot on ``worker.<id>.kv.sync``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass

import msgspec
from nats.aio.msg import Msg

from lamina.libs.bus import Bus
from lamina.libs.config import option
from lamina.libs.errors import PayloadTooLarge
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.generate import GenerateRequest, Rejected, RejectReason
from lamina.schemas.v1.kv import KvEventBatch, KvSnapshot, KvSyncRequest
from lamina.schemas.v1.records import PLACED, PlacementRecord
from lamina.schemas.v1.stats import (
    ClusterStatus,
    ClusterStatusRequest,
    WorkerState,
    WorkerStats,
    WorkerView,
)
from lamina.services.scheduler.placement import CostModel, Decision, Placer, Policy
from lamina.services.scheduler.registry import Registry

log = logging.getLogger("lamina.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler: worker registry, admission and placement."""

    nats_url: str = option("nats://127.0.0.1:4222", "NATS server URL")
    scheduler_id: str = option("", "replica id (default: <host>-<pid>)")
    placement: str = option("kv", "placement policy: kv (predicted TTFT), load, round-robin")
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

    def __post_init__(self) -> None:
        Policy(self.placement)  # a ValueError naming the value


class SchedulerService:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.scheduler_id = config.scheduler_id or f"{socket.gethostname()}-{os.getpid()}"
        self.registry = Registry()
        cost = CostModel(config.prefill_rate_prior, config.decode_rate_prior, config.decode_weight)
        self.placer = Placer(Policy(config.placement), cost)
        self.bus: Bus | None = None
        self._syncing: dict[str, asyncio.Task] = {}

    async def start(self) -> None:
        self.bus = bus = await Bus.connect(self.config.nats_url, f"scheduler-{self.scheduler_id}")
        await bus.subscribe(subjects.WORKER_STATS_ALL, WorkerStats, self._on_stats, traced=False)
        await bus.subscribe(subjects.WORKER_KV_ALL, KvEventBatch, self._on_kv, traced=False)
        await bus.subscribe(subjects.EVENTS_PLACEMENT, PlacementRecord, self._on_peer_placement)
        await bus.subscribe(
            subjects.SCHED_SUBMIT, GenerateRequest, self._on_submit, queue="scheduler"
        )
        await bus.subscribe(subjects.SCHED_STATUS, ClusterStatusRequest, self._on_status)

    async def _on_stats(self, stats: WorkerStats, msg: Msg) -> None:
        if self.registry.heartbeat(stats) and stats.state == WorkerState.READY:
            self._sync(stats.worker_id)

    async def _on_kv(self, batch: KvEventBatch, msg: Msg) -> None:
        if not self.registry.kv_events(batch):
            self._sync(batch.worker_id)

    async def _on_peer_placement(self, record: PlacementRecord, msg: Msg) -> None:
        if record.scheduler_id != self.scheduler_id and record.worker_id is not None:
            self.registry.placed_by_peer(record)

    def _sync(self, worker_id: str) -> None:
        """Ask ``worker_id`` for its KV snapshot, once at a time per worker."""
        if worker_id not in self._syncing:
            task = asyncio.get_running_loop().create_task(self._fetch_snapshot(worker_id))
            self._syncing[worker_id] = task
            task.add_done_callback(lambda _: self._syncing.pop(worker_id, None))

    async def _fetch_snapshot(self, worker_id: str) -> None:
        parts: asyncio.Queue[KvSnapshot] = asyncio.Queue()
        inbox = self.bus.inbox()

        async def on_part(part: KvSnapshot, _msg: Msg) -> None:
            parts.put_nowait(part)

        subscription = await self.bus.subscribe(inbox, KvSnapshot, on_part, traced=False)
        try:
            await self.bus.publish(subjects.worker_kv_sync(worker_id), KvSyncRequest(), reply=inbox)
            received: list[KvSnapshot] = []
            async with asyncio.timeout(self.config.sync_timeout):
                while not received or not received[-1].last:
                    received.append(await parts.get())
            self.registry.restore(received)
            log.info(
                "KV index synced with %s: %d blocks as of event %d",
                worker_id,
                sum(len(p.block_hashes) for p in received),
                received[0].next_event_id,
            )
        except TimeoutError:
            log.warning("no KV snapshot from %s within %gs", worker_id, self.config.sync_timeout)
        finally:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()

    async def _on_submit(self, request: GenerateRequest, msg: Msg) -> None:
        if not msg.reply:
            log.warning("submit %s has no reply subject; dropped", request.request_id)
            return
        registry = self.registry
        decision = self.placer.place(request, registry.candidates(), registry.index.overlap)
        if decision.worker_id is None:
            await self.bus.publish(
                msg.reply,
                Rejected(
                    request_id=request.request_id,
                    reason=decision.reason,
                    message=decision.message,
                    retryable=decision.retryable,
                ),
            )
        else:
            forwarded = msgspec.structs.replace(request, worker_id=decision.worker_id)
            try:
                await self.bus.publish(
                    subjects.worker_generate(decision.worker_id), forwarded, reply=msg.reply
                )
            except PayloadTooLarge as exc:  # the worker id pushed it over the limit
                message = f"the request is too large to forward: {exc}"
                decision = Decision(
                    None, RejectReason.INVALID_REQUEST, message, decision.candidates
                )
                await self.bus.publish(
                    msg.reply,
                    Rejected(
                        request_id=request.request_id,
                        reason=decision.reason,
                        message=message,
                        param="prompt",
                    ),
                )
            else:
                prompt, worker = (
                    len(request.prompt_token_ids),
                    registry.view.workers[decision.worker_id],
                )
                cost = self.placer.cost
                uncached = cost.uncached_tokens(
                    prompt, decision.prefix_hit_blocks, worker.stats.block_size
                )
                registry.placed(decision.worker_id, uncached)
        # The record is for telemetry: off the request's critical path. Yielding once lets
        # the client's flusher task put the forward on the wire before the record is built.
        await asyncio.sleep(0)
        await self.bus.publish(
            subjects.EVENTS_PLACEMENT,
            PlacementRecord(
                request_id=request.request_id,
                worker_id=decision.worker_id,
                reason=decision.reason or PLACED,
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
            ),
        )

    async def _on_status(self, _: ClusterStatusRequest, msg: Msg) -> None:
        views = [
            WorkerView(stats=e.stats, alive=alive, last_seen_ms=e.last_seen_ms)
            for e, alive in self.registry.view.snapshot()
        ]
        await self.bus.reply(msg, ClusterStatus(scheduler_id=self.scheduler_id, workers=views))

    async def drain(self) -> None:
        """Nothing is held here: in-flight requests live on workers and gateways."""
        await asyncio.sleep(0)

    async def close(self) -> None:
        for task in list(self._syncing.values()):
            task.cancel()
        if self.bus is not None:
            await self.bus.drain()
